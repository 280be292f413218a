"""``y = x̂·γ + β`` for the exact memory-sharing norm: fp32 math, one rounding to the output dtype, and a backward
that needs only x̂ (which the norm's own backward keeps) and the parameters.

γ is ``w`` or ``1 + w`` (`WeightParam`); β may be absent. The gradients are the unconverted model's: dx̂ = g·γ,
dw = Σ g·x̂, dβ = Σ g (sums over every leading dim, in fp32). Because the forward is a pure function of (x̂, w, β),
`lmbp_convert.ops.shared_saves` can rebuild y bitwise for any consumer that saves it (`affine_forward`).

On CPU both directions run as one native pass where the kernels apply (`cpu_native.affine_fwd` / `affine_bwd`:
the forward bitwise this module's ops, dx̂ bitwise, dw and dβ fp32 sums in another order); the PyTorch ops below
are the path everywhere else, with the same semantics. The separate passes (product, sum, casts, reductions) cost
a ViT-B/16 step about 5 % of its CPU time (docs/benchmarks.md).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import func_transforms
from .backends import cpu_native

__all__ = ["affine_forward", "affine_grads", "norm_affine"]


def affine_forward(xhat: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], one_plus: bool,
                   out_dtype: torch.dtype, cast_to: Optional[torch.dtype] = None) -> torch.Tensor:
    """The forward value (no graph): fp32 math, ``x̂·γ`` then ``+ β``, each rounded to fp32, then one rounding to
    ``out_dtype``. x̂ is read in its own dtype and the last op writes the result's dtype itself (type promotion
    into an ``out=`` tensor), so no upcast copy of x̂ and no separate cast pass. Same-dtype ``x̂·w`` is one
    multiply (bf16 rounds the exact fp32 product once, as the fp32 route would). ``cast_to``: the value
    ``.to(cast_to)``, bitwise, written by that same last op where it can be (a shared-saves rebuild of a
    consumer's cast copy, `fuses_cast`)."""
    if b is None and not one_plus and xhat.dtype == w.dtype == out_dtype:
        y = xhat * w
        return y if cast_to is None else y.to(cast_to)
    acc = _acc(xhat)
    gamma = w.to(acc) + 1.0 if one_plus else w.to(acc)
    if not _may_write_out(xhat, gamma, b):  # a graph or a torch.func transform: plain ops
        y = xhat.to(acc) * gamma
        y = (y if b is None else y + b.to(acc)).to(out_dtype)
        return y if cast_to is None else y.to(cast_to)
    final = out_dtype if cast_to is None or out_dtype != acc else cast_to
    beta = None if b is None else b.to(acc)
    y = cpu_native.affine_fwd(xhat, gamma, beta, final) if acc == torch.float32 else None
    if y is None:  # the same values in two out= ops
        y = torch.mul(xhat, gamma, out=torch.empty(xhat.shape, dtype=final if b is None else acc, device=xhat.device))
        if beta is not None:
            y = torch.add(y, beta, out=y if final == acc else torch.empty(xhat.shape, dtype=final, device=xhat.device))
    return y if final == (cast_to or out_dtype) else y.to(cast_to)


def _may_write_out(*ts: Optional[torch.Tensor]) -> bool:
    """``out=`` ops may run: no tensor a graph records (double backward) and no torch.func transform."""
    if func_transforms.active():
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts))


#: `lmbp_convert.ops.shared_saves` may call it with ``cast_to`` for a recipe that starts with a dtype cast
affine_forward.fuses_cast = True


def _acc(t: torch.Tensor) -> torch.dtype:
    """fp32 math, fp64 for fp64 inputs (gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _save(ctx, xhat, w, b, one_plus) -> None:
    ctx.save_for_backward(xhat, w)
    ctx.one_plus, ctx.has_bias = one_plus, b is not None
    ctx.b_dtype = b.dtype if b is not None else None


def affine_grads(g: torch.Tensor, xhat: torch.Tensor, w: torch.Tensor, one_plus: bool, need_dx: bool,
                 need_dw: bool, need_db: bool, b_dtype: Optional[torch.dtype]):
    """(dx̂, dw, dβ) of ``x̂·γ + β`` (None for those not needed): the native pass where it applies, else torch ops."""
    acc = torch.promote_types(_acc(xhat), g.dtype)
    gamma = w.to(acc) + 1.0 if one_plus else w.to(acc)
    native = cpu_native.affine_bwd(g, xhat, gamma, need_dx, need_dw, need_db) if acc == torch.float32 else None
    if native is not None:  # one pass over g and x̂
        dx, dw, db = native
    else:
        dx = dw = db = None
        if need_dx:  # one pass: g read in its dtype, fp32 product written in x̂'s dtype
            if _may_write_out(g, gamma):
                dx = torch.mul(g, gamma, out=torch.empty(g.shape, dtype=xhat.dtype, device=g.device))
            else:
                dx = (g.to(acc) * gamma).to(xhat.dtype)
        if need_dw or need_db:
            g32 = g.to(acc)
            dw = (_rows(g32) * _rows(xhat).to(acc)).sum(0) if need_dw else None
            db = _rows(g32).sum(0) if need_db else None
    return dx, None if dw is None else dw.to(w.dtype), None if db is None else db.to(b_dtype)


def _backward(ctx, g):
    xhat, w = ctx.saved_tensors
    dx, dw, db = affine_grads(g, xhat, w, ctx.one_plus, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                              ctx.has_bias and ctx.needs_input_grad[2], ctx.b_dtype)
    return dx, dw, db, None, None


class _NormAffine(torch.autograd.Function):
    """The eager op. ``forward(ctx, ...)`` style: a setup_context Function binds its arguments through
    ``inspect.signature`` on every call (~0.1 ms, 5 norms a ViT-B/16 step)."""

    @staticmethod
    def forward(ctx, xhat, w, b, one_plus, out_dtype):
        _save(ctx, xhat, w, b, one_plus)
        return affine_forward(xhat, w, b, one_plus, out_dtype)

    backward = staticmethod(_backward)


class _NormAffineFunc(torch.autograd.Function):
    """The same op inside torch.func transforms (which need setup_context; its vmap rule is generated)."""

    generate_vmap_rule = True  # torch.func: forward and backward are plain torch ops

    @staticmethod
    def forward(xhat, w, b, one_plus, out_dtype):
        return affine_forward(xhat, w, b, one_plus, out_dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        xhat, w, b, one_plus, _ = inputs
        _save(ctx, xhat, w, b, one_plus)

    backward = staticmethod(_backward)


def norm_affine(xhat: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], one_plus: bool,
                out_dtype: torch.dtype) -> torch.Tensor:
    """``x̂·γ + β`` in ``out_dtype`` with the gradients of every input (see the module doc)."""
    fn = _NormAffineFunc if func_transforms.active() else _NormAffine
    return fn.apply(xhat, w, b, one_plus, out_dtype)
