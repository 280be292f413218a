"""The new values of the parameters a `ConsumerFold` folds into, from any source of tensors (the live model in
``convert()``, an arriving state dict in the load hook): one loop over the targets, the maths in ``fold.py``."""
from __future__ import annotations

from typing import Callable

import torch

from ..fold import (add_shift, conv_shift, fold_conv_input, fold_weight_rows, rows_shift, unfold_conv_input,
                    unfold_weight_rows)
from ..match.plan import ParamTarget


def param_folds(targets: list[ParamTarget], get: Callable[[str], torch.Tensor], gamma: torch.Tensor,
                beta: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Tensor name → its folded value. Targets sharing a tensor (nn.MultiheadAttention's q, k, v rows of
    ``in_proj_weight`` and ``in_proj_bias``) fold in turn; their rows are disjoint, so each reads its rows
    unfolded."""
    pending: dict[str, torch.Tensor] = {}
    for t in targets:
        w = pending.get(t.weight, get(t.weight).detach())
        rows = tuple(t.rows) if t.rows else None
        if t.conv:
            pending[t.weight] = fold_conv_input(w, None, gamma, None)[0]
            shift = conv_shift(w, beta) if beta is not None else None
        else:
            pending[t.weight] = fold_weight_rows(w, gamma, rows)
            shift = rows_shift(w, beta, rows) if beta is not None else None
        if shift is not None:
            _shift_bias_parts(pending, t, rows, shift, get)
    return pending


def param_unfolds(targets: list[ParamTarget], get: Callable[[str], torch.Tensor], gamma: torch.Tensor,
                  beta: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The inverse of `param_folds` (fp64 weights, biases in their dtype): W = W'·diag(1/γ) on the folded rows
    (input channels of a convolution), and each bias part less its share of W·β. Raises ``fold.UnfoldError``
    where γ = 0 on a channel the op still reads."""
    pending: dict[str, torch.Tensor] = {}
    for t in targets:
        w = pending.get(t.weight, get(t.weight).detach())
        rows = tuple(t.rows) if t.rows else None
        if t.conv:
            plain = unfold_conv_input(w, gamma)
            shift = conv_shift(plain, beta) if beta is not None else None
        else:
            plain = unfold_weight_rows(w, gamma, rows)
            shift = rows_shift(plain, beta, rows) if beta is not None else None
        pending[t.weight] = plain
        if shift is not None:
            _shift_bias_parts(pending, t, rows, -shift, get)
    return pending


def _shift_bias_parts(pending: dict[str, torch.Tensor], t: ParamTarget, rows: tuple[int, int] | None,
                      shift: torch.Tensor, get: Callable[[str], torch.Tensor]) -> None:
    """Add ``shift`` (the output rows ``rows`` of W·β) to the bias parts those rows fall in."""
    r0 = rows[0] if rows else 0
    for part in t.bias:
        b = pending.get(part.tensor, get(part.tensor).detach())
        lo, hi = max(part.start, r0), min(part.stop, r0 + shift.shape[0])
        new = b.clone()
        new[lo - part.start:hi - part.start] = add_shift(b[lo - part.start:hi - part.start], shift[lo - r0:hi - r0])
        pending[part.tensor] = new
