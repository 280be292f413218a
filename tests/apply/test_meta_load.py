"""Loading weights into a converted model (issue 10, item 3).

The natural way to prepare a large model: build it on ``meta``, ``convert()``, ``to_empty()``, then
``load_state_dict`` of the ORIGINAL checkpoint. The converted model keeps the original keys, so the load says
"All keys matched" — and it must also give the original model's outputs: the folded norms fold the arriving
γ, β into their Linears as they load. Loading the converted model's own state dict, or a checkpoint written by
``lmbp-convert`` (identity norms, already folded), must keep working unchanged.

These are the fold's mechanics (``fold_norms=True``, `FOLD`); the exact default keeps the original parameters, so
the original checkpoint simply loads (the tests parametrised on ``fold`` check that too).
"""
from __future__ import annotations

import copy

import pytest
import torch

from lmbp_convert import convert
from lmbp_convert.match.norm_exact import NormExact
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.trace.tracer import call_model
from testsupport.families import FAMILIES, hf

pytestmark = pytest.mark.compat  # meta init and the state-dict load paths differ across transformers releases

FOLD = dict(fold_norms=True)  # the fold-on-load hooks exist only for folded norms
FAMS = ["llama", "gemma", "gpt2", "bert", "vit", "timm_vit", "timm_swin"]
EXTRA = {"gpt2_untied": (lambda: hf("gpt2", tie_word_embeddings=False), {})}


def _out(model, probe) -> torch.Tensor:
    with torch.no_grad():
        out = call_model(model.eval(), probe)
    vals = [out] if isinstance(out, torch.Tensor) else [v for v in out.values() if isinstance(v, torch.Tensor)]
    return torch.cat([v.flatten().double() for v in vals])


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _build(name):
    return EXTRA[name][0]() if name in EXTRA else FAMILIES[name]()


def _fill_non_persistent(model, ref, sd) -> None:
    """Buffers no state dict holds (BERT's position ids): the user re-creates them; here, from the reference."""
    ref_bufs = dict(ref.named_buffers())
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n not in sd and n in ref_bufs:
                b.copy_(ref_bufs[n])


def _meta_converted(name, fold=True):
    """Build on ``meta``, convert, ``to_empty``: how a large model is prepared before its weights are read."""
    with torch.device("meta"):
        model = _build(name)
    report = convert(model, fold_norms=fold).lmbp_report
    assert report.plan.norm_folds if fold else (report.plan.of(NormExact) and not report.plan.norm_folds), str(report)
    model.to_empty(device="cpu")
    if hasattr(model, "tie_weights"):  # to_empty gives tied parameters separate storage: tie them again
        model.tie_weights()
    return model, report


@pytest.mark.parametrize("fold", [True, False], ids=["fold", "exact"])
@pytest.mark.parametrize("name", FAMS + sorted(EXTRA))
@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_meta_convert_then_load_original_weights(name, fold):
    ref = _build(name).eval()
    sd = ref.state_dict()
    probe, _, _ = make_probe(ref, batch=2, seq=9)
    model, _ = _meta_converted(name, fold)
    res = model.load_state_dict(sd)
    assert not res.missing_keys and not res.unexpected_keys
    _fill_non_persistent(model, ref, sd)
    assert _rel(_out(model, probe), _out(ref, probe)) < 1e-5
    # and it is the model convert() makes from real weights: same state dict, bit for bit
    real = copy.deepcopy(ref)
    convert(real, fold_norms=fold)
    own, want = model.state_dict(), real.state_dict()
    assert set(own) == set(want)
    for k in want:
        torch.testing.assert_close(own[k], want[k], rtol=1e-6, atol=1e-7, msg=k)


@pytest.mark.parametrize("name", ["gpt2_untied", "timm_swin", "bert"])
@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_sharded_partial_loads_in_any_order(name):
    """One ``load_state_dict(strict=False)`` per shard (transformers' ``load_sharded_checkpoint``, Trainer resume):
    a norm and its Linears may arrive in different calls, in either order."""
    ref = _build(name).eval()
    sd = ref.state_dict()
    probe, _, _ = make_probe(ref, batch=2, seq=9)
    keys = list(sd)
    for order in (keys, keys[::-1]):  # Linears before their norm, then norms before their Linears
        model, _ = _meta_converted(name)
        for i in range(0, len(order), 5):
            model.load_state_dict({k: sd[k] for k in order[i:i + 5]}, strict=False)
        _fill_non_persistent(model, ref, sd)
        assert _rel(_out(model, probe), _out(ref, probe)) < 1e-5, (name, order is keys)


