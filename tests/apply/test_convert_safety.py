"""convert() is all-or-nothing, idempotent, keeps the model's state, and explains itself."""
import copy

import pytest
import torch
from torch import nn

import lmbp_convert.apply.rewrite as rewrite_mod
from lmbp_convert import ConvertOptions, NothingToConvertError, ProbeError, TraceError, convert
from lmbp_convert.match.norm_exact import NormExact
from lmbp_convert.nn import exact_norms
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.trace.tracer import call_model
from testsupport.families import FAMILIES, hf


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, [type(m) for m in model.modules()]


def _same(model, state):
    sd, types = state
    now = model.state_dict()
    return [type(m) for m in model.modules()] == types and sd.keys() == now.keys() and all(
        torch.equal(sd[k], now[k]) for k in sd)


def test_failing_probe_leaves_model_untouched():
    model = FAMILIES["llama"]()
    state = _state(model)
    with pytest.raises(TraceError, match="probe="):
        convert(model, probe={"not_an_argument": torch.zeros(1)})
    assert _same(model, state)


def test_model_without_probe_gets_a_clear_error():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4), nn.GELU())
    with pytest.raises(ProbeError, match="pass probe="):
        convert(model)
    report = convert(model, probe=torch.randn(2, 8)).lmbp_report
    assert [f.name for f in report.plan.of(NormExact)] == ["1"] and report.plan.of(NormExact)[0].readers == ["2"]
    assert [a.name for a in report.plan.act_swaps] == ["3"]


def test_nothing_to_convert_is_an_error_that_names_the_candidates():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.LayerNorm(8))  # norm feeds nothing
    with pytest.raises(NothingToConvertError, match="no Linear consumer"):
        convert(model, probe=torch.randn(2, 8))


def test_bad_options_fail_before_anything():
    model = FAMILIES["llama"]()
    state = _state(model)
    with pytest.raises(ValueError, match="bits"):
        convert(model, bits=7)
    with pytest.raises(ValueError, match="regular expression"):
        convert(model, exclude=["(unclosed"])
    with pytest.raises(ValueError, match="nothing to convert"):
        ConvertOptions(activations=False, norms=False, gated_mlp=False, lora_inputs=False, loss=False)
    assert _same(model, state)


def test_rewrite_that_changes_outputs_is_rolled_back(monkeypatch):
    model = FAMILIES["llama"]().eval()
    ref = copy.deepcopy(model)
    real = rewrite_mod.fold_affine
    calls = []

    def corrupt(weight, bias, gamma, beta, layout="out_in"):  # a wrong fold for one norm's Linears
        w, b = real(weight, bias, gamma, beta, layout)
        calls.append(1)
        return (w * 1.5 if len(calls) <= 2 else w), b

    monkeypatch.setattr(rewrite_mod, "fold_affine", corrupt)
    report = convert(model, fold_norms=True).lmbp_report
    assert report.verified and report.rolled_back, str(report)
    assert "model.layers.0.input_layernorm" in report.rolled_back[0][0]
    assert any("rolled back" in s.reason for s in report.plan.skips)
    probe, _, _ = make_probe(model)
    with torch.no_grad():
        a, b = call_model(model, probe).logits, call_model(ref, probe).logits
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    assert type(model.model.layers[0].input_layernorm) is type(ref.model.layers[0].input_layernorm)


_REAL_EXACT_NORM = exact_norms.MSExactNorm


class _WrongExactNorm(_REAL_EXACT_NORM):
    def forward(self, x):
        return super().forward(x) * 1.5


