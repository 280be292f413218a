"""Nothing is left out of the report: every norm and activation a model has is either converted or skipped with
its reason, and the reasons name the real cause."""
import re

import pytest
from torch import nn

from lmbp_convert.apply.convert import plan_conversion
from lmbp_convert.catalogue import load_catalogue
from lmbp_convert.match.plan import OutputActSwap
from lmbp_convert.match.roles import ModuleRole, assign_roles

from testsupport.families import FAMILIES, MORE_FAMILIES, PROBE_FAMILIES, T5_SMALL, hf, hf_auto

_NORM_NAME = re.compile(r"(?i).*norm.*")
_ACT_NAME = re.compile(r"(?i).*(gelu|silu|swish|relu|tanh).*")

MODELS = {
    "llama": FAMILIES["llama"], "bert": FAMILIES["bert"], "gpt2": FAMILIES["gpt2"], "vit": FAMILIES["vit"],
    "timm_vit": FAMILIES["timm_vit"], "t5": PROBE_FAMILIES["t5"], "umt5": PROBE_FAMILIES["umt5"],
    "bart": PROBE_FAMILIES["bart"], "persimmon": lambda: hf("persimmon", qk_layernorm=True),
    # norms no catalogue names: LayerNorm1P (γ = 1 + w) and an affine-free LayerNorm (found by behaviour)
    "nemotron": lambda: hf("nemotron", num_key_value_heads=2), "olmo": lambda: hf("olmo", num_key_value_heads=2),
    # ReLU feed-forwards: activations with no approximate-backprop kind
    "opt": MORE_FAMILIES["opt"], "speech_to_text": PROBE_FAMILIES["speech_to_text"],
}


def candidates(model: nn.Module) -> dict[str, str]:
    """Leaf modules named like a norm or a GELU/SiLU activation, and whatever the roles call a norm or an
    activation (found by behaviour): name → what it is."""
    roles = assign_roles(model, load_catalogue())
    found = {}
    for name, mod in model.named_modules():
        leaf = next(mod.children(), None) is None
        cls = type(mod).__name__
        if roles[name].plays is ModuleRole.NORM or (leaf and _NORM_NAME.fullmatch(cls)):
            found[name] = "norm"
        elif roles[name].plays is ModuleRole.ACTIVATION or (leaf and _ACT_NAME.fullmatch(cls)):
            found[name] = "activation"
    return found


@pytest.mark.parametrize("family", sorted(MODELS))
def test_every_candidate_is_converted_or_skipped_with_a_reason(family):
    model = MODELS[family]().eval()
    plan = plan_conversion(model)
    converted = {m for it in plan.items for m in it.claims()}
    skipped = {s.name: s.reason for s in plan.skips}
    cands = candidates(model)
    assert cands, family
    missing = sorted(n for n in cands if n not in converted and not skipped.get(n, "").strip())
    assert not missing, (family, missing, [(s.name, s.reason) for s in plan.skips])


def test_persimmon_qk_norms_say_no_linear_reads_their_channels():
    """q/k norms feed attention only (after a rotary channel split): no Linear is downstream, so "channel slicing
    between norm and Linear" would be false."""
    plan = plan_conversion(hf("persimmon", qk_layernorm=True).eval())
    qk = [s for s in plan.skips if s.name.endswith(("q_layernorm", "k_layernorm"))]
    assert len(qk) == 4
    for s in qk:
        assert "no Linear reads its channels" in s.reason and "channel slicing" not in s.reason, s.reason
        assert "self_attn" in s.reason  # where the channels end: the attention product


def test_umt5_final_norm_names_the_op_and_the_tie_in_front_of_lm_head():
    """With dropout off, UMT5's decoder output is scaled by d_model^-0.5 (a mul) before the tied lm_head: both
    causes are named (the reason used to stop at "no Linear consumer reachable")."""
    plan = plan_conversion(_umt5_no_dropout().eval())
    (final,) = [s for s in plan.skips if s.name == "decoder.final_layer_norm"]
    assert "reaches lm_head only through mul in <model>" in final.reason, final.reason
    assert "lm_head.weight is tied" in final.reason, final.reason


def test_umt5_final_norm_names_the_dropout_when_it_blocks():
    plan = plan_conversion(PROBE_FAMILIES["umt5"]().eval())
    reasons = {s.name: s.reason for s in plan.skips}
    for side in ("encoder", "decoder"):
        assert f"blocked: dropout (p=0.1) at {side}.dropout" in reasons[f"{side}.final_layer_norm"]


def _umt5_no_dropout():
    return hf_auto("AutoModelForSeq2SeqLM", "umt5", **T5_SMALL, dropout_rate=0.0)


def test_post_norm_reasons_name_the_residual_add_and_the_nearest_linears():
    """OLMo2 normalises block outputs before the residual add: the Linears are there, behind the add (named
    nearest first, not every later layer), and its q/k norms feed attention only."""
    plan = plan_conversion(hf("olmo2", num_key_value_heads=2).eval())
    reasons = {s.name: s.reason for s in plan.skips}
    post = reasons["model.layers.0.post_attention_layernorm"]
    assert "reaches model.layers.0.mlp.gate_proj, model.layers.0.mlp.up_proj only through add in model.layers.0" \
        in post, post
    assert "no Linear reads its channels" in reasons["model.layers.0.self_attn.q_norm"]


def test_relu_feed_forwards_are_listed_with_why_they_stay():
    """ReLU keeps only its output, which the next Linear keeps too: it says so. A squared ReLU kept relu(x); it
    is swapped for one whose backward reads only its output (2·√y)."""
    plan = plan_conversion(MORE_FAMILIES["opt"]().eval())
    relu = [s for s in plan.skips if s.cls.endswith(":ReLU")]
    assert relu and all("backward reads only its output" in s.reason for s in relu), plan.skips
    plan = plan_conversion(hf("nemotron", num_key_value_heads=2).eval())
    assert not [s for s in plan.skips if "no approximate-backprop kind" in s.reason], plan.skips
    assert len(plan.of(OutputActSwap)) == 2
