"""``y = x̂·γ + β`` for the exact memory-sharing norm: fp32 math, one rounding to the output dtype, and a backward
that needs only x̂ (which the norm's own backward keeps) and the parameters.

γ is ``w`` or ``1 + w`` (`WeightParam`); β may be absent. The gradients are the unconverted model's: dx̂ = g·γ,
dw = Σ g·x̂, dβ = Σ g (sums over every leading dim, in fp32). Because the forward is a pure function of (x̂, w, β),
`lmbp_convert.ops.shared_saves` can rebuild y bitwise for any consumer that saves it (`affine_forward`).
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["affine_forward", "norm_affine"]


def affine_forward(xhat: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], one_plus: bool,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """The forward value (no graph). Same-dtype ``x̂·w`` is one multiply (bf16 rounds the exact fp32 product once,
    as the fp32 route would); everything else runs in fp32 and rounds once."""
    if b is None and not one_plus and xhat.dtype == w.dtype == out_dtype:
        return xhat * w
    acc = _acc(xhat)
    gamma = w.to(acc) + 1.0 if one_plus else w.to(acc)
    y = xhat.to(acc) * gamma
    if b is not None:
        y = y + b.to(acc)
    return y.to(out_dtype)


def _acc(t: torch.Tensor) -> torch.dtype:
    """fp32 math, fp64 for fp64 inputs (gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _NormAffine(torch.autograd.Function):
    generate_vmap_rule = True  # torch.func: forward and backward are plain torch ops

    @staticmethod
    def forward(xhat, w, b, one_plus, out_dtype):
        return affine_forward(xhat, w, b, one_plus, out_dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        xhat, w, b, one_plus, out_dtype = inputs
        ctx.save_for_backward(xhat, w)
        ctx.one_plus, ctx.has_bias = one_plus, b is not None
        ctx.b_dtype = b.dtype if b is not None else None

    @staticmethod
    def backward(ctx, g):
        xhat, w = ctx.saved_tensors
        acc = torch.promote_types(_acc(xhat), g.dtype)
        g32 = g.to(acc)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            gamma = w.to(acc) + 1.0 if ctx.one_plus else w.to(acc)
            dx = (g32 * gamma).to(xhat.dtype)
        if ctx.needs_input_grad[1]:
            dw = (_rows(g32) * _rows(xhat).to(acc)).sum(0).to(w.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = _rows(g32).sum(0).to(ctx.b_dtype)
        return dx, dw, db, None, None


def norm_affine(xhat: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], one_plus: bool,
                out_dtype: torch.dtype) -> torch.Tensor:
    """``x̂·γ + β`` in ``out_dtype`` with the gradients of every input (see the module doc)."""
    return _NormAffine.apply(xhat, w, b, one_plus, out_dtype)
