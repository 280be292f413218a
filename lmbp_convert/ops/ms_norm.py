"""Memory-sharing LayerNorm / RMSNorm without affine (MS-BP, arXiv 2406.16282).

A norm's backward is usually computed from its *input*. Without an affine it can be computed from its
*output* ŷ and the per-row rstd alone:

    LayerNorm  dx = rstd · (g − mean(g) − ŷ · mean(g·ŷ))
    RMSNorm    dx = rstd · (g − ŷ · mean(g·ŷ))

With the affine folded into the next Linear, that Linear saves ŷ as its input anyway, so the pair keeps one
activation-sized storage (plus rstd, one fp32 per row) instead of two. The op therefore saves exactly the
tensor it returns (never a copy or a recast) and emits the dtype a following autocast Linear computes in
(`autocast_dtype_for`), so under mixed precision the Linear's cast is a no-op and the storage stays shared.

Statistics are computed in fp32 (fp64 for fp64 inputs, PyTorch path only, for gradcheck). Backward is
computed in fp32 from the saved output; note that for a low-precision output ŷ is the rounded value, which is
the approximation the method accepts.

Double backward (``create_graph=True``): the backward formula written in torch ops (`norm_bwd_ops`) on the saved
ŷ, an output of the node (its graph leads back to x through the node), and rstd, `_common.linked` to the node: the
next backward hands rstd's gradient to the node's backward, which adds ∂rstd/∂x = −rstd²·ŷ/n of it (a direction
the norm's Jacobian cannot send). Differentiating it is the norm's exact second derivative (up to ŷ's own
rounding). The first-order path (kernels, native CPU, what the node saves) is unchanged.

Dispatch (in the order of `backends.dispatch.TABLE`): Triton kernels for CUDA tensors (`use_triton`), the PyTorch
path (`_fwd_torch` / `_bwd_torch`) everywhere else; both share one signature so tests compare them directly. Eager calls run in C++ where the host
path is on (`cuda_host`, LMBP_CUDA_HOST=1), else their launches go through
`LeanKernel` (cached compiled kernels); under torch.compile the Triton path is the ``triton_op``
``lmbp_convert::ms_norm_fwd`` (with ``ms_norm_bwd`` as its registered autograd), so inductor emits the launches.
Rows up to ``MAX_FUSED_BLOCK`` (16384) elements are held in registers by one program; longer rows use a
looped kernel that streams the row in ``LOOP_CHUNK``-element chunks (two/three passes over global memory).
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import func_transforms
from ..errors import NoSecondDerivativeError
from ._common import (HAS_TRITON, SUPPORTED_DTYPES, autocast_dtype_for, check_dtype, handed, linked,
                      twice_differentiable, use_triton)
from ._launch import LeanKernel, next_pow2, rows_view
from .backends import cpu_native, cuda_host
from .backends.dispatch import Backend, route
from .backends.compiled import kernel_op

_DTYPE_SET = frozenset(SUPPORTED_DTYPES)
_F32 = torch.float32
_CONTIGUOUS = torch.contiguous_format

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["ms_layer_norm", "ms_rms_norm", "ms_norm_unchecked", "MSNormFunction", "normalize_shape"]

#: Rows whose next power of two is at most this are normalised by the single-block ("fused") kernels.
MAX_FUSED_BLOCK = 16384
#: Chunk the looped kernels stream longer rows in.
LOOP_CHUNK = 4096


# ------------------------------------------------------------------------------------------------------
# Triton kernels: one program per row; fp32 math; loads and stores masked to the row length.
# ------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _ms_norm_fwd_kernel(X, Y, RSTD, stride_x, stride_y, N, eps,
                            IS_RMS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if IS_RMS:
            xc = x
        else:
            mean = tl.sum(x, axis=0) / N
            xc = tl.where(mask, x - mean, 0.0)
        var = tl.sum(xc * xc, axis=0) / N
        rstd = tl.rsqrt(var + eps)
        y = xc * rstd
        tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _ms_norm_fwd_loop_kernel(X, Y, RSTD, stride_x, stride_y, N, eps,
                                 IS_RMS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_x
        y_row = Y + row * stride_y
        cols = tl.arange(0, BLOCK)
        mean = 0.0
        if not IS_RMS:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for off in range(0, N, BLOCK):
                m = off + cols < N
                acc += tl.load(x_row + off + cols, mask=m, other=0.0).to(tl.float32)
            mean = tl.sum(acc, axis=0) / N
        acc2 = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(0, N, BLOCK):
            m = off + cols < N
            x = tl.load(x_row + off + cols, mask=m, other=0.0).to(tl.float32)
            xc = tl.where(m, x - mean, 0.0)
            acc2 += xc * xc
        rstd = tl.rsqrt(tl.sum(acc2, axis=0) / N + eps)
        for off in range(0, N, BLOCK):
            m = off + cols < N
            x = tl.load(x_row + off + cols, mask=m, other=0.0).to(tl.float32)
            y = (x - mean) * rstd
            tl.store(y_row + off + cols, y.to(Y.dtype.element_ty), mask=m)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _ms_norm_bwd_kernel(G, Y, RSTD, DX, stride_g, stride_y, stride_dx, N,
                            IS_RMS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row).to(tl.float32)
        mean_gy = tl.sum(g * y, axis=0) / N
        if IS_RMS:
            dx = (g - y * mean_gy) * rstd
        else:
            mean_g = tl.sum(g, axis=0) / N
            dx = (g - mean_g - y * mean_gy) * rstd
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)

    @triton.jit
    def _ms_norm_bwd_loop_kernel(G, Y, RSTD, DX, stride_g, stride_y, stride_dx, N,
                                 IS_RMS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        g_row = G + row * stride_g
        y_row = Y + row * stride_y
        dx_row = DX + row * stride_dx
        cols = tl.arange(0, BLOCK)
        rstd = tl.load(RSTD + row).to(tl.float32)
        acc_g = tl.zeros([BLOCK], dtype=tl.float32)
        acc_gy = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(0, N, BLOCK):
            m = off + cols < N
            g = tl.load(g_row + off + cols, mask=m, other=0.0).to(tl.float32)
            y = tl.load(y_row + off + cols, mask=m, other=0.0).to(tl.float32)
            acc_g += g
            acc_gy += g * y
        mean_gy = tl.sum(acc_gy, axis=0) / N
        mean_g = 0.0
        if not IS_RMS:
            mean_g = tl.sum(acc_g, axis=0) / N
        for off in range(0, N, BLOCK):
            m = off + cols < N
            g = tl.load(g_row + off + cols, mask=m, other=0.0).to(tl.float32)
            y = tl.load(y_row + off + cols, mask=m, other=0.0).to(tl.float32)
            dx = (g - mean_g - y * mean_gy) * rstd
            tl.store(dx_row + off + cols, dx.to(DX.dtype.element_ty), mask=m)


def _num_warps(block: int) -> int:
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def _plan(n: int, chunk: int | None) -> tuple[bool, int]:
    """(looped?, BLOCK): the single-block kernel when the row fits, else the looped one."""
    if chunk is not None:
        return True, next_pow2(chunk)
    block = next_pow2(n)
    if block <= MAX_FUSED_BLOCK:
        return False, block
    return True, LOOP_CHUNK


#: Row length -> (looped?, BLOCK, num_warps), filled on first use (a handful of row lengths per model).
_PLANS: dict[int, tuple[bool, int, int]] = {}


def _plan_for(n: int) -> tuple[bool, int, int]:
    looped, block = _plan(n, None)
    if len(_PLANS) >= 4096:
        _PLANS.clear()
    _PLANS[n] = plan = (looped, block, _num_warps(block))
    return plan


def _forced_plan(chunk: int) -> tuple[bool, int, int]:
    looped, block = _plan(0, chunk)
    return looped, block, _num_warps(block)


if HAS_TRITON:
    _FWD = LeanKernel(_ms_norm_fwd_kernel)
    _FWD_LOOP = LeanKernel(_ms_norm_fwd_loop_kernel)
    _BWD = LeanKernel(_ms_norm_bwd_kernel)
    _BWD_LOOP = LeanKernel(_ms_norm_bwd_loop_kernel)


def _fwd_triton(x: torch.Tensor, n: int, eps: float, is_rms: bool, out_dtype: torch.dtype,
                chunk: int | None = None, traced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward: (y with x's shape in out_dtype, contiguous; rstd (rows,) fp32).

    ``chunk`` forces the looped kernel with that chunk size (tests use it on short rows). ``traced``: launch
    through ``wrap_triton`` (inside the triton_op).
    """
    numel = x.numel()
    if numel == 0:
        return _fwd_torch(x, n, eps, is_rms, out_dtype)
    x2, stride_x = (x, n) if x.is_contiguous() else rows_view(x, n)
    m = numel // n
    y = torch.empty_like(x, dtype=out_dtype, memory_format=_CONTIGUOUS)  # rows of n: stride n
    rstd = torch.empty(m, dtype=_F32, device=x.device)
    looped, block, warps = (_PLANS.get(n) or _plan_for(n)) if chunk is None else _forced_plan(chunk)
    kernel = _FWD_LOOP if looped else _FWD
    args = (x2, y, rstd, stride_x, n, n, float(eps))
    if traced:
        kernel.launch_traced((m, 1, 1), x.device.index, args, (is_rms, block), warps)
    else:  # y and rstd are fresh (aligned); the key fixes every dtype and int
        dev = x.get_device()
        kernel.launch((is_rms, block, x2.dtype, x2.data_ptr() & 15, out_dtype, stride_x, n, dev), (m, 1, 1), args, dev,
                      (is_rms, block), warps)
    return y, rstd


