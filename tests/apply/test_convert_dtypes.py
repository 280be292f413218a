"""A norm that casts its output (T5's RMSNorm casts to its half-precision weight) stays a cast once converted."""
from __future__ import annotations

import pytest
import torch
import transformers as T
from transformers import AutoConfig

from lmbp_convert import convert
from lmbp_convert.enums import ConvertedModule
from lmbp_convert.match.norm_exact import NormExact


def _t5_bf16_with_fp32_wo() -> torch.nn.Module:
    """As `from_pretrained(..., dtype=bfloat16)` loads T5: `wo` stays fp32 (`_keep_in_fp32_modules`), so the residual
    stream after the first MLP is fp32 and every later norm casts fp32 → bf16 for the bf16 Linears after it."""
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("t5", d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, vocab_size=64,
                               feed_forward_proj="gated-gelu", dropout_rate=0.0)
    m = T.T5EncoderModel(cfg).to(torch.bfloat16)
    for blk in m.encoder.block:
        blk.layer[-1].DenseReluDense.wo.float()
    return m


def test_a_norm_that_casts_its_output_is_converted_and_still_casts():
    m = _t5_bf16_with_fp32_wo()
    rep = convert(m).lmbp_report  # raised "expected m1 and m2 to have the same dtype" before
    assert rep.verification == "passed"
    assert len(rep.plan.of(NormExact)) == 4 and not rep.plan.norm_folds
    casting = {f.name: f.out_dtype for f in rep.plan.of(NormExact)}
    assert casting["encoder.block.0.layer.0.layer_norm"] is None  # bf16 in, bf16 out: nothing to cast
    assert casting["encoder.block.1.layer.0.layer_norm"] == "bfloat16"  # fp32 residual in, bf16 out
    norm = m.get_submodule("encoder.block.1.layer.0.layer_norm")
    assert isinstance(norm, ConvertedModule) and norm.out_dtype is torch.bfloat16
    ids = torch.randint(0, 64, (2, 7))
    m.train()
    m(input_ids=ids).last_hidden_state.float().pow(2).mean().backward()
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad and p.dim() == 2)


def test_the_cast_survives_the_plan_round_trip():
    from lmbp_convert.match.plan import Plan

    m = _t5_bf16_with_fp32_wo()
    plan = convert(m).lmbp_report.plan
    again = Plan.from_dict(plan.to_dict())
    assert "bfloat16" in [f.out_dtype for f in plan.of(NormExact)]
    assert [f.out_dtype for f in again.of(NormExact)] == [f.out_dtype for f in plan.of(NormExact)]


def _family(name: str):
    from testsupport.families import FAMILIES, PROBE_FAMILIES, randomize_norms

    torch.manual_seed(0)
    return randomize_norms({**FAMILIES, **PROBE_FAMILIES}[name]()).eval()


def _step_bytes(model, probe) -> int:
    """Exact saved-for-backward bytes of one training forward under bf16 autocast."""
    from lmbp_convert.memory import SavedTensorLedger

    with SavedTensorLedger() as ledger, torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**probe)
    (out.logits if hasattr(out, "logits") else out[0]).float().sum().backward()
    return ledger.bytes



@pytest.mark.parametrize("family", ["llama", "t5"])
def test_convert_under_autocast_analyses_outside_it_and_keeps_the_savings(family):
    """Once, inside ``torch.autocast`` verification compared bf16 rounding, not the rewrites: 5 of 7 rolled back on
    LLaMA, all 5 on T5, and the report said "passed". Now convert() traces and verifies outside autocast, keeps
    every rewrite (the plan is the one made outside), says so in a note, and leaves autocast on for the caller;
    a training step under autocast then saves exactly what the model converted outside autocast saves."""
    import copy

    from lmbp_convert.trace.probe import make_probe

    original = _family(family)
    outside, inside = copy.deepcopy(original), copy.deepcopy(original)
    convert(outside)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        convert(inside)
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is torch.bfloat16
    got, want = inside.lmbp_report, outside.lmbp_report
    assert not got.rolled_back and got.verification == "passed"
    assert got.plan.to_dict() == want.plan.to_dict()
    assert len(got.plan.items) == len(want.plan.items) >= 5
    assert any("torch.autocast (cpu: bfloat16)" in n for n in got.notes)
    assert not any("autocast" in n for n in want.notes)
    probe = make_probe(original)[0]
    saved = [_step_bytes(m, probe) for m in (original, outside, inside)]
    assert saved[1] == saved[2] < saved[0], saved
