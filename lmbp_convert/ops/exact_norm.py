"""The exact memory-sharing norm (`lmbp_convert.nn.exact_norms`) as one autograd node on CPU.

The same values and gradients as its two-op composition, ``norm_affine(ms_norm(x), w, β)``: x̂ and rstd as
`lmbp_convert.ops.ms_norm` computes them (x̂ in the autocast dtype), ``y = x̂·γ + β`` bitwise `affine_forward` of
that x̂, and backward dx̂ = g·γ rounded to x̂'s dtype, then the norm's backward from x̂ and rstd. One node instead of
two, and each direction in one native pass where the kernels apply (`cpu_native.norm_affine_fwd` / `_bwd`), else
the two ops' own CPU paths: a ViT-B/16 step runs five of these norms, and the second passes and node cost about
1-2 % of its CPU time. It saves x̂ and rstd (and w), what the two nodes saved; x̂ is a second, non-differentiable output,
so the caller can note y as rebuildable from it. CUDA, torch.compile and torch.func keep the two-op composition.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from . import func_transforms
from ._common import use_triton
from . import ms_norm as _ms
from .backends import cpu_native
from .norm_affine import affine_forward, affine_grads

__all__ = ["affine_rows", "exact_norm_cpu"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _ExactNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, n, eps, is_rms, one_plus, out_dtype, xhat_dtype):
        gamma = w.float() + 1.0 if one_plus else w.float()
        got = cpu_native.norm_affine_fwd(x, n, eps, is_rms, xhat_dtype, gamma.reshape(-1),
                                         None if b is None else b.float().reshape(-1), out_dtype)
        if got is None:  # the two ops' own paths: the same values
            xhat, rstd = _ms._fwd_torch(x, n, eps, is_rms, xhat_dtype)
            if w.dim() == 1:
                y = affine_forward(xhat, w, b, one_plus, out_dtype)
            else:  # over rows of n; y must not be a view (a consumer's saved y would then not lead to this node)
                y = affine_rows(xhat, w, b, one_plus, out_dtype, n).clone()
        else:
            xhat, rstd, y = got
        ctx.mark_non_differentiable(xhat)
        ctx.set_materialize_grads(False)  # no zeros for x̂'s gradient (an x̂-sized fill per backward)
        # what the two nodes would save: rstd only where x needs a gradient (an input without one, such as a frozen
        # embedding's output under LoRA, makes no norm node there)
        ctx.save_for_backward(xhat, rstd if ctx.needs_input_grad[0] else None, w)
        ctx.spec = (n, is_rms, one_plus, x.dtype, None if b is None else b.dtype)
        return y, xhat

    @staticmethod
    @once_differentiable  # as the norm's own backward: rstd is treated as a constant
    def backward(ctx, g, _g_xhat):
        xhat, rstd, w = ctx.saved_tensors
        if g is None:
            return (None,) * 9
        n, is_rms, one_plus, x_dtype, b_dtype = ctx.spec
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        rows, need_b = xhat.reshape(-1, n), need_b and b_dtype is not None
        g = g.reshape(rows.shape)
        gamma = (w.float() + 1.0 if one_plus else w.float()).reshape(-1)
        native = cpu_native.norm_affine_bwd(g, rows, rstd, gamma, is_rms, x_dtype, need_w, need_b) if need_x else None
        if native is not None:  # one pass: the two kernels' values, bitwise
            dx, dw, db = native
            dx = dx.view(xhat.shape)
            dw = None if dw is None else dw.to(w.dtype)
            db = None if db is None else db.to(b_dtype)
        else:
            dxhat, dw, db = affine_grads(g, rows, w.reshape(-1), one_plus, need_x, need_w, need_b, b_dtype)
            dx = _ms._bwd_torch(dxhat, rows, rstd, is_rms, x_dtype).view(xhat.shape) if need_x else None
        return (dx, None if dw is None else dw.view(w.shape), None if db is None else db.view(w.shape), None, None,
                None, None, None, None)


def exact_norm_cpu(x: torch.Tensor, n: int, eps: float, is_rms: bool, w: torch.Tensor, b: Optional[torch.Tensor],
                   one_plus: bool, out_dtype: torch.dtype, xhat_dtype: torch.dtype
                   ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(y, x̂) over rows of the ``n`` trailing elements (``w``, ``b``: their shape), or None where this node does
    not apply (not a CPU tensor of fp32 / bf16 / fp16, torch.compile, a torch.func transform, or a CPU tensor routed
    to the Triton kernels: the interpreter in tests, a stubbed driver in benchmarks.host)."""
    if (x.device.type != "cpu" or x.dtype not in _DTYPES or w.dtype not in _DTYPES or xhat_dtype not in _DTYPES
            or torch.compiler.is_compiling() or func_transforms.active() or use_triton(x)):
        return None
    return _ExactNorm.apply(x, w, b, n, eps, is_rms, one_plus, out_dtype, xhat_dtype)


def affine_rows(xhat: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], one_plus: bool, out: torch.dtype,
                n: int, cast_to: Optional[torch.dtype] = None) -> torch.Tensor:
    """y of any normalized_shape (``w``, ``b``: its shape): `affine_forward` over rows of the ``n`` trailing
    elements, viewed back. The node's y, and the shared-saves recipe that rebuilds it (with a consumer's cast)."""
    y = affine_forward(xhat.reshape(-1, n), w.reshape(-1), None if b is None else b.reshape(-1), one_plus, out,
                       cast_to)
    return y.view(xhat.shape)


affine_rows.fuses_cast = True