def test_exact_norm_that_changes_outputs_is_rolled_back_alone(monkeypatch):
    model = FAMILIES["llama"]().eval()
    ref = copy.deepcopy(model)
    made = []

    def build(*args, **kwargs):  # the first exact norm built computes a wrong output
        made.append(1)
        return (_WrongExactNorm if len(made) == 1 else _REAL_EXACT_NORM)(*args, **kwargs)

    monkeypatch.setattr(exact_norms, "MSExactNorm", build)
    report = convert(model).lmbp_report
    assert report.verified and [label for label, _ in report.rolled_back] == [
        "norm model.layers.0.input_layernorm (exact)"], str(report)
    assert any(s.name == "model.layers.0.input_layernorm" and "rolled back" in s.reason for s in report.plan.skips)
    assert len(report.plan.of(NormExact)) == 4, str(report)
    probe, _, _ = make_probe(model)
    with torch.no_grad():
        a, b = call_model(model, probe).logits, call_model(ref, probe).logits
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    assert type(model.model.layers[0].input_layernorm) is type(ref.model.layers[0].input_layernorm)
    assert type(model.model.layers[1].input_layernorm) is not type(ref.model.layers[1].input_layernorm)
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())


def test_idempotent_and_reports_already_converted():
    model = FAMILIES["gpt2"]()
    convert(model)
    state = _state(model)
    report = convert(model).lmbp_report
    assert report.plan.empty and report.plan.already_converted
    assert "already converted" in str(report)
    assert _same(model, state)


def test_keeps_mode_dtype_device_and_requires_grad():
    model = FAMILIES["llama"]().to(torch.bfloat16)
    model.train()
    model.model.layers[0].eval()
    model.model.embed_tokens.weight.requires_grad_(False)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    convert(model)
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training
    assert not model.model.layers[0].input_layernorm.training
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and p.device.type == "cpu"
        assert p.requires_grad == flags.get(n, True), n
    for b in model.buffers():
        assert b.dtype in (torch.bfloat16, torch.int64, torch.float32)


def test_state_dict_keys_are_kept():
    model = FAMILIES["llama"]()
    keys = set(model.state_dict())
    convert(model, fold_norms=True)
    assert set(model.state_dict()) == keys
    norm = model.model.layers[0].input_layernorm
    assert torch.all(norm.weight == 1)  # folded: an identity γ stands in its place


def test_exact_default_keeps_the_state_dict_and_the_parameters():
    model = FAMILIES["llama"]()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    report = convert(model).lmbp_report
    assert report.plan.of(NormExact) and not report.plan.norm_folds, str(report)
    now = model.state_dict()
    assert now.keys() == sd.keys() and all(torch.equal(now[k], sd[k]) for k in sd)
    assert all(p is params[n] for n, p in model.named_parameters()) and dict(model.named_parameters()).keys() == \
        params.keys()


def test_include_exclude_by_name_and_regex():
    model = FAMILIES["llama"]()
    rep = convert(model, exclude=[r"model\.layers\.0\..*", "model.norm"]).lmbp_report
    names = rep.swapped
    assert names and not any(n.startswith("model.layers.0.") or n == "model.norm" for n in names)
    model = FAMILIES["llama"]()
    rep = convert(model, include=["model.layers.1.input_layernorm"]).lmbp_report
    assert rep.swapped == ["model.layers.1.input_layernorm"]


def test_activation_and_norm_switches():
    model = FAMILIES["bert"]()
    rep = convert(model, norms=False).lmbp_report
    assert rep.plan.act_swaps and not rep.plan.norm_folds and not rep.plan.of(NormExact)
    model = FAMILIES["bert"]()
    rep = convert(model, activations=False).lmbp_report
    assert rep.plan.of(NormExact) and not rep.plan.act_swaps


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_tied_head_is_skipped_with_reason_unless_untied():
    model = hf("llama", tie_word_embeddings=True)
    rep = convert(model, keep_affine=False).lmbp_report
    skip = {s.name: s.reason for s in rep.plan.skips}
    assert "tied" in skip["model.norm"]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # folding, the norm keeps its affine instead (lm_head keeps its output anyway); the weights stay tied
    model = hf("llama", tie_word_embeddings=True)
    rep = convert(model, fold_norms=True).lmbp_report
    (keep,) = [k for k in rep.plan.items if k.name == "model.norm"]
    assert keep.tag == "norm_keeps" and "tied" in keep.fold_refused and keep.keepers == ["lm_head"]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # the exact default: an exact norm, its output shared with the tied head; the weights stay tied
    model = hf("llama", tie_word_embeddings=True)
    rep = convert(model).lmbp_report
    (exact,) = [k for k in rep.plan.items if k.name == "model.norm"]
    assert exact.tag == "norm_exact" and exact.readers == ["lm_head"] and rep.verified
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model = hf("llama", tie_word_embeddings=True)
    ref = copy.deepcopy(model).eval()
    rep = convert(model, untie=True, fold_norms=True).lmbp_report
    assert "model.norm" in [f.name for f in rep.plan.norm_folds] and rep.verified
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    probe, _, _ = make_probe(model)
    with torch.no_grad():
        assert torch.allclose(call_model(model.eval(), probe).logits, call_model(ref, probe).logits, atol=1e-5)


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_post_ln_reapplies_affine_on_residual_and_output():
    model = hf("bert", head="base")
    rep = convert(model, fold_norms=True).lmbp_report
    sites = [r.describe() for f in rep.plan.norm_folds for r in f.reapply]
    assert any("encoder.layer.0.output" in s for s in sites)
    assert any("last_hidden_state" in s for s in sites)
    assert rep.verified and rep.relative_error < 1e-5
    skip = {s.name: s.reason for s in rep.plan.skips}
    assert "dropout" in skip["embeddings.LayerNorm"]


