"""The gated activation ``h = act(g)·u`` of a gated MLP, saving only g and u: kernels, PyTorch path, autograd.

The elementwise half of `gated_mlp` (its forward h; its backward dg, du and the h recompute, fused in one
kernel), also an op on its own (`gated_act`) for down projections the fused op cannot take as tensors. Maths,
dtypes and dispatch: `lmbp_convert.ops.gated_mlp`'s module doc. Under torch.compile the Triton path is the
triton_ops ``lmbp_convert::gated_act_fwd`` / ``gated_act_bwd`` and the PyTorch path the opaque custom ops
``lmbp_convert::gated_mlp_fwd`` / ``gated_mlp_bwd``. Double backward recomputes h from the saved g, u by the
PyTorch path's ops and differentiates it with a graph (`_gated_act_backward_graph`).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..enums import GATED_ACT_KINDS
from . import func_transforms
from ._common import HAS_TRITON, SUPPORTED_DTYPES, check_dtype, regrad, twice_differentiable, use_triton
from ._launch import LeanKernel, next_pow2, rows_view
from .backends.dispatch import Backend, route
from .backends.compiled import kernel_op
from .activations import ACTIVATIONS, act_code

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .activations import act_and_grad_f32, act_f32

_DTYPE_SET = frozenset(SUPPORTED_DTYPES)
_CONTIGUOUS = torch.contiguous_format

__all__ = ["ACT_KINDS", "gated_act", "GatedActFunction"]

#: The activation-table kinds this op offers (the table holds their codes, PyTorch and Triton maths); the list is
#: `lmbp_convert.enums.GATED_ACT_KINDS`, which the gated-MLP matcher reads too.
ACT_KINDS = GATED_ACT_KINDS
if not set(ACT_KINDS) <= set(ACTIVATIONS):  # pragma: no cover
    raise AssertionError(f"gated_mlp: {sorted(set(ACT_KINDS) - set(ACTIVATIONS))} not in the activation table")


# ------------------------------------------------------------------------------------------------------
# Triton kernels: 2-D grid (row, column block); fp32 math; masked loads/stores; unit column stride.
# The activation and its derivative come from the shared table (`activations.act_f32` / `act_and_grad_f32`).
# ------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _gated_fwd_kernel(G, U, H, stride_g, stride_u, stride_h, N,
                          ACT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
        a = act_f32(g, ACT)
        tl.store(H + row * stride_h + cols, (a * u).to(H.dtype.element_ty), mask=mask)

    @triton.jit
    def _gated_bwd_kernel(DH, G, U, DG, DU, H, stride_dh, stride_g, stride_u, stride_dg, stride_du, stride_h,
                          N, ACT: tl.constexpr, STORE_H: tl.constexpr, BLOCK: tl.constexpr):
        # Every element is loaded before it is stored, so DG may alias DH (in-place backward).
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        dh = tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
        a, da = act_and_grad_f32(g, ACT)
        if STORE_H:
            tl.store(H + row * stride_h + cols, (a * u).to(H.dtype.element_ty), mask=mask)
        tl.store(DG + row * stride_dg + cols, (dh * u * da).to(DG.dtype.element_ty), mask=mask)
        tl.store(DU + row * stride_du + cols, (dh * a).to(DU.dtype.element_ty), mask=mask)

    _FWD = LeanKernel(_gated_fwd_kernel)
    _BWD = LeanKernel(_gated_bwd_kernel)


def _act_code(act: str) -> int:
    """The kernels' ACT code (ValueError for a kind this op does not offer); a dict hit on the hot path."""
    code = _CODES.get(act)
    return code if code is not None else act_code(act, ACT_KINDS, "gated_mlp")


_CODES = {k: ACTIVATIONS[k].code for k in ACT_KINDS}


def _block(n: int) -> int:
    """Columns per program for rows of n (cached: a handful of widths per model)."""
    block = min(1024, next_pow2(n))
    if len(_BLOCKS) >= 4096:
        _BLOCKS.clear()
    _BLOCKS[n] = block
    return block


_BLOCKS: dict[int, int] = {}


