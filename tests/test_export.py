"""lmbp_convert.export: the plain state dict of a converted (and trained) model computes what it computes.

Export undoes folds (``fold_norms=True``, `FOLD`); in the exact default the state dict is already the plain one."""
import copy

import pytest
import torch
from torch import nn

from lmbp_convert import convert
from lmbp_convert.export import ExportError, plain_state_dict, save_pretrained
from lmbp_convert.match.norm_exact import NormExact
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.nn.norms import FOLD_MARKER
from lmbp_convert.trace.tracer import call_model
from testsupport.families import hf, timm_swin

FOLD = dict(fold_norms=True)


def _out(model, probe):
    with torch.no_grad():
        out = call_model(model, probe)
    if isinstance(out, tuple):
        return torch.cat([o.flatten() for o in out])
    for attr in ("logits", "last_hidden_state"):
        if hasattr(out, attr):
            return getattr(out, attr)
    return out


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _perturb(model, scale=0.05, seed=1):
    """Stand-in for training: move every parameter (γ, β of re-applied norms, folded weights, added biases)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=gen))


def _roundtrip(build, **convert_kw):
    """(converted+perturbed model, fresh plain model loaded with its plain_state_dict, probe)."""
    model = build()
    plain = copy.deepcopy(model)
    convert(model, **convert_kw, **FOLD)
    _perturb(model)
    model.eval()
    sd = plain_state_dict(model)
    assert set(sd) == set(plain.state_dict())  # no missing, no extra keys
    plain.load_state_dict(sd, strict=True)
    probe, _, _ = make_probe(plain, batch=2, seq=9)
    return model, plain.eval(), probe


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_post_ln_bert_unfolds_linears_with_current_gamma_beta():
    model, plain, probe = _roundtrip(lambda: hf("bert", head="cls"))
    folds = [f for f in model.lmbp_report.plan.norm_folds if f.reapply]
    assert folds, str(model.lmbp_report)
    assert _rel(_out(plain, probe), _out(model, probe)) < 1e-5
    # the naive state dict (folded Linears + γ, β) is a different model: the unfold is what makes it right
    # (a plain model refuses it in a strict load: the converted state dict says its Linears are folded)
    naive = copy.deepcopy(plain)
    with pytest.raises(RuntimeError, match=f"Unexpected key.*{FOLD_MARKER}"):
        naive.load_state_dict(model.state_dict())
    naive.load_state_dict(model.state_dict(), strict=False)
    assert _rel(_out(naive, probe), _out(model, probe)) > 1e-2


def test_pre_ln_state_dict_is_already_plain():
    model = hf("llama")
    convert(model, **FOLD)
    _perturb(model)
    sd, own = plain_state_dict(model), model.state_dict()
    assert set(sd) == set(own)
    assert all(sd[k] is own[k] or torch.equal(sd[k], own[k]) for k in sd)


def test_bias_less_linear_gets_no_new_key_and_the_state_dict_is_plain():
    """timm Swin's patch merging: LayerNorm(4C) → reduction Linear(4C → 2C, no bias). Folding β would need a
    ``reduction.bias`` that the plain architecture has not; instead the norm keeps the shift β/γ as its own
    ``bias`` (a plain LayerNorm with γ = 1) and the converted forward adds W'·β/γ after the Linear. So the
    converted model's own state dict is already the plain one — also after training."""
    model, plain, probe = _roundtrip(timm_swin)
    shifted = [f for f in model.lmbp_report.plan.norm_folds if f.beta == "shift"]
    assert shifted and all(t.adds_bias for f in shifted for t in f.targets), str(model.lmbp_report)
    own = model.state_dict()
    assert not any(f"{t.name}.bias" in own for f in shifted for t in f.targets)
    assert _rel(_out(plain, probe), _out(model, probe)) < 1e-5
    sd = plain_state_dict(model)
    assert all(torch.equal(sd[k], own[k]) for k in sd)
    plain.load_state_dict(own, strict=True)
    assert _rel(_out(plain, probe), _out(model, probe)) < 1e-5


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_untied_head_gets_no_bias_and_exports_after_training():
    """GPT-2 with untie=True folds ln_f (with β) into an untied, bias-less lm_head: no ``lm_head.bias`` is made
    (it was, and a plain load dropped it); the shift trains as ln_f's own bias and every state stays plain."""
    model = hf("gpt2")
    plain = copy.deepcopy(model)
    convert(model, untie=True, **FOLD)
    fold = next(f for f in model.lmbp_report.plan.norm_folds if any(t.name == "lm_head" for t in f.targets))
    assert fold.beta == "shift" and model.lm_head.bias is None
    _perturb(model)  # trains the shift (ln_f.bias) and the head
    sd = plain_state_dict(model)
    assert "lm_head.bias" not in sd and set(sd) == set(plain.state_dict())
    plain.config.tie_word_embeddings = False
    plain.lm_head.weight = nn.Parameter(plain.lm_head.weight.detach().clone())
    plain.load_state_dict(sd, strict=True)
    probe, _, _ = make_probe(plain, batch=2, seq=9)
    assert _rel(_out(plain.eval(), probe), _out(model.eval(), probe)) < 1e-5


