"""The exact memory-sharing norm (`lmbp_convert.nn.exact_norms`) as one autograd node on CPU.

The same values and gradients as its two-op composition, ``norm_affine(ms_norm(x), w, β)``: x̂ and rstd as
`lmbp_convert.ops.ms_norm` computes them (x̂ in the autocast dtype), ``y = x̂·γ + β`` bitwise `affine_forward` of
that x̂, and backward dx̂ = g·γ rounded to x̂'s dtype, then the norm's backward from x̂ and rstd. One node instead of
two, and each direction in one native pass where the kernels apply (`cpu_native.norm_affine_fwd` / `_bwd`), else
the two ops' own CPU paths: a ViT-B/16 step runs five of these norms, and the second passes and node cost about
1-2 % of its CPU time. It saves x̂ and rstd (and w), what the two nodes saved; x̂ is a second output, so the caller can note y
as rebuildable from it (detached: the shared-saves region finds a note by node). Double backward: x̂ is an output with
a gradient (as the two-op composition's ms_norm output is) and rstd is `_common.linked` to the node, so under
create_graph the backward's torch ops (`_bwd_ops`) lead back to x and a second backward is the norm's exact second
derivative. CUDA, torch.compile and torch.func keep the two-op composition.
"""
from __future__ import annotations

from typing import Optional

import torch
from . import func_transforms
from ._common import handed, linked, twice_differentiable, use_triton
from . import ms_norm as _ms
from .backends import cpu_native
from .norm_affine import affine_forward, affine_grads

__all__ = ["affine_rows", "exact_norm_cpu"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bwd_ops(ctx, g, g_xhat, rstd, g_rstd):
    """The backward in differentiable torch ops on the saved x̂ (an output of the node: its graph leads back to x
    through the node), w and ``rstd`` (the saved one, or `linked` to the node): dx̂ = g·γ in x̂'s dtype plus x̂'s
    own gradient, then the norm's backward (`ms_norm.norm_bwd_ops`, with rstd's handed gradient ``g_rstd``)."""
    xhat, _, w = ctx.saved_tensors
    n, is_rms, one_plus, x_dtype, b_dtype = ctx.spec
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    cdt = torch.promote_types(x_dtype, torch.float32)
    rows = xhat.reshape(-1, n)
    gamma = (w.to(cdt) + 1.0 if one_plus else w.to(cdt)).reshape(-1)
    g2 = None if g is None else g.reshape(rows.shape).to(cdt)
    dx = dw = db = None
    if need_x:
        dxhat = None if g2 is None else (g2 * gamma).to(xhat.dtype).to(cdt)
        if g_xhat is not None:
            own = g_xhat.reshape(rows.shape).to(cdt)
            dxhat = own if dxhat is None else dxhat + own
        dx = _ms.norm_bwd_ops(dxhat, rows.to(cdt), rstd, g_rstd, is_rms).to(x_dtype).view(xhat.shape)
    if g2 is not None and need_w:
        dw = (g2 * rows.to(cdt)).sum(0).to(w.dtype).view(w.shape)
    if g2 is not None and need_b and b_dtype is not None:
        db = g2.sum(0).to(b_dtype).view(w.shape)
    return dx, dw, db, None, None, None, None, None, None


def _backward_graph(ctx, g, g_xhat):
    """create_graph=True: `_bwd_ops` with rstd `linked` to the node (anchored on x̂)."""
    xhat, rstd, _ = ctx.saved_tensors
    got = handed(ctx) or {}
    rstd = linked(ctx, "rstd", rstd, xhat) if rstd is not None else None
    return _bwd_ops(ctx, g, g_xhat, rstd, got.get("rstd"))


@twice_differentiable(_backward_graph)
def _backward(ctx, g, g_xhat):  # as the norm's own backward
    xhat, rstd, w = ctx.saved_tensors
    got = handed(ctx)
    if got is not None or g_xhat is not None:  # a second backward: gradients reached x̂ or were handed to rstd
        return _bwd_ops(ctx, g, g_xhat, rstd, (got or {}).get("rstd"))
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


class _ExactNorm(torch.autograd.Function):
    """(y, x̂); x̂ has a gradient (no first-order call sends one: the caller notes y with a detached x̂, as the
    shared-saves region finds notes by node), so a double backward can differentiate through it."""

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
        ctx.set_materialize_grads(False)  # no zeros for x̂'s gradient (an x̂-sized fill per backward)
        # what the two nodes would save: rstd only where x needs a gradient (an input without one, such as a frozen
        # embedding's output under LoRA, makes no norm node there)
        ctx.save_for_backward(xhat, rstd if ctx.needs_input_grad[0] else None, w)
        ctx.spec = (n, is_rms, one_plus, x.dtype, None if b is None else b.dtype)
        return y, xhat

    backward = staticmethod(_backward)


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