def test_deepcopy_of_converted_model_keeps_working():
    model = hf("bert", head="base").eval()
    convert(model)
    twin = copy.deepcopy(model)
    probe, _, _ = make_probe(model)
    with torch.no_grad():
        twin.encoder.layer[0].attention.output.LayerNorm.bias.add_(1.0)  # only the copy's hooks must see this
        a = call_model(model, probe).last_hidden_state
        b = call_model(twin, probe).last_hidden_state
    assert not torch.allclose(a, b)


@pytest.mark.compat
def test_meta_model_is_planned_and_swapped_without_verification():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    rep = convert(model).lmbp_report
    assert rep.verified is None and "meta" in rep.notes[0]
    assert len(rep.plan.of(NormExact)) == 5 and not rep.plan.norm_folds


def test_report_is_printable_and_serialisable():
    import json

    model = FAMILIES["timm_swin"]()
    rep = convert(model).lmbp_report
    text = str(rep)
    assert "layers.0.blocks.0.norm1" in text and "skipped:" in text and "per image" in text
    d = rep.to_dict()
    json.dumps(d)
    assert d["predicted_saved_bytes"] > 0 and d["plan"]["norm_exact"]


def _lora(model, **kw):
    from peft import LoraConfig, get_peft_model

    cfg = dict(r=4, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj", "qkv", "fc1",
                                    "query", "value", "dense"], lora_dropout=0.0)
    cfg.update(kw)
    return get_peft_model(model, LoraConfig(**cfg))


@pytest.mark.parametrize("family", ["llama", "timm_vit"])
def test_fold_into_lora_wrapped_linears_after_get_peft_model(family):
    model = _lora(FAMILIES[family]())
    with torch.no_grad():  # a trained-looking adapter, so A·diag(γ) matters
        for n, p in model.named_parameters():
            if "lora_B" in n and family == "llama":  # RMSNorm: no β, any B is exact
                p.normal_(0, 0.1)
    model.eval()
    ref = copy.deepcopy(model)
    probe = make_probe(model)[0]
    rep = convert(model, fold_norms=True).lmbp_report
    lora_targets = [t for f in rep.plan.norm_folds for t in f.targets if t.base]
    assert lora_targets and rep.verified, str(rep)
    with torch.no_grad():
        a, b = call_model(model, probe), call_model(ref, probe)
    a = a.logits if hasattr(a, "logits") else a
    b = b.logits if hasattr(b, "logits") else b
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_lora_with_dropout_and_norm_bias_is_blocked_with_reason():
    """Blocked for a fold (β would enter the adapter, which drops it); exact norms (the default) convert."""
    model = _lora(FAMILIES["timm_vit"](), lora_dropout=0.1)
    exact = copy.deepcopy(model)
    rep = convert(model, fold_norms=True).lmbp_report
    reasons = " ".join(s.reason for s in rep.plan.skips)
    assert "lora_dropout" in reasons
    rep = convert(exact).lmbp_report
    assert rep.plan.of(NormExact) and "lora_dropout" not in str(rep), str(rep)