def _bwd_triton(g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, is_rms: bool, x_dtype: torch.dtype,
                chunk: int | None = None, traced: bool = False) -> torch.Tensor:
    """Triton backward: dx with y's shape in x_dtype, from the upstream grad g, the saved output and rstd."""
    numel = y.numel()
    if numel == 0:
        return _bwd_torch(g, y, rstd, is_rms, x_dtype)
    m = rstd.numel()
    n = numel // m
    g2, stride_g = (g, n) if g.is_contiguous() else rows_view(g, n)
    y2, stride_y = (y, n) if y.is_contiguous() else rows_view(y, n)
    dx = torch.empty_like(y, dtype=x_dtype, memory_format=_CONTIGUOUS)
    looped, block, warps = (_PLANS.get(n) or _plan_for(n)) if chunk is None else _forced_plan(chunk)
    kernel = _BWD_LOOP if looped else _BWD
    args = (g2, y2, rstd, dx, stride_g, stride_y, n, n)
    if traced:
        kernel.launch_traced((m, 1, 1), y.device.index, args, (is_rms, block), warps)
    else:
        dev = y.get_device()
        kernel.launch((is_rms, block, g2.dtype, g2.data_ptr() & 15, y2.dtype, y2.data_ptr() & 15, rstd.dtype,
                       rstd.data_ptr() & 15, x_dtype, stride_g, stride_y, n, dev), (m, 1, 1), args, dev,
                      (is_rms, block), warps)
    return dx


