"""Gradient checkpointing composes with conversion, whichever comes first: HF gradient_checkpointing_enable()
(reentrant and non-reentrant) and timm set_grad_checkpointing(). A checkpointed converted training step gives
the gradients of the same converted model without checkpointing; checkpointing really recomputes (fewer
saved bytes)."""
import copy

import pytest
import torch

from lmbp_convert import SavedTensorLedger, convert
from lmbp_convert.match.norm_exact import NormExact
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.trace.tracer import call_model
from testsupport.families import hf, timm_vit


def _loss(model, probe):
    out = call_model(model, probe)
    y = out.logits if hasattr(out, "logits") else out
    return y.float().pow(2).mean()


def _grads(model, probe):
    model.train()
    model.zero_grad(set_to_none=True)
    with SavedTensorLedger(model) as led:
        loss = _loss(model, probe)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, led.bytes


def _assert_same_grads(got, want):
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)


def _enable_hf(model, reentrant):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:  # reentrant checkpoints only backprop into blocks whose inputs require grad
        model.enable_input_require_grads()


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("order", ["convert_then_enable", "enable_then_convert"])
def test_hf_gradient_checkpointing(order, reentrant):
    base = hf("llama")
    reference = copy.deepcopy(base)
    convert(reference)  # converted, no checkpointing
    probe, _, _ = make_probe(base, batch=2, seq=16)
    if order == "convert_then_enable":
        convert(base)
        _enable_hf(base, reentrant)
    else:
        _enable_hf(base, reentrant)
        report = convert(base).lmbp_report
        assert report.verified and report.plan.of(NormExact) and report.plan.gated_mlps, str(report)
    assert any(getattr(m, "gradient_checkpointing", False) is True for m in base.modules())
    if reentrant:
        reference.enable_input_require_grads()  # same graph: input grads in both
    loss_ckpt, g_ckpt, bytes_ckpt = _grads(base, probe)
    loss_ref, g_ref, bytes_ref = _grads(reference, probe)
    torch.testing.assert_close(loss_ckpt, loss_ref)
    _assert_same_grads(g_ckpt, g_ref)
    assert bytes_ckpt < 0.7 * bytes_ref, (bytes_ckpt, bytes_ref)


@pytest.mark.parametrize("order", ["convert_then_enable", "enable_then_convert"])
def test_timm_set_grad_checkpointing(order):
    model = timm_vit()
    reference = copy.deepcopy(model)
    convert(reference)
    probe, _, _ = make_probe(model, batch=2)
    if order == "convert_then_enable":
        convert(model)
        model.set_grad_checkpointing(True)
    else:
        model.set_grad_checkpointing(True)
        report = convert(model).lmbp_report
        assert report.verified and report.plan.of(NormExact) and report.plan.act_swaps, str(report)
    assert model.grad_checkpointing
    loss_ckpt, g_ckpt, bytes_ckpt = _grads(model, probe)
    loss_ref, g_ref, bytes_ref = _grads(reference, probe)
    torch.testing.assert_close(loss_ckpt, loss_ref)
    _assert_same_grads(g_ckpt, g_ref)
    assert bytes_ckpt < 0.7 * bytes_ref, (bytes_ckpt, bytes_ref)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_checkpointed_converted_model_trains():
    model = hf("llama")
    convert(model)
    _enable_hf(model, reentrant=False)
    probe, _, _ = make_probe(model, batch=2, seq=16)
    ids = probe["input_ids"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
