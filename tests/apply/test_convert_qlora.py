"""The QLoRA flow: a checkpoint folded on disk (identity norms), loaded with 4-bit projections, then convert() and
LoRA. The norms are swapped although their consumers' weights cannot take a fold, and the gated MLP is fused over
the quantized projections; outputs and gradients stay those of plain QLoRA on the same weights."""
from __future__ import annotations

import pytest
import torch

from testsupport.blocks import block_bytes
from testsupport.quant_standin import quantize_linears
from lmbp_convert import convert
from lmbp_convert.checkpoint import mark_prefolded
from lmbp_convert.match.plan import NormFold
from lmbp_convert.nn.gated_mlp import MSGatedMLP
from testsupport.families import hf

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _prefolded_llama(dtype: torch.dtype):
    """A LLaMA as loaded from lmbp-convert's output: norm weights 1 (their γ went into the Linears) and the record
    in its config; then its projections quantized."""
    model = hf("llama").to(dtype)
    norms = [n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
    with torch.no_grad():
        for n in norms:
            model.get_submodule(n).weight.fill_(1)
    mark_prefolded(model, {"folded_norms": norms})
    return quantize_linears(model, TARGETS).train(), norms


def _lora(model):
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(TARGETS), task_type="CAUSAL_LM")
    return peft.get_peft_model(model, cfg).train()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefolded_norms_and_gated_mlps_convert_over_quantized_projections(dtype):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    plain, norms = _prefolded_llama(dtype)
    ours, _ = _prefolded_llama(dtype)
    rep = convert(ours).lmbp_report
    assert not rep.plan.skips, rep.plan.skips
    assert sorted(f.name for f in rep.plan.norm_folds) == sorted(norms)
    assert all(f.prefolded and not f.reapply for f in rep.plan.norm_folds)
    assert len(rep.plan.gated_mlps) == 2
    assert isinstance(ours.model.layers[0].mlp, MSGatedMLP)
    assert rep.verified
    plain, ours = _lora(plain), _lora(ours)
    torch.manual_seed(1)
    with torch.no_grad():  # the same adapters, as if trained a little
        theirs = dict(ours.named_parameters())
        for n, p in plain.named_parameters():
            if "lora_" in n:
                if "lora_B" in n:
                    torch.nn.init.normal_(p, std=0.02)
                theirs[n].copy_(p)
    losses, grads = [], []
    for m in (plain, ours):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach().float())
        grads.append({n: p.grad.float() for n, p in m.named_parameters() if p.requires_grad})
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(losses[0], losses[1], rtol=tol, atol=tol)
    for n, g in grads[0].items():
        assert torch.allclose(g, grads[1][n], rtol=tol, atol=tol * max(1.0, float(g.abs().max()))), n
    before, after = block_bytes(plain, ids), block_bytes(ours, ids)
    assert after < 0.8 * before, (before, after)


def test_not_prefolded_quantized_consumers_still_block_the_fold():
    model = hf("llama").eval()
    quantize_linears(model, ("q_proj", "k_proj", "v_proj"))
    rep = convert(model, gated_mlp=False).lmbp_report
    reason = {s.name: s.reason for s in rep.plan.skips}["model.layers.0.input_layernorm"]
    assert "quantized Linear" in reason and "its weight cannot be folded" in reason


def test_prefolded_norm_with_a_non_identity_weight_is_not_swapped():
    model, norms = _prefolded_llama(torch.float32)
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight.mul_(2)
    rep = convert(model).lmbp_report
    assert "model.layers.0.input_layernorm" in {s.name for s in rep.plan.skips}


def test_lora_added_before_convert():
    """PEFT wraps the model (names gain a prefix) and the quantized projections (the adapters are part of the
    projection): the record's norms are still found, swapped, and the gated MLPs fused."""
    model, norms = _prefolded_llama(torch.float32)
    model = _lora(model)
    rep = convert(model).lmbp_report
    assert not rep.plan.skips, rep.plan.skips
    assert sorted(f.name for f in rep.plan.norm_folds) == sorted(f"base_model.model.{n}" for n in norms)
    assert len(rep.plan.gated_mlps) == 2 and rep.verified


def test_unfolded_checkpoint_loaded_later_is_refused():
    """The swapped norms have no Linear to fold a non-identity γ into: loading such a state dict is an error, not a
    silently different model."""
    model, _ = _prefolded_llama(torch.float32)
    convert(model)
    sd = model.state_dict()
    sd["model.layers.0.input_layernorm.weight"] = torch.full_like(sd["model.layers.0.input_layernorm.weight"], 2.0)
    with pytest.raises(RuntimeError, match="no Linear to fold it into"):
        model.load_state_dict(sd)
    model.load_state_dict(model.state_dict())  # its own state dict loads as it is


def test_frozen_prefolded_norms_train_as_the_original():
    """Issue 36 item 4: the checkpoint was folded on disk and every weight is frozen (prepare_model_for_kbit_training
    freezes them; LoRA trains): convert() folds nothing, so no "training not exact" names the folded weights, and
    verification compares the adapters' gradients with the original's. With γ still trainable (convert() before
    PEFT freezes it), the report says what changes: γ becomes the fixed identity."""
    model, norms = _prefolded_llama(torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    model = _lora(model)
    rep = convert(model).lmbp_report
    folds = rep.plan.of(NormFold)
    assert len(folds) == len(norms) and all(f.prefolded and f.trainable == [] for f in folds)
    assert rep.inexact_training == {} and "training not exact" not in str(rep)
    assert rep.gradient_error is not None and rep.gradient_error < 1e-5, str(rep)
    live, _ = _prefolded_llama(torch.float32)
    rep = convert(live).lmbp_report
    assert set(rep.inexact_training.values()) == {NormFold.prefolded_training}
    assert f"training not exact ({NormFold.prefolded_training}): model.layers.0.input_layernorm" in str(rep)