# ------------------------------------------------------------------------------------------------------
# PyTorch path: identical semantics, every device; the reference in tests.
# ------------------------------------------------------------------------------------------------------
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fwd_torch(x: torch.Tensor, n: int, eps: float, is_rms: bool, out_dtype: torch.dtype,
               chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch forward, same contract as `_fwd_triton` (rstd is fp64 for fp64 inputs). ``chunk`` is ignored."""
    native = cpu_native.norm_fwd(x, n, eps, is_rms, out_dtype)  # one-pass CPU kernel; None where it does not apply
    if native is not None:
        return native
    rows = x.numel() // n if n else 0  # n == 0 (an empty normalized_shape dim): nothing to normalise
    if not is_rms and rows and n and _compute_dtype(x.dtype) == torch.float32:
        # One fused ATen pass instead of ~8 elementwise ones; fp32 in, so the statistics are fp32 too (on CPU,
        # ATen keeps bf16 statistics for bf16 input).
        y, _, rstd = torch.native_layer_norm(x.reshape(rows, n).to(torch.float32), (n,), None, None, eps)
        return y.to(out_dtype).reshape(x.shape), rstd.reshape(-1)
    xf = x.reshape(rows, n).to(_compute_dtype(x.dtype))
    if is_rms:
        xc = xf
    else:
        xc = xf - xf.mean(dim=1, keepdim=True)
    rstd = torch.rsqrt((xc * xc).mean(dim=1, keepdim=True) + eps)
    y = (xc * rstd).to(out_dtype).reshape(x.shape)
    return y, rstd.reshape(-1)


def _bwd_torch(g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, is_rms: bool, x_dtype: torch.dtype,
               chunk: int | None = None) -> torch.Tensor:
    """PyTorch backward, same contract as `_bwd_triton`. ``chunk`` is ignored."""
    native = cpu_native.norm_bwd(g, y, rstd, is_rms, x_dtype)
    if native is not None:
        return native
    cdt = _compute_dtype(x_dtype)
    rows = rstd.numel()
    n = y.numel() // rows if rows else 0
    if not is_rms and rows and n and cdt == torch.float32:
        # ATen's fused LayerNorm backward with mean 0 and rstd 1 *is* g − mean(g) − ŷ·mean(g·ŷ) for x̂ = ŷ;
        # then one multiply by the real rstd. Inputs stay in their dtype only when all three agree (a pure
        # bf16 model); otherwise (autocast: bf16 ŷ, fp32 x) the fused pass runs in fp32.
        wd = y.dtype if (g.dtype == y.dtype == x_dtype) else torch.float32
        g2, y2 = g.reshape(rows, n).to(wd), y.reshape(rows, n).to(wd)
        # mean/rstd in the dtype ATen's own forward returns them in on this device: the input's on the CPU,
        # fp32 (the accumulation type) on CUDA, where a bf16 pair is rejected.
        sd = torch.float32 if y.is_cuda else wd
        zeros = torch.zeros(rows, 1, dtype=sd, device=y.device)
        ones = torch.ones(rows, 1, dtype=sd, device=y.device)
        dxh = torch.ops.aten.native_layer_norm_backward(g2, y2, [n], zeros, ones, None, None,
                                                         [True, False, False])[0]
        return (dxh.to(torch.float32) * rstd.reshape(rows, 1)).to(x_dtype).reshape(y.shape)
    gf = g.reshape(rows, n).to(cdt)
    yf = y.reshape(rows, n).to(cdt)
    dx = gf - yf * (gf * yf).mean(dim=1, keepdim=True)
    if not is_rms:
        dx = dx - gf.mean(dim=1, keepdim=True)
    dx = dx * rstd.reshape(rows, 1).to(cdt)
    return dx.to(x_dtype).reshape(y.shape)


# ------------------------------------------------------------------------------------------------------
# Library ops: what runs under torch.compile on the Triton path (a triton_op: inductor emits the launches).
# ------------------------------------------------------------------------------------------------------
def _fwd_fake(x, n, eps, is_rms, out_dtype):
    rows = x.numel() // n if n else 0
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty((rows,), dtype=torch.float32)


def _bwd_fake(g, y, rstd, is_rms, x_dtype):
    return y.new_empty(y.shape, dtype=x_dtype)


@kernel_op("lmbp_convert::ms_norm_fwd", _fwd_fake)
def _ms_norm_fwd_op(x: torch.Tensor, n: int, eps: float, is_rms: bool,
                    out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if x.numel() == 0:  # a library op may not return its input's views
        return _fwd_fake(x, n, eps, is_rms, out_dtype)
    return _fwd_triton(x, n, eps, is_rms, out_dtype, traced=True)


@kernel_op("lmbp_convert::ms_norm_bwd", _bwd_fake)
def _ms_norm_bwd_op(g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, is_rms: bool,
                    x_dtype: torch.dtype) -> torch.Tensor:
    if y.numel() == 0:
        return _bwd_fake(g, y, rstd, is_rms, x_dtype)
    return _bwd_triton(g, y, rstd, is_rms, x_dtype, traced=True)


def _op_setup_context(ctx, inputs, output):
    x, _, _, is_rms, _ = inputs
    y, rstd = output
    ctx.save_for_backward(y, rstd)
    ctx.mark_non_differentiable(rstd)
    ctx.is_rms, ctx.x_dtype = is_rms, x.dtype


def _op_backward(ctx, g, _g_rstd):
    y, rstd = ctx.saved_tensors
    return torch.ops.lmbp_convert.ms_norm_bwd(g, y, rstd, ctx.is_rms, ctx.x_dtype), None, None, None, None


_ms_norm_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)


# ------------------------------------------------------------------------------------------------------
# autograd.Function (eager) and public API
# ------------------------------------------------------------------------------------------------------
def norm_bwd_ops(g: torch.Tensor | None, xhat: torch.Tensor, rstd: torch.Tensor, g_rstd: torch.Tensor | None,
                 is_rms: bool) -> torch.Tensor:
    """dx of the affine-free norm over the rows (rows, n) of ``xhat`` (``g``: the gradient of x̂, ``g_rstd``: of
    rstd, either None), in differentiable torch ops, in the dtype of ``xhat`` (the caller's compute dtype):

        dx = rstd · (g − x̂ · mean(g·x̂) [− mean(g)])  −  rstd² / n · g_rstd · x̂

    (∂rstd/∂x = −rstd²·x̂/n for both norms). With x̂ and rstd the node's outputs, their graphs lead back to x, so
    differentiating this is the norm's exact second derivative (up to x̂'s own rounding)."""
    r = rstd.reshape(-1, 1).to(xhat.dtype)
    dx = torch.zeros_like(xhat)
    if g is not None:
        dx = g - xhat * (g * xhat).mean(dim=1, keepdim=True)
        if not is_rms:
            dx = dx - g.mean(dim=1, keepdim=True)
        dx = dx * r
    if g_rstd is not None and xhat.shape[1]:
        dx = dx - (r * r) * g_rstd.reshape(-1, 1).to(xhat.dtype) * xhat / xhat.shape[1]
    return dx


def _bwd_ops(g: torch.Tensor | None, y: torch.Tensor, rstd: torch.Tensor, g_rstd: torch.Tensor | None, is_rms: bool,
             x_dtype: torch.dtype) -> torch.Tensor:
    """`norm_bwd_ops` on the saved output, fp32 (fp64 for fp64), dx in x's dtype and y's shape."""
    cdt = _compute_dtype(x_dtype)
    rows = rstd.numel()
    n = y.numel() // rows if rows else 0
    gf = None if g is None else g.reshape(rows, n).to(cdt)
    return norm_bwd_ops(gf, y.reshape(rows, n).to(cdt), rstd, g_rstd, is_rms).to(x_dtype).reshape(y.shape)


def _backward_graph(ctx, g):
    """create_graph=True: the backward formula in torch ops on the saved y, an output of the node (its graph leads
    to x through the node), and rstd, `linked` to the node (a later backward hands its gradient here)."""
    y, rstd = ctx.saved_tensors
    is_rms, x_dtype, _ = ctx.spec
    got = handed(ctx) or {}
    dx = _bwd_ops(g, y, linked(ctx, "rstd", rstd, y), got.get("rstd"), is_rms, x_dtype)
    return dx, None, None, None, None


@twice_differentiable(_backward_graph)
def _backward(ctx, g):
    y, rstd = ctx.saved_tensors
    is_rms, x_dtype, triton_path = ctx.spec
    got = handed(ctx)
    if got is not None:  # a second backward, through `_backward_graph`: rstd's gradient handed here
        return _bwd_ops(g, y, rstd, got.get("rstd"), is_rms, x_dtype), None, None, None, None
    if torch.compiler.is_compiling():
        # Dynamo traces this backward with the gradient's layout it speculates; the one it gets may be transposed
        # (nn.MultiheadAttention's batch_first input), which the rows view below could not view: an explicit
        # contiguous copy (the graph's to fuse; eager reshape copies such a gradient anyway)
        g = g.clone(memory_format=torch.contiguous_format)
    dx = (_bwd_triton if triton_path else _bwd_torch)(g, y, rstd, is_rms, x_dtype)
    return dx, None, None, None, None


class MSNormFunction(torch.autograd.Function):
    """Normalise rows of length ``n``; save only the returned output and rstd for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, eps: float, is_rms: bool, out_dtype: torch.dtype) -> torch.Tensor:
        triton_path = use_triton(x)
        y, rstd = (_fwd_triton if triton_path else _fwd_torch)(x, n, eps, is_rms, out_dtype)
        ctx.save_for_backward(y, rstd)
        ctx.spec = (is_rms, x.dtype, triton_path)
        return y

    backward = staticmethod(_backward)


