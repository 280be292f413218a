"""A norm that casts its output (T5's RMSNorm casts to its half-precision weight) stays a cast once converted."""
from __future__ import annotations

import torch
import transformers as T
from transformers import AutoConfig

from lmbp_convert import convert
from lmbp_convert.kinds import ConvertedModule
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