class _GemmaToy(nn.Module):
    """A Gemma-style (x̂·(1 + w)) norm feeding a Linear and returned as an output: re-applied at the output."""

    def __init__(self):
        super().__init__()
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

        self.norm = GemmaRMSNorm(16)
        self.lin = nn.Linear(16, 8)
        with torch.no_grad():
            self.norm.weight.uniform_(-0.5, 0.5)

    def forward(self, x):
        y = self.norm(x)
        return self.lin(y), y


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_one_plus_w_norm_unfolds_with_one_plus_w():
    model = _GemmaToy()
    plain = copy.deepcopy(model)
    x = torch.randn(2, 5, 16)
    convert(model, probe=x, **FOLD)
    fold, = model.lmbp_report.plan.norm_folds
    assert fold.param == "1+w" and fold.reapply
    _perturb(model)
    plain.load_state_dict(plain_state_dict(model))
    torch.testing.assert_close(_out(plain, x), _out(model, x), rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_zero_gamma_with_live_channel_is_refused():
    model = _GemmaToy()
    x = torch.randn(2, 5, 16)
    convert(model, probe=x, **FOLD)
    with torch.no_grad():
        model.norm.weight[3] = -1.0  # γ = 1 + w = 0, but the folded Linear still reads channel 3
    with pytest.raises(ExportError, match="γ is exactly 0"):
        plain_state_dict(model)


def test_report_found_on_wrapped_and_unwrapped_models():
    model = hf("bert", head="cls")
    convert(model, **FOLD)
    _perturb(model)
    wrapper = nn.ModuleDict({"inner": model})  # report on a submodule: keys get its prefix
    sd = plain_state_dict(wrapper)
    # every key of the model's own state dict but its fold markers (the plain architecture has none)
    assert set(sd) == {f"inner.{k}" for k in model.state_dict() if not k.endswith(f".{FOLD_MARKER}")}
    inner_sd = plain_state_dict(model)
    assert all(torch.equal(sd[f"inner.{k}"], v) for k, v in inner_sd.items())
    # a report whose names carry a wrapper's prefix (converted as part of a wrapper, exported unwrapped)
    prefixed = copy.deepcopy(model.lmbp_report)
    for f in prefixed.plan.norm_folds:
        f.name = f"inner.{f.name}"
        for t in f.targets:
            t.name = f"inner.{t.name}"
    stripped = plain_state_dict(model, report=prefixed)
    assert all(torch.equal(stripped[k], v) for k, v in inner_sd.items())
    with pytest.raises(ExportError, match="no conversion report"):
        plain_state_dict(hf("bert", head="cls"))


def test_save_pretrained_helper_writes_plain_checkpoint(tmp_path):
    from transformers import AutoModelForSequenceClassification

    model = hf("bert", head="cls")
    convert(model, **FOLD)
    _perturb(model)
    save_pretrained(model, tmp_path)
    loaded, info = AutoModelForSequenceClassification.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    probe, _, _ = make_probe(loaded, batch=2, seq=9)
    assert _rel(_out(loaded.eval(), probe), _out(model.eval(), probe)) < 1e-5
    assert isinstance(model.bert.encoder.layer[0].output.LayerNorm.weight, nn.Parameter)  # model untouched
    with pytest.raises(TypeError, match="state_dict"):
        save_pretrained(model, tmp_path, state_dict={})


def test_export_after_a_second_convert_call():
    """convert(norms only), then convert() again for the rest: the second report must not hide the first one's
    folds (convert() keeps the earlier report as ``report.previous``); without it the export refuses rather
    than writing folded Linears next to γ, β."""
    model = hf("bert", head="cls")
    plain = copy.deepcopy(model)
    convert(model, activations=False, **FOLD)
    convert(model, **FOLD)
    assert model.lmbp_report.plan.act_swaps and not model.lmbp_report.plan.norm_folds
    _perturb(model)
    plain.load_state_dict(plain_state_dict(model))
    probe, _, _ = make_probe(plain, batch=2, seq=9)
    assert _rel(_out(plain.eval(), probe), _out(model.eval(), probe)) < 1e-5


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_unreported_reapplied_norm_is_refused():
    model = hf("bert", head="cls")
    convert(model, **FOLD)
    object.__setattr__(model, "lmbp_report", type(model.lmbp_report)(type(model.lmbp_report.plan)()))
    with pytest.raises(ExportError, match="no conversion report describes"):
        plain_state_dict(model)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_non_finite_gamma_is_refused_not_written(value):
    """A NaN/inf γ of a re-applied norm would be divided out of its Linears: NaN weights, written silently."""
    model = hf("bert", head="cls")
    convert(model, **FOLD)
    norm = model.bert.encoder.layer[1].attention.output.LayerNorm
    assert isinstance(norm.weight, nn.Parameter)
    with torch.no_grad():
        norm.weight[0] = value
    with pytest.raises(ExportError, match="NaN or inf"):
        plain_state_dict(model)


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_tiny_gamma_overflowing_the_dtype_is_refused():
    """W'/γ with γ = 1e-6 overflows fp16: an inf weight is not the converted model's function."""
    model = hf("bert", head="cls").half()
    convert(model, **FOLD)
    norm = model.bert.encoder.layer[1].attention.output.LayerNorm
    with torch.no_grad():
        norm.weight[0] = 1e-7
    with pytest.raises(ExportError, match="NaN or inf in float16"):
        plain_state_dict(model)


def test_nan_residual_is_not_small():
    from lmbp_convert.export import _require_small

    with pytest.raises(ExportError, match="relative residual nan"):
        _require_small(torch.tensor([float("nan")]), torch.tensor(1.0), 1e-4, "head")


def test_exact_default_exports_its_own_state_dict():
    """Nothing folded: the plain state dict is the model's own, after training too, and a plain model loads it."""
    model = hf("bert", head="cls")
    plain = copy.deepcopy(model)
    convert(model)
    assert model.lmbp_report.plan.of(NormExact) and not model.lmbp_report.plan.norm_folds
    _perturb(model)
    model.eval()
    sd, own = plain_state_dict(model), model.state_dict()
    assert sd.keys() == own.keys() == plain.state_dict().keys() and all(torch.equal(sd[k], own[k]) for k in own)
    plain.load_state_dict(sd, strict=True)
    probe, _, _ = make_probe(plain, batch=2, seq=9)
    assert _rel(_out(plain.eval(), probe), _out(model, probe)) < 1e-5