@pytest.mark.parametrize("name", ["llama", "gpt2_untied", "timm_swin", "bert"])
def test_own_state_dict_reloads_unchanged(name):
    """A converted model's own state dict (after some training) loads back bit for bit: identity norms carry
    nothing to fold; post-LN norms keep γ, β as parameters and their Linears are already folded."""
    model = _build(name)
    convert(model, **FOLD)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(saved)
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k


@pytest.mark.parametrize("fold", [True, False], ids=["fold", "exact"])
@pytest.mark.parametrize("name", ["llama", "gpt2_untied", "timm_swin"])
def test_real_converted_model_loads_original_weights(name, fold):
    """Not only meta: loading the original checkpoint into an already converted model folds it as well."""
    ref = _build(name).eval()
    probe, _, _ = make_probe(ref, batch=2, seq=9)
    model = copy.deepcopy(ref)
    convert(model, fold_norms=fold)
    other = _build(name)
    with torch.no_grad():  # another set of original weights, non-identity norms included
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.load_state_dict(other.state_dict())
    assert _rel(_out(model, probe), _out(other.eval(), probe)) < 1e-5


@pytest.mark.parametrize("name", ["gpt2_untied", "timm_swin"])
def test_real_converted_model_takes_a_sharded_original_checkpoint_then_its_own(name):
    """Shards of another original checkpoint in a shuffled order, one key per call, then the model's own state
    dict the same way: right outputs, then every tensor back bit for bit (nothing folded twice)."""
    import random

    ref = _build(name).eval()
    probe, _, _ = make_probe(ref, batch=2, seq=9)
    model = copy.deepcopy(ref)
    convert(model, **FOLD)
    other = _build(name)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rng = random.Random(0)

    def load_one_key_at_a_time(sd):
        keys = list(sd)
        rng.shuffle(keys)
        for k in keys:
            model.load_state_dict({k: sd[k]}, strict=False)

    load_one_key_at_a_time(other.state_dict())
    assert _rel(_out(model, probe), _out(other.eval(), probe)) < 1e-5
    own = {k: v.clone() for k, v in model.state_dict().items()}
    load_one_key_at_a_time(own)
    for k, v in model.state_dict().items():
        assert torch.equal(v, own[k]), k


def test_checkpoint_written_by_the_cli_loads_unchanged(tmp_path):
    """A DST of ``lmbp-convert`` (identity norms, folded Linears) loaded into a meta-converted model: nothing is
    folded twice."""
    from transformers import AutoModelForCausalLM

    from lmbp_convert.checkpoint.api import convert_checkpoint

    ref = hf("llama").eval()
    ref.save_pretrained(tmp_path / "src")
    convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    dst = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    probe, _, _ = make_probe(ref, batch=2, seq=9)
    model, _ = _meta_converted("llama")
    model.load_state_dict(dst.state_dict())
    _fill_non_persistent(model, ref, dst.state_dict())
    assert _rel(_out(model, probe), _out(ref, probe)) < 1e-5


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_unexpressible_shift_is_an_error_not_a_silent_model():
    """γ = 0 on a channel with β ≠ 0, arriving for a norm folded into a bias-less Linear, cannot be held."""
    ref = _build("gpt2_untied")
    model, _ = _meta_converted("gpt2_untied")
    sd = ref.state_dict()
    sd["transformer.ln_f.weight"] = sd["transformer.ln_f.weight"].clone()
    sd["transformer.ln_f.weight"][0] = 0.0
    sd["transformer.ln_f.bias"] = sd["transformer.ln_f.bias"].clone()
    sd["transformer.ln_f.bias"][0] = 1.0
    with pytest.raises(RuntimeError, match="γ = 0"):
        model.load_state_dict(sd)


def test_transformers_sharded_loader_folds_the_original_checkpoint(tmp_path):
    """transformers' own per-shard loader (``load_sharded_checkpoint``, what Trainer resume uses) into a model
    converted on meta: each shard is one ``load_state_dict(strict=False)`` call."""
    try:  # transformers 5 keeps it with the Trainer; 4.x in modeling_utils
        from transformers.trainer_utils import load_sharded_checkpoint
    except ImportError:
        from transformers.modeling_utils import load_sharded_checkpoint

    ref = _build("gpt2_untied").eval()
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 3
    model, _ = _meta_converted("gpt2_untied")
    load_sharded_checkpoint(model, tmp_path, strict=True)
    _fill_non_persistent(model, ref, ref.state_dict())
    probe, _, _ = make_probe(ref, batch=2, seq=9)
    assert _rel(_out(model, probe), _out(ref, probe)) < 1e-5