class _TritonMSNorm(torch.autograd.Function):
    """`MSNormFunction` on the Triton path with nothing else per call (the eager hot path)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, eps: float, is_rms: bool, out_dtype: torch.dtype) -> torch.Tensor:
        y, rstd = _fwd_triton(x, n, eps, is_rms, out_dtype)
        ctx.save_for_backward(y, rstd)
        ctx.spec = (is_rms, x.dtype, True)
        return y

    backward = staticmethod(MSNormFunction.backward)


def normalize_shape(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    """``normalized_shape`` as a non-empty tuple of non-negative ints (ValueError otherwise)."""
    if isinstance(normalized_shape, int):
        shape = (normalized_shape,)
    elif isinstance(normalized_shape, (str, bytes)):
        raise ValueError(f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}")
    else:
        try:
            shape = tuple(int(s) for s in normalized_shape)
        except (TypeError, ValueError):
            raise ValueError(
                f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}"
            ) from None
    if not shape or any(s < 0 for s in shape):
        raise ValueError(f"normalized_shape must be a non-empty sequence of non-negative ints, got {shape}")
    return shape


def _ms_norm(x: torch.Tensor, normalized_shape: int | Sequence[int], eps: float, is_rms: bool,
             op: str) -> torch.Tensor:
    check_dtype(x, op)
    shape = normalize_shape(normalized_shape)
    k = len(shape)
    if x.dim() < k or tuple(x.shape[-k:]) != shape:
        raise ValueError(
            f"{op}: normalized_shape {shape} does not match the trailing dims of the input of shape "
            f"{tuple(x.shape)}"
        )
    n = 1
    for s in shape:
        n *= s
    return ms_norm_unchecked(x, n, float(eps), is_rms)


#: The C++ host path's ``ms_norm(x, n, eps, is_rms)`` under key 0, or False (Python path).
_HOST = cuda_host.state_cache()


def _host_entry():
    ext = cuda_host.ext() if HAS_TRITON else None
    fn = False
    if ext is not None:
        ext.set_norm_callbacks(_host_plan, _host_backward_graph)
        fn = ext.ms_norm
    _HOST[0] = fn
    return fn


def _host_plan(n: int) -> tuple[int, int, int, int]:
    """Kernel slots for rows of ``n``: (fwd LayerNorm, fwd RMSNorm, bwd LayerNorm, bwd RMSNorm)."""
    looped, block, warps = _PLANS.get(n) or _plan_for(n)
    fwd, bwd = (_FWD_LOOP, _BWD_LOOP) if looped else (_FWD, _BWD)
    return tuple(cuda_host.slot(k, (rms, block), warps) for k in (fwd, bwd) for rms in (False, True))


def _host_backward_graph(g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, is_rms: bool, x_dtype: torch.dtype):
    """The C++ node's backward under create_graph. Its rstd cannot be `linked` (the node's own backward in C++
    takes no hand-off), so there is no real second derivative: refused, naming the switches (the Python path,
    LMBP_CUDA_HOST=0, has one)."""
    raise NoSecondDerivativeError(
        "memory-sharing norm on the C++ host path (LMBP_CUDA_HOST=1)", "norms",
        "its node treats rstd as a constant; LMBP_CUDA_HOST=0 runs the Python path, which differentiates it")


def ms_norm_unchecked(x: torch.Tensor, n: int, eps: float, is_rms: bool) -> torch.Tensor:
    """The norm over rows of ``n`` trailing elements, for callers that validated the shape once (modules);
    only the dtype is checked here."""
    if func_transforms.active():  # torch.func: the same function through torch's ops
        return func_transforms.ms_norm(x, n, eps, is_rms, autocast_dtype_for(x))
    on = route("ms_norm", x, use_triton(x))  # the hot path first: a CUDA tensor of a Triton dtype
    if on is Backend.COMPILED:
        return torch.ops.lmbp_convert.ms_norm_fwd(x, n, eps, is_rms, autocast_dtype_for(x))[0]
    if on is Backend.CUDA_HOST:  # forward, graph node and backward in C++ (output dtype: autocast's, as below)
        host = _HOST.get(0)
        if host is None:
            host = _host_entry()
        y = host(x, n, eps, is_rms) if host else NotImplemented
        if y is not NotImplemented:
            return y
        on = Backend.TRITON  # a call C++ declines
    if on is Backend.TRITON:
        out_dtype = autocast_dtype_for(x)
        if x.requires_grad and torch.is_grad_enabled():
            return _TritonMSNorm.apply(x, n, eps, is_rms, out_dtype)
        return _fwd_triton(x, n, eps, is_rms, out_dtype)[0]  # nothing to save: no autograd
    if x.dtype not in _DTYPE_SET:
        check_dtype(x, "ms_norm")
    return MSNormFunction.apply(x, n, eps, is_rms, autocast_dtype_for(x))


def ms_layer_norm(x: torch.Tensor, normalized_shape: int | Sequence[int], eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the trailing ``normalized_shape`` dims, no affine, backward from the output.

    Output dtype: the autocast compute dtype under torch.autocast, else x's dtype.
    """
    return _ms_norm(x, normalized_shape, eps, False, "ms_layer_norm")


def ms_rms_norm(x: torch.Tensor, normalized_shape: int | Sequence[int], eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the trailing ``normalized_shape`` dims, no affine, backward from the output.

    Output dtype: the autocast compute dtype under torch.autocast, else x's dtype.
    """
    return _ms_norm(x, normalized_shape, eps, True, "ms_rms_norm")
