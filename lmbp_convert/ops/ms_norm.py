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

Dispatch: Triton kernels for CUDA tensors (`use_triton`), the PyTorch path (`_fwd_torch` / `_bwd_torch`)
everywhere else; both share one signature so tests compare them directly. The Triton launchers
(`_fwd_triton` / `_bwd_triton`) are also exposed as the custom ops ``lmbp_convert::ms_norm_fwd`` /
``lmbp_convert::ms_norm_bwd``, which is what runs under torch.compile (opaque to Dynamo, with fake kernels).
Rows up to ``MAX_FUSED_BLOCK`` (16384) elements are held in registers by one program; longer rows use a
looped kernel that streams the row in ``LOOP_CHUNK``-element chunks (two/three passes over global memory).
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import cpu_native
from ._common import HAS_TRITON, autocast_dtype_for, check_dtype, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["ms_layer_norm", "ms_rms_norm", "MSNormFunction", "normalize_shape"]

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


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """(rows, n) view of t with unit column stride (copies only when no such view exists)."""
    t2 = t.reshape(-1, n)
    if n > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


def _num_warps(block: int) -> int:
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def _plan(n: int, chunk: int | None) -> tuple[bool, int]:
    """(looped?, BLOCK): the single-block kernel when the row fits, else the looped one."""
    if chunk is not None:
        return True, triton.next_power_of_2(chunk)
    block = triton.next_power_of_2(n)
    if block <= MAX_FUSED_BLOCK:
        return False, block
    return True, LOOP_CHUNK


def _fwd_triton(x: torch.Tensor, n: int, eps: float, is_rms: bool, out_dtype: torch.dtype,
                chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward: (y with x's shape in out_dtype, contiguous; rstd (rows,) fp32).

    ``chunk`` forces the looped kernel with that chunk size (tests use it on short rows).
    """
    if x.numel() == 0:
        return _fwd_torch(x, n, eps, is_rms, out_dtype)
    x2 = _rows(x, n)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    looped, block = _plan(n, chunk)
    kernel = _ms_norm_fwd_loop_kernel if looped else _ms_norm_fwd_kernel
    kernel[(m,)](x2, y, rstd, x2.stride(0), y.stride(0), n, float(eps),
                 IS_RMS=is_rms, BLOCK=block, num_warps=_num_warps(block))
    return y.view(x.shape), rstd


def _bwd_triton(g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, is_rms: bool, x_dtype: torch.dtype,
                chunk: int | None = None) -> torch.Tensor:
    """Triton backward: dx with y's shape in x_dtype, from the upstream grad g, the saved output and rstd."""
    if y.numel() == 0:
        return _bwd_torch(g, y, rstd, is_rms, x_dtype)
    n = y.numel() // rstd.numel()
    g2, y2 = _rows(g, n), _rows(y, n)
    m = y2.shape[0]
    dx = torch.empty((m, n), dtype=x_dtype, device=y.device)
    looped, block = _plan(n, chunk)
    kernel = _ms_norm_bwd_loop_kernel if looped else _ms_norm_bwd_kernel
    kernel[(m,)](g2, y2, rstd, dx, g2.stride(0), y2.stride(0), dx.stride(0), n,
                 IS_RMS=is_rms, BLOCK=block, num_warps=_num_warps(block))
    return dx.view(y.shape)


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
        zeros = torch.zeros(rows, 1, dtype=wd, device=y.device)
        ones = torch.ones(rows, 1, dtype=wd, device=y.device)
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
# Custom ops: the Triton path as opaque ops, so torch.compile neither traces into the launchers nor breaks.
# ------------------------------------------------------------------------------------------------------
@torch.library.custom_op("lmbp_convert::ms_norm_fwd", mutates_args=())
def _ms_norm_fwd_op(x: torch.Tensor, n: int, eps: float, is_rms: bool,
                    out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    y, rstd = _fwd_triton(x, n, eps, is_rms, out_dtype)
    return y, rstd


@_ms_norm_fwd_op.register_fake
def _(x, n, eps, is_rms, out_dtype):
    rows = x.numel() // n if n else 0
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty((rows,), dtype=torch.float32)


@torch.library.custom_op("lmbp_convert::ms_norm_bwd", mutates_args=())
def _ms_norm_bwd_op(g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, is_rms: bool,
                    x_dtype: torch.dtype) -> torch.Tensor:
    return _bwd_triton(g, y, rstd, is_rms, x_dtype)


@_ms_norm_bwd_op.register_fake
def _(g, y, rstd, is_rms, x_dtype):
    return y.new_empty(y.shape, dtype=x_dtype)


# ------------------------------------------------------------------------------------------------------
# autograd.Function and public API
# ------------------------------------------------------------------------------------------------------
class MSNormFunction(torch.autograd.Function):
    """Normalise rows of length ``n``; save only the returned output and rstd for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, eps: float, is_rms: bool, out_dtype: torch.dtype) -> torch.Tensor:
        triton_path = use_triton(x)
        if triton_path:
            if torch.compiler.is_compiling():
                y, rstd = torch.ops.lmbp_convert.ms_norm_fwd(x, n, eps, is_rms, out_dtype)
            else:
                y, rstd = _fwd_triton(x, n, eps, is_rms, out_dtype)
        else:
            y, rstd = _fwd_torch(x, n, eps, is_rms, out_dtype)
        ctx.save_for_backward(y, rstd)
        ctx.is_rms = is_rms
        ctx.x_dtype = x.dtype
        ctx.triton_path = triton_path
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: torch.Tensor):
        y, rstd = ctx.saved_tensors
        if ctx.triton_path:
            if torch.compiler.is_compiling():
                dx = torch.ops.lmbp_convert.ms_norm_bwd(g, y, rstd, ctx.is_rms, ctx.x_dtype)
            else:
                dx = _bwd_triton(g, y, rstd, ctx.is_rms, ctx.x_dtype)
        else:
            dx = _bwd_torch(g, y, rstd, ctx.is_rms, ctx.x_dtype)
        return dx, None, None, None, None


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
    return MSNormFunction.apply(x, n, float(eps), is_rms, autocast_dtype_for(x))


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
