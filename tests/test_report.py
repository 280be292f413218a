"""Issue 36 item 5: the report read cold. It leads with one measured figure and the probe (shapes, dtypes, mode)
it was measured on; counts read naturally; no analytic figure is printed (plan_conversion measures its plan
applied and undone, which is convert()'s own figure on the test families; a meta plan says why it has none); a
LoRA model whose adapters keep no copy of their input says why nothing was shared."""
from __future__ import annotations

import pytest
import torch

from lmbp_convert import ConversionReport, convert, plan_conversion
from lmbp_convert.match.plan import NormFold
from model_state import assert_same, snapshot
from testsupport.families import FAMILIES, hf, lora_on_every_linear


def _lines(model) -> list[str]:
    return str(model.lmbp_report).splitlines()


def test_counts_read_naturally():
    model = hf("llama")
    rep = convert(model).lmbp_report
    assert rep.counts() == "converted: 2 gated MLPs, 1 loss, 5 norms (exact); 0 skipped"
    assert _lines(model)[1] == rep.counts()
    text = str(rep)
    assert ": 0 " not in rep.counts() and ", 0 " not in rep.counts()  # no "0 norms" beside "5 norms (exact)"
    assert "LM-head losses" not in text and "predicted" not in text
    one = convert(hf("llama"), include=["model.norm"]).lmbp_report
    assert one.counts() == "converted: 1 norm (exact); 0 skipped"


def test_unmeasured_reports_say_why():
    model = hf("llama")
    convert(model, measure=False)
    assert _lines(model)[0] == "lmbp-convert: activation memory saved: not measured (measure=False)"
    with torch.device("meta"):
        meta = hf("llama")
    convert(meta)
    head, text = _lines(meta)[0], str(meta.lmbp_report)
    assert head == ("lmbp-convert: activation memory saved: not measured (meta device: no weights to run the forward "
                    "with; convert() measures it on the model once its weights are loaded)"), head
    assert "line above" not in text and "predicted" not in text and "analytic" not in text


#: the families this check runs on in the fast loop (the rest of them run in CI's whole suite)
_FAST = ("llama", "bert", "timm_vit")


@pytest.mark.parametrize("family", [f if f in _FAST else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def test_plan_conversion_figure_is_what_convert_measures(family):
    """The figure a plan prints is within 5 % of what convert() then measures in the same mode (here: equal, for
    both apply the same rewrites and measure the same forward), and planning leaves the model as it was."""
    model = FAMILIES[family]()
    before = snapshot(model)
    plan = plan_conversion(model)
    assert_same(model, before, "plan_conversion")
    m = plan.measurement
    assert m is not None and m.by == "plan", plan.unmeasured_why
    head = str(ConversionReport(plan)).splitlines()[0]
    assert head.startswith("lmbp-convert plan: ") and "measured by applying this plan and undoing it" in head, head
    got = convert(model).lmbp_report.measurement
    assert (m.before, m.after, m.mode, m.inputs) == (got.before, got.after, got.mode, got.inputs)
    assert abs(m.saved - got.saved) <= 0.05 * got.saved


def test_plan_figure_bf16_lora_and_fold_mode():
    """LLaMA + LoRA in bf16 (where the per-rewrite estimate was 36 % off the ledger) and fold mode (whose plan
    swaps weights' data while it measures, and puts it back)."""
    for build, kw in ((lambda: lora_on_every_linear(hf("llama").to(torch.bfloat16)), {}),
                      (lambda: hf("llama"), {"fold_norms": True})):
        model = build()
        before = snapshot(model)
        plan = plan_conversion(model, **kw)
        assert_same(model, before, f"plan_conversion({kw})")
        got = convert(model, **kw).lmbp_report.measurement
        assert (plan.measurement.before, plan.measurement.after) == (got.before, got.after)


def test_plan_not_measured_where_it_cannot_be():
    plan = plan_conversion(hf("llama"), measure=False)
    assert plan.measurement is None
    assert str(ConversionReport(plan)).splitlines()[0] == ("lmbp-convert plan: activation memory saved: not "
                                                           "measured (measure=False)")
    with torch.device("meta"):
        meta = hf("llama")
    plan = plan_conversion(meta)
    assert plan.measurement is None and plan.unmeasured_why.startswith("meta device: ")


def test_fp32_lora_says_why_nothing_is_shared():
    model = lora_on_every_linear(hf("llama"))
    rep = convert(model).lmbp_report
    notes = [line for line in str(rep).splitlines() if line.startswith("note: LoRA inputs")]
    assert notes == ["note: LoRA inputs: nothing to share in 15 LoRA layers (adapters in float32 on a float32 input, "
                     "no active lora_dropout): no adapter keeps a private copy of its input, which only adapters "
                     "wider than the input (fp32 adapters on bf16 weights) or an active dropout make"], str(rep)
    shared = convert(lora_on_every_linear(hf("llama").to(torch.bfloat16))).lmbp_report
    assert "LoRA layers (input shared)" in shared.counts() and not shared.plan.notes


def test_fold_training_is_exact_where_everything_it_touches_is_frozen():
    """A fold reparameterises W·diag(γ): training differs only where one of those parameters trains."""
    full = convert(hf("llama"), fold_norms=True).lmbp_report
    assert all(f.trainable for f in full.plan.of(NormFold))
    assert "training not exact (affine folded: the optimiser trains the folded weights" in str(full)
    frozen = hf("llama")
    for name, p in frozen.named_parameters():
        p.requires_grad_(name.startswith("model.embed_tokens"))  # trains; no fold touches it
    rep = convert(frozen, fold_norms=True).lmbp_report
    folds = rep.plan.of(NormFold)
    assert folds and all(f.trainable == [] and f.training_differs() == "" for f in folds)
    assert rep.inexact_training == {} and "training not exact" not in str(rep)
    assert rep.gradient_error is not None and rep.gradient_error < 1e-5  # so verification compares gradients
