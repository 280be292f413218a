"""MSCrossEntropyLoss against HF's own loss functions (transformers ≥ 4.46): loss and logits gradient in fp32 and
in the logits' dtype, with num_items_in_batch, shift_labels and ignore_index; a plain object that pickles."""
from __future__ import annotations

import copy
import inspect
import pickle
from types import SimpleNamespace

import pytest
import torch

from lmbp_convert.memory import SavedTensorLedger
from lmbp_convert.nn.loss import MSCrossEntropyLoss

loss_utils = pytest.importorskip("transformers.loss.loss_utils", reason="transformers < 4.46 has no loss functions")
V = 97


def _example(dtype, shape=(2, 9), seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, V, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, V, shape, generator=gen)
    labels[torch.rand(shape, generator=gen) < 0.3] = -100
    return logits, labels


def _run(fn, logits, *args, **kw):
    x = logits.detach().clone().requires_grad_()
    loss = fn(x, *args, **kw)
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), g


def _assert_same(ours, theirs, dtype):
    (l1, g1), (l0, g0) = ours, theirs
    assert l1.dtype == l0.dtype == torch.float32 and g1.dtype == g0.dtype == dtype
    torch.testing.assert_close(l1, l0, atol=1e-6, rtol=1e-6)
    eps = 2 * torch.finfo(dtype).eps + 8 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(g1.float(), g0.float(), atol=eps * float(g0.abs().max()) + 1e-8, rtol=0)


def _shift_labels_supported() -> bool:
    return "shift_labels" in inspect.signature(loss_utils.ForCausalLMLoss).parameters


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("extra", [{}, {"num_items_in_batch": torch.tensor(5)}, {"num_items_in_batch": 5},
                                   {"ignore_index": 3}, {"shift_labels": "given"}])
def test_causal_equals_hf(dtype, extra):
    logits, labels = _example(dtype)
    extra = dict(extra)
    if extra.get("ignore_index") == 3:
        labels = labels.clamp(min=0)
    if "shift_labels" in extra:
        if not _shift_labels_supported():
            pytest.skip("this transformers' ForCausalLMLoss has no shift_labels")
        extra["shift_labels"] = torch.roll(labels, -2, dims=1)
    ours = _run(MSCrossEntropyLoss(True), logits, labels, V, **extra)
    theirs = _run(loss_utils.ForCausalLMLoss, logits, labels, V, **extra)
    _assert_same(ours, theirs, dtype)
    # keyword call, as LLaMA's forward makes it
    ours_kw = _run(lambda x: MSCrossEntropyLoss(True)(logits=x, labels=labels, vocab_size=V, **extra), logits)
    torch.testing.assert_close(ours_kw[0], ours[0], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("extra", [{}, {"num_items_in_batch": torch.tensor(4)}])
def test_flat_equals_masked_lm_and_token_classification(dtype, extra):
    logits, labels = _example(dtype)
    _assert_same(_run(MSCrossEntropyLoss(False), logits, labels, V, **extra),
                 _run(loss_utils.ForMaskedLMLoss, logits, labels, V, **extra), dtype)
    config = SimpleNamespace(num_labels=V)
    _assert_same(_run(MSCrossEntropyLoss(False), logits, labels, config, **extra),
                 _run(loss_utils.ForTokenClassification, logits, labels, config, **extra), dtype)


def test_saves_no_fp32_copy_of_bf16_logits():
    logits, labels = _example(torch.bfloat16, shape=(1, 64))
    logits.requires_grad_()
    with SavedTensorLedger() as ours:
        MSCrossEntropyLoss(True)(logits, labels, V)
    with SavedTensorLedger() as hf:
        loss_utils.ForCausalLMLoss(logits, labels, V)
    rows = 64
    padded = (rows + 1) * 8  # the shifted labels are a view of the padded (rows + 1) storage
    assert ours.bytes == rows * V * 2 + rows * 4 + padded + 4
    assert hf.bytes == rows * V * 4 + padded + 4


def test_pickles_and_copies():
    loss = MSCrossEntropyLoss(True)
    for other in (pickle.loads(pickle.dumps(loss)), copy.deepcopy(loss)):
        assert other == loss and other.shift and hash(other) == hash(loss)
    assert MSCrossEntropyLoss(False) != loss
    assert repr(loss) == "MSCrossEntropyLoss(shift=True)"


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("value", (float("inf"), float("-inf"), float("nan")))
def test_non_finite_logits_as_hfs_causal_loss(value, dtype):
    """A logit overflowed to +inf (fp16), a -inf mask, a NaN: the loss is HF's (NaN, +inf or finite alike) and the
    logits' gradient has HF's NaNs, position for position."""
    logits, labels = _example(dtype)
    labels[0, 4] = 11
    logits[0, 3, 11] = value  # the target of row 3 (labels shifted by one)
    logits[1, 5, 2] = value  # another class
    (l1, g1), (l0, g0) = (_run(fn, logits, labels, V) for fn in (MSCrossEntropyLoss(True), loss_utils.ForCausalLMLoss))
    assert torch.equal(l1.isnan(), l0.isnan()) and (l0.isnan() or torch.isclose(l1, l0, rtol=1e-6))
    assert torch.equal(g1.isnan(), g0.isnan()), (int(g1.isnan().sum()), int(g0.isnan().sum()))
