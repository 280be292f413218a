"""HF's cross-entropy loss functions, computed by the memory-sharing op on the logits in their own dtype.

A converted model's ``loss_function`` (an instance attribute transformers lets one set, ≥ 4.46). It takes what
HF's ``ForCausalLMLoss`` (``shift=True``) or ``ForMaskedLMLoss`` / ``ForTokenClassification`` (``shift=False``)
take and returns the same fp32 loss, but the logits are never upcast: `lmbp_convert.ops.cross_entropy` keeps the
logits storage the model returns anyway, fp32 only per row, and backward makes one gradient in the logits' dtype.
A plain callable object (no tensors, no module): it pickles and deep-copies with the model, and adds nothing to
its state dict or module tree.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..enums import ConvertedCallable, ConvertedModule
from ..ops.cross_entropy import cross_entropy
from ..ops.logits_head import fusable, logits_head

__all__ = ["MSCrossEntropyLoss", "MSLogitsHead"]


class MSCrossEntropyLoss(ConvertedCallable):
    """``loss_function(logits, labels, vocab_size | config, num_items_in_batch=None, ignore_index=-100,
    shift_labels=None, **kwargs)`` with HF's semantics: labels shifted left by one (padded with ignore_index)
    unless ``shift_labels`` is given, when ``shift``; the mean over non-ignored targets, or the sum divided by
    ``num_items_in_batch`` when it is given. Further keyword arguments are ignored, as HF's functions do."""

    def __init__(self, shift: bool) -> None:
        self.shift = bool(shift)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor | None = None, vocab_size: Any = None,
                 num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                 shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        classes = _classes(logits, vocab_size if vocab_size is not None else kwargs.get("config"))
        if self.shift and shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        targets = shift_labels if self.shift else labels
        logits = logits.reshape(-1, classes)
        targets = targets.reshape(-1).to(logits.device)
        if num_items_in_batch is None:
            return cross_entropy(logits, targets, ignore_index, "mean")
        return cross_entropy(logits, targets, ignore_index, "sum", divisor=num_items_in_batch)

    def __repr__(self) -> str:
        return f"MSCrossEntropyLoss(shift={self.shift})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MSCrossEntropyLoss) and other.shift == self.shift

    def __hash__(self) -> int:
        return hash((MSCrossEntropyLoss, self.shift))


def _classes(logits: torch.Tensor, given: Any) -> int:
    """The class count HF views the logits with: ``vocab_size``, a config's ``num_labels``, else the last dim."""
    if isinstance(given, int):
        return given
    num = getattr(given, "num_labels", None)
    return num if isinstance(num, int) else logits.shape[-1]


class MSLogitsHead(ConvertedModule, nn.Linear):
    """The LM head whose backward makes the memory-sharing loss's gradient by rows (`lmbp_convert.ops.logits_head`):
    the same ``F.linear`` forward, output and parameters. The rewrite sets it as the ``__class__`` of the model's
    own ``nn.Linear`` head (and sets ``nn.Linear`` back on undo), so the object, its Parameters (tied or not),
    hooks and state-dict keys stay what they were."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not fusable(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        return logits_head(x, self.weight, self.bias)