def _fwd_triton(g: torch.Tensor, u: torch.Tensor, act: str, h_dtype: torch.dtype, traced: bool = False) -> torch.Tensor:
    """Triton forward: h = act(g)·u with g's shape in ``h_dtype``, contiguous; g, u may be strided views."""
    code = _act_code(act)
    numel = g.numel()
    if numel == 0:
        return _fwd_torch(g, u, act, h_dtype)
    n = g.shape[-1]
    g2, stride_g = (g, n) if g.is_contiguous() else rows_view(g, n)
    u2, stride_u = (u, n) if u.is_contiguous() else rows_view(u, n)
    m = numel // n
    h = torch.empty_like(g, dtype=h_dtype, memory_format=_CONTIGUOUS)  # rows of n: stride n
    block = _BLOCKS.get(n) or _block(n)
    args = (g2, u2, h, stride_g, stride_u, n, n)
    grid = (m, -(-n // block), 1)
    if traced:
        _FWD.launch_traced(grid, g.device.index, args, (code, block), 4)
    else:  # h is fresh (aligned); the key fixes every dtype and int
        dev = g.get_device()
        _FWD.launch((code, block, g2.dtype, g2.data_ptr() & 15, u2.dtype, u2.data_ptr() & 15, h_dtype, stride_g,
                     stride_u, n, dev), grid, args, dev, (code, block), 4)
    return h


def _bwd_triton(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, act: str, h_dtype: Optional[torch.dtype],
                dg_into_dh: bool = False, traced: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Triton backward: (dg in g's dtype, du in u's dtype, h in ``h_dtype`` or None when ``h_dtype`` is None).

    ``dg_into_dh`` writes dg over dh (which must then be contiguous, of g's dtype and not needed afterwards),
    saving one T×f buffer at the backward peak.
    """
    code = _act_code(act)
    numel = g.numel()
    if numel == 0:
        return _bwd_torch(dh, g, u, act, h_dtype)
    n = g.shape[-1]
    dh_contiguous = dh.is_contiguous()
    dh2, stride_dh = (dh, n) if dh_contiguous else rows_view(dh, n)
    g2, stride_g = (g, n) if g.is_contiguous() else rows_view(g, n)
    u2, stride_u = (u, n) if u.is_contiguous() else rows_view(u, n)
    m = numel // n
    if dg_into_dh and dh_contiguous and dh.dtype == g.dtype:
        dg = dh.view(g.shape)
    else:
        dg = torch.empty_like(g, memory_format=_CONTIGUOUS)
    du = torch.empty_like(u, memory_format=_CONTIGUOUS)
    h = torch.empty_like(g, dtype=h_dtype, memory_format=_CONTIGUOUS) if h_dtype is not None else None
    block = _BLOCKS.get(n) or _block(n)
    h_arg = h if h is not None else du  # never written when STORE_H is False
    args = (dh2, g2, u2, dg, du, h_arg, stride_dh, stride_g, stride_u, n, n, n, n)
    grid = (m, -(-n // block), 1)
    if traced:
        _BWD.launch_traced(grid, g.device.index, args, (code, h is not None, block), 4)
    else:  # du and h are fresh (aligned); dg is fresh or dh itself
        dev = g.get_device()
        _BWD.launch((code, block, dh2.dtype, dh2.data_ptr() & 15, g2.dtype, g2.data_ptr() & 15, u2.dtype,
                     u2.data_ptr() & 15, h_dtype, stride_dh, stride_g, stride_u, n, dev), grid, args, dev,
                    (code, h is not None, block), 4)
    return dg, du, h


# ------------------------------------------------------------------------------------------------------
# PyTorch path: identical semantics, every device; the reference in tests.
# ------------------------------------------------------------------------------------------------------
def _act_torch(g: torch.Tensor, act: str) -> torch.Tensor:
    return ACTIVATIONS[act].torch_fwd(g)


def _act_backward_torch(grad: torch.Tensor, g: torch.Tensor, act: str) -> torch.Tensor:
    """grad · act'(g) with ATen's fused exact backward kernels (one pass instead of a chain of ops)."""
    return ACTIVATIONS[act].torch_grad(grad, g)


def _fwd_torch(g: torch.Tensor, u: torch.Tensor, act: str, h_dtype: torch.dtype) -> torch.Tensor:
    """PyTorch forward, same contract as `_fwd_triton`."""
    _act_code(act)
    md = torch.promote_types(g.dtype, u.dtype)  # eager's own ops and roundings: bitwise what eager computes
    return _act_torch(g.to(md), act).mul_(u.to(md)).to(h_dtype)


def _bwd_torch(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, act: str, h_dtype: Optional[torch.dtype],
               dg_into_dh: bool = False) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """PyTorch backward, same contract as `_bwd_triton` (``dg_into_dh`` is ignored: dg is always new)."""
    _act_code(act)
    # In the inputs' own dtype, like eager autograd (ATen's act kernels compute in fp32 internally): no
    # fp32 copies of T×f tensors, which on CPU cost more than the elementwise maths itself.
    md = torch.promote_types(torch.promote_types(g.dtype, u.dtype), dh.dtype)
    gf, uf, dhf = g.to(md), u.to(md), dh.to(md)
    a = _act_torch(gf, act)
    h = (a * uf).to(h_dtype) if h_dtype is not None else None  # the very ops of `_fwd_torch`
    du = a.mul_(dhf).to(u.dtype)
    dg = _act_backward_torch(dhf * uf, gf, act).to(g.dtype)
    return dg, du, h


# ------------------------------------------------------------------------------------------------------
# Custom ops: the PyTorch path opaque to torch.compile (traced, its ops would let the partitioner keep the
# forward's h for backward, one more T×f tensor, instead of recomputing it). ``triton=True`` runs the eager
# Triton launchers (kept for callers of the op; compile uses the triton_ops below).
# ------------------------------------------------------------------------------------------------------
@torch.library.custom_op("lmbp_convert::gated_mlp_fwd", mutates_args=())
def _gated_mlp_fwd_op(g: torch.Tensor, u: torch.Tensor, act: str, h_dtype: torch.dtype,
                      triton: bool) -> torch.Tensor:
    return _fwd_triton(g, u, act, h_dtype) if triton else _fwd_torch(g, u, act, h_dtype)


@_gated_mlp_fwd_op.register_fake
def _(g, u, act, h_dtype, triton):
    return g.new_empty(g.shape, dtype=h_dtype)


@torch.library.custom_op("lmbp_convert::gated_mlp_bwd", mutates_args=())
def _gated_mlp_bwd_op(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, act: str,
                      h_dtype: Optional[torch.dtype], triton: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dg, du, h = (_bwd_triton if triton else _bwd_torch)(dh, g, u, act, h_dtype)
    if h is None:  # custom ops return tensors only
        h = g.new_empty((0,))
    return dg, du, h


@_gated_mlp_bwd_op.register_fake
def _(dh, g, u, act, h_dtype, triton):
    h = g.new_empty(g.shape, dtype=h_dtype) if h_dtype is not None else g.new_empty((0,))
    return g.new_empty(g.shape), u.new_empty(u.shape), h


# The Triton path under torch.compile: triton_ops, so inductor emits the kernel launches itself (no Python
# launcher per call, CUDA-graph capturable). Their kernels only read g and u, so the partitioner has no h to keep.
def _act_fwd_fake(g, u, act, h_dtype):
    return g.new_empty(g.shape, dtype=h_dtype)


def _act_bwd_fake(dh, g, u, act, h_dtype):
    h = g.new_empty(g.shape, dtype=h_dtype) if h_dtype is not None else g.new_empty((0,))
    return g.new_empty(g.shape), u.new_empty(u.shape), h


@kernel_op("lmbp_convert::gated_act_fwd", _act_fwd_fake)
def _gated_act_fwd_op(g: torch.Tensor, u: torch.Tensor, act: str, h_dtype: torch.dtype) -> torch.Tensor:
    if g.numel() == 0:
        return _act_fwd_fake(g, u, act, h_dtype)
    return _fwd_triton(g, u, act, h_dtype, traced=True)


@kernel_op("lmbp_convert::gated_act_bwd", _act_bwd_fake)
def _gated_act_bwd_op(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, act: str,
                      h_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if g.numel() == 0:
        return _act_bwd_fake(dh, g, u, act, h_dtype)
    dg, du, h = _bwd_triton(dh, g, u, act, h_dtype, traced=True)
    return dg, du, (h if h is not None else g.new_empty((0,)))


def _act_op_setup_context(ctx, inputs, output):
    g, u, act, _ = inputs
    ctx.save_for_backward(g, u)
    ctx.act = act


def _act_op_backward(ctx, dh):
    g, u = ctx.saved_tensors
    dg, du, _ = torch.ops.lmbp_convert.gated_act_bwd(dh, g, u, ctx.act, None)
    return dg, du, None, None


_gated_act_fwd_op.register_autograd(_act_op_backward, setup_context=_act_op_setup_context)


def _elementwise_fwd(g: torch.Tensor, u: torch.Tensor, act: str, h_dtype: torch.dtype,
                     triton_path: bool) -> torch.Tensor:
    if torch.compiler.is_compiling():
        if triton_path:
            return torch.ops.lmbp_convert.gated_act_fwd(g, u, act, h_dtype)
        return torch.ops.lmbp_convert.gated_mlp_fwd(g, u, act, h_dtype, False)
    if not triton_path:
        return _fwd_torch(g, u, act, h_dtype)
    return _fwd_triton(g, u, act, h_dtype)


def _elementwise_bwd(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, act: str,
                     h_dtype: Optional[torch.dtype], triton_path: bool, dg_into_dh: bool = False):
    if torch.compiler.is_compiling():
        if triton_path:
            dg, du, h = torch.ops.lmbp_convert.gated_act_bwd(dh, g, u, act, h_dtype)
        else:
            dg, du, h = torch.ops.lmbp_convert.gated_mlp_bwd(dh, g, u, act, h_dtype, False)
        return dg, du, (h if h_dtype is not None else None)
    if not triton_path:
        return _bwd_torch(dh, g, u, act, h_dtype)
    return _bwd_triton(dh, g, u, act, h_dtype, dg_into_dh=dg_into_dh)


def _gated_act_backward_graph(ctx, dh):
    """create_graph=True: h = act(g)·u recomputed from the saved g, u by the PyTorch path's ops, differentiated with
    a graph (the activation's exact second derivative, ATen's)."""
    g, u = ctx.saved_tensors
    h_dtype = torch.promote_types(g.dtype, u.dtype)
    dg, du = regrad(lambda g, u: _fwd_torch(g, u, ctx.act, h_dtype), (g, u), ctx.needs_input_grad[:2], dh)
    return dg, du, None


@twice_differentiable(_gated_act_backward_graph)
def _gated_act_backward(ctx, dh):
    g, u = ctx.saved_tensors
    dg, du, _ = (_bwd_triton if ctx.triton_path else _bwd_torch)(dh, g, u, ctx.act, None)
    return (dg if ctx.needs_input_grad[0] else None), (du if ctx.needs_input_grad[1] else None), None


class GatedActFunction(torch.autograd.Function):
    """``h = act(g)·u`` saving only g and u (for down projections the fused op cannot take as tensors)."""

    @staticmethod
    def forward(ctx, g, u, act):
        h_dtype = torch.promote_types(g.dtype, u.dtype)
        triton_path = use_triton(g) and use_triton(u)  # same device: checked by the caller
        h = _fwd_triton(g, u, act, h_dtype) if triton_path else _fwd_torch(g, u, act, h_dtype)
        ctx.save_for_backward(g, u)
        ctx.act = act
        ctx.triton_path = triton_path
        return h

    backward = staticmethod(_gated_act_backward)


# ------------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------------
def _check_gu(g: torch.Tensor, u: torch.Tensor, act: str, op: str) -> None:
    _act_code(act)
    if g.dtype not in _DTYPE_SET or u.dtype not in _DTYPE_SET:
        check_dtype(g, op)
        check_dtype(u, op)
    if g.shape != u.shape:
        raise ValueError(f"{op}: gate and up outputs differ in shape: {tuple(g.shape)} vs {tuple(u.shape)}")
    if g.dim() == 0:
        raise ValueError(f"{op}: gate/up outputs must have a feature dimension")
    if g.device != u.device:
        raise ValueError(f"{op}: gate and up outputs are on different devices ({g.device}, {u.device})")


def gated_act(g: torch.Tensor, u: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """``act(g)·u`` (dtype: promoted dtype of g and u) saving only g and u for backward."""
    _check_gu(g, u, act, "gated_act")
    if func_transforms.active():
        return func_transforms.gated_act(g, u, act)
    if route("gated_act", g, use_triton(g) and use_triton(u)) is Backend.COMPILED:
        return torch.ops.lmbp_convert.gated_act_fwd(g, u, act, torch.promote_types(g.dtype, u.dtype))
    return GatedActFunction.apply(g, u, act)
