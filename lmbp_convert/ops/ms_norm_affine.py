"""Memory-sharing LayerNorm / RMSNorm that keeps its affine: y = x̂·γ + β, backward from the output y.

Where a norm's affine cannot be folded into the next Linears (a post-LN residual add in the same forward, a tied
head, a quantized consumer), but a consumer keeps the norm's output for its own backward anyway, the norm need not
keep its input as well: x̂ is recovered from the output as x̂ = (y − β)/γ (NVIDIA Apex's ``memory_efficient``
LayerNorm takes this route), and

    LayerNorm  dx = rstd · (ĝ − mean(ĝ) − x̂ · mean(ĝ·x̂)),   ĝ = g·γ
    RMSNorm    dx = rstd · (ĝ − x̂ · mean(ĝ·x̂))
    dγ = Σ_rows g·x̂,   dβ = Σ_rows g      (γ = w or 1 + w: dw = dγ either way)

So the pair (norm, consumer) keeps one activation-sized storage (y) plus rstd (4 bytes a row), as the folded
memory-sharing norm does (`ms_norm`), without touching any weight.

**Accuracy and the guard.** y is rounded to its dtype (relative error u: 2⁻²⁴ fp32, 2⁻⁸ bf16), so the recovered
value errs by |δx̂_j| ≤ u·(|x̂_j| + |β_j|/|γ_j|) (plus fp32 arithmetic). With |β_j| ≤ R·|γ_j| this is at most
u·(|x̂_j| + R): the same order as the rounding the affine-free memory-sharing norm already accepts (u·|x̂|). A
channel with |γ_j| < ``GAMMA_FLOOR`` or |β_j| > R·|γ_j| (`unreliable_channels`, R = ``BETA_RATIO``) cannot be
inverted to that bound (γ = 0 loses x̂ entirely), so the op keeps those few *columns of the input* (``side``,
rows × k in the input's dtype, plus LayerNorm's per-row mean) and rebuilds x̂ for them exactly as torch does,
(x − mean)·rstd. Every channel's gradient thus stays within the bound above; the cost is k/n of the input. The
module (`lmbp_convert.nn.affine_norms`) chooses k at every forward and falls back to the plain norm when more
than half the channels would need it. Measured errors: docs/affine_ms_norm.md.

Double backward (``create_graph=True``): the backward written in torch ops (`_bwd_ops`) on y (an output of the
node), γ, β (inputs) and rstd, the kept columns and the row means, `_common.linked` to the node (the next backward
hands their gradients to the node's backward, which sends them on to x): the norm's exact second derivative (up
to y's rounding). The first-order path is unchanged.

Dispatch: Triton kernels for CUDA tensors (rows up to ``MAX_BLOCK`` elements; longer rows and every other device
take the PyTorch path, same signature and semantics, the reference in tests).
"""
from __future__ import annotations

import torch

from ..fold import BETA_RATIO, GAMMA_FLOOR, unreliable_channels
from . import func_transforms
from ._common import HAS_TRITON, autocast_dtype_for, check_dtype, handed, linked, twice_differentiable, use_triton
from .ms_norm import norm_bwd_ops

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["BETA_RATIO", "GAMMA_FLOOR", "MSAffineNormFunction", "ms_norm_affine", "plain_norm_affine",
           "unreliable_channels"]

#: longest row the Triton kernels hold in registers; longer rows take the PyTorch path
MAX_BLOCK = 16384
#: rows one backward program handles (its dγ, dβ partial sums stay in registers across them)
ROWS_PER_PROGRAM = 32


# ------------------------------------------------------------------------------------------------------
# Triton kernels: fp32 math; one program per row forward, ROWS programs' worth of rows per backward program.
# ------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _fwd_kernel(X, W, B, Y, RSTD, MEAN, stride_x, N, eps,
                    IS_RMS: tl.constexpr, ONE_PLUS: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if IS_RMS:
            mean = 0.0
            xc = x
        else:
            mean = tl.sum(x, axis=0) / N
            xc = tl.where(mask, x - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / N + eps)
        gamma = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if ONE_PLUS:
            gamma = gamma + 1.0
        y = xc * rstd * gamma
        if HAS_B:
            y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + row, rstd)
        tl.store(MEAN + row, mean)

    @triton.jit
    def _bwd_kernel(G, Y, W, B, RSTD, MEAN, CMAP, SIDE, DX, DW, DB, M, N, K, stride_g,
                    IS_RMS: tl.constexpr, ONE_PLUS: tl.constexpr, HAS_B: tl.constexpr, HAS_SIDE: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        gamma = tl.load(W + cols, mask=mask, other=1.0).to(tl.float32)
        if ONE_PLUS:
            gamma = gamma + 1.0
        beta = tl.zeros([BLOCK], dtype=tl.float32)
        if HAS_B:
            beta = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        slot = tl.full([BLOCK], -1, tl.int32)
        if HAS_SIDE:
            slot = tl.load(CMAP + cols, mask=mask, other=-1)
        fixed = slot >= 0
        # fixed channels are rebuilt from the kept columns; γ = 0 left unguarded (a guard one update late) gives x̂ = 0
        inv = 1.0 / tl.where(fixed | ~mask | (gamma == 0.0), 1.0, gamma)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        db = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(0, ROWS):
            row = pid * ROWS + i
            if row < M:
                r64 = row.to(tl.int64)
                g = tl.load(G + r64 * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
                y = tl.load(Y + r64 * N + cols, mask=mask, other=0.0).to(tl.float32)
                rstd = tl.load(RSTD + r64)
                xh = tl.where(mask, (y - beta) * inv, 0.0)
                if HAS_SIDE:
                    xs = tl.load(SIDE + r64 * K + slot, mask=fixed & mask, other=0.0).to(tl.float32)
                    xh = tl.where(fixed, (xs - tl.load(MEAN + r64)) * rstd, xh)
                gh = g * gamma
                mean_gx = tl.sum(gh * xh, axis=0) / N
                if IS_RMS:
                    dx = (gh - xh * mean_gx) * rstd
                else:
                    dx = (gh - tl.sum(gh, axis=0) / N - xh * mean_gx) * rstd
                tl.store(DX + r64 * N + cols, dx.to(DX.dtype.element_ty), mask=mask)
                dw += g * xh
                db += g
        tl.store(DW + pid * N + cols, dw, mask=mask)
        tl.store(DB + pid * N + cols, db, mask=mask)


def _num_warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def _rows(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """``t`` as (rows, n) with unit column stride (a copy only where it has none)."""
    t2 = t.reshape(-1, n)
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2, t2.stride(0)


def _fwd_triton(x, w, b, n, eps, is_rms, one_plus, out_dtype):
    x2, sx = _rows(x, n)
    m = x2.shape[0]
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _fwd_kernel[(m,)](x2, w, b if b is not None else w, y, rstd, mean, sx, n, float(eps),
                          IS_RMS=is_rms, ONE_PLUS=one_plus, HAS_B=b is not None, BLOCK=triton.next_power_of_2(n),
                          num_warps=_num_warps(triton.next_power_of_2(n)))
    return y, rstd, mean


def _bwd_triton(g, y, w, b, rstd, mean, keep_idx, side, is_rms, one_plus, x_dtype):
    n = w.numel()
    cmap = None
    if keep_idx is not None:  # channel → its column in ``side`` (−1: recovered from y)
        cmap = torch.full((n,), -1, dtype=torch.int32, device=y.device)
        cmap[keep_idx] = torch.arange(keep_idx.numel(), dtype=torch.int32, device=y.device)
    g2, sg = _rows(g, n)
    m = rstd.numel()
    dx = torch.empty(y.shape, dtype=x_dtype, device=y.device)
    progs = max(1, triton.cdiv(m, ROWS_PER_PROGRAM))
    dw = torch.zeros(progs, n, dtype=torch.float32, device=y.device)
    db = torch.zeros(progs, n, dtype=torch.float32, device=y.device)
    if m:
        k = side.shape[-1] if side is not None else 0
        _bwd_kernel[(progs,)](g2, y, w, b if b is not None else w, rstd, mean if mean is not None else rstd, cmap if cmap is not None else rstd,
                              side if side is not None else rstd, dx, dw, db, m, n, k, sg,
                              IS_RMS=is_rms, ONE_PLUS=one_plus, HAS_B=b is not None, HAS_SIDE=side is not None,
                              ROWS=ROWS_PER_PROGRAM, BLOCK=triton.next_power_of_2(n),
                              num_warps=_num_warps(triton.next_power_of_2(n)))
    return dx, dw.sum(0), db.sum(0)


# ------------------------------------------------------------------------------------------------------
# PyTorch path: identical semantics, every device; the reference in tests.
# ------------------------------------------------------------------------------------------------------
def _cdt(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _gamma(w: torch.Tensor, one_plus: bool, cdt: torch.dtype) -> torch.Tensor:
    gamma = w.detach().to(cdt)
    return gamma + 1.0 if one_plus else gamma


def _fwd_torch(x, w, b, n, eps, is_rms, one_plus, out_dtype):
    """(y in out_dtype with x's shape, rstd (rows,), mean (rows,); fp64 statistics for fp64 x)."""
    cdt = _cdt(x.dtype)
    rows = x.numel() // n if n else 0
    xf = x.reshape(rows, n).to(cdt)
    gamma = _gamma(w, one_plus, cdt)
    beta = b.detach().to(cdt) if b is not None else None
    if not is_rms and rows and n and cdt == torch.float32:  # one fused ATen pass, fp32 statistics
        y, mean, rstd = torch.native_layer_norm(xf, (n,), gamma, beta, eps)
        return y.to(out_dtype).reshape(x.shape), rstd.reshape(-1), mean.reshape(-1)
    mean = torch.zeros(rows, 1, dtype=cdt, device=x.device) if is_rms else xf.mean(dim=1, keepdim=True)
    xc = xf - mean
    rstd = torch.rsqrt((xc * xc).mean(dim=1, keepdim=True) + eps)
    y = xc * rstd * gamma
    if beta is not None:
        y = y + beta
    return y.to(out_dtype).reshape(x.shape), rstd.reshape(-1), mean.reshape(-1)


def _bwd_torch(g, y, w, b, rstd, mean, keep_idx, side, is_rms, one_plus, x_dtype):
    """(dx in x_dtype, dγ, dβ in fp32/fp64) from the output, rstd and the kept columns of unreliable channels."""
    cdt = _cdt(x_dtype)
    n = w.numel()
    rows = rstd.numel()
    gamma = _gamma(w, one_plus, cdt)
    gf, yf = g.reshape(rows, n).to(cdt), y.reshape(rows, n).to(cdt)
    r = rstd.reshape(rows, 1).to(cdt)
    if b is not None:
        yf = yf - b.detach().to(cdt)
    safe = gamma.masked_fill(gamma == 0, 1.0)  # γ = 0 left unguarded (a guard one update late): x̂ = 0, not inf
    safe = safe if keep_idx is None else safe.index_fill(0, keep_idx, 1.0)
    xh = yf / safe
    if side is not None:  # the unreliable channels, exactly as torch computes them: (x − mean)·rstd
        xh[:, keep_idx] = (side.to(cdt) - mean.reshape(rows, 1).to(cdt)) * r
    gh = gf * gamma
    dx = gh - xh * (gh * xh).mean(dim=1, keepdim=True)
    if not is_rms:
        dx = dx - gh.mean(dim=1, keepdim=True)
    dx = dx * r
    return dx.to(x_dtype).reshape(y.shape), (gf * xh).sum(0), gf.sum(0)


# ------------------------------------------------------------------------------------------------------
# autograd.Function and public API
# ------------------------------------------------------------------------------------------------------
def _bwd_ops(ctx, g, rstd, mean, side, got: dict):
    """The backward in differentiable torch ops: x̂ = (y − β)/γ from the saved y (an output of the node), γ, β (its
    inputs), and for the kept channels x̂ = (x − mean)·rstd from their input columns; ``rstd``, ``mean``, ``side``:
    the saved ones, or `linked` to the node (create_graph). ``got``: gradients handed to those (a second backward),
    which go back to x: rstd's by −rstd²·x̂/n, the means' by 1/n (LayerNorm), the columns' into their columns."""
    y, _, w, b, _, keep_idx, _ = ctx.saved_tensors
    is_rms, one_plus, x_dtype, _, w_dtype, b_dtype = ctx.flags
    cdt = _cdt(x_dtype)
    n = w.numel()
    rows = rstd.numel()
    gamma = w.to(cdt) + 1.0 if one_plus else w.to(cdt)
    yf = y.reshape(rows, n).to(cdt)
    if b is not None:
        yf = yf - b.to(cdt)
    safe = torch.where(gamma == 0, torch.ones_like(gamma), gamma)  # γ = 0 (a guard one update late): x̂ = 0
    if side is not None:
        safe = safe.index_fill(0, keep_idx, 1.0)
    xh = yf / safe
    if side is not None:  # the kept channels from their input columns, as the first-order backward
        xh = xh.index_copy(1, keep_idx, (side.to(cdt) - mean.reshape(rows, 1).to(cdt)) * rstd.reshape(rows, 1).to(cdt))
    gf = None if g is None else g.reshape(rows, n).to(cdt)
    dx = norm_bwd_ops(None if gf is None else gf * gamma, xh, rstd, got.get("rstd"), is_rms)
    if got.get("side") is not None:  # the kept columns are x's own columns
        dx = dx.index_add(1, keep_idx, got["side"].to(cdt))
    if got.get("mean") is not None and not is_rms:  # an RMSNorm's "mean" is a constant 0
        dx = dx + got["mean"].reshape(rows, 1).to(cdt) / n
    dx = dx.to(x_dtype).reshape(y.shape)
    dw = db = None
    if gf is not None and ctx.needs_input_grad[1]:
        dw = (gf * xh).sum(0).to(w_dtype)
    if gf is not None and b is not None and ctx.needs_input_grad[2]:
        db = gf.sum(0).to(b_dtype)
    return dx, dw, db, None, None, None, None, None, None


def _backward_graph(ctx, g):
    """create_graph=True: `_bwd_ops` with rstd (and the kept columns, the means) `linked` to the node."""
    y, rstd, _, _, mean, _, side = ctx.saved_tensors
    got = handed(ctx) or {}
    rstd = linked(ctx, "rstd", rstd, y)
    if side is not None:
        mean, side = linked(ctx, "mean", mean, y), linked(ctx, "side", side, y)
    return _bwd_ops(ctx, g, rstd, mean, side, got)


@twice_differentiable(_backward_graph)
def _backward(ctx, g):
    y, rstd, w, b, mean, keep_idx, side = ctx.saved_tensors
    got = handed(ctx)
    if got is not None:  # a second backward, through `_backward_graph`: gradients handed to rstd, means, columns
        return _bwd_ops(ctx, g, rstd, mean, side, got)
    is_rms, one_plus, x_dtype, triton_path, w_dtype, b_dtype = ctx.flags
    fn = _bwd_triton if triton_path else _bwd_torch
    dx, dw, db = fn(g, y, w, b, rstd, mean, keep_idx, side, is_rms, one_plus, x_dtype)
    dw = dw.to(w_dtype) if ctx.needs_input_grad[1] else None
    db = db.to(b_dtype) if b is not None and ctx.needs_input_grad[2] else None
    return dx, dw, db, None, None, None, None, None, None


class MSAffineNormFunction(torch.autograd.Function):
    """y = norm(x)·γ + β over rows of ``n``; saves y, rstd (and, for unreliable channels, their input columns)."""

    @staticmethod
    def forward(ctx, x, weight, bias, n, eps, is_rms, one_plus, out_dtype, keep_idx):
        triton_path = use_triton(x) and n <= MAX_BLOCK and x.dtype != torch.float64
        w = weight.contiguous()
        b = bias.contiguous() if bias is not None else None
        y, rstd, mean = (_fwd_triton if triton_path else _fwd_torch)(x, w, b, n, eps, is_rms, one_plus, out_dtype)
        if not any(ctx.needs_input_grad[:3]):  # inference: nothing to keep
            return y
        side = None
        if keep_idx is not None and keep_idx.numel():
            side = x.reshape(-1, n).index_select(1, keep_idx)  # sorted: slot order = channel order
        else:
            keep_idx = None
        ctx.save_for_backward(y, rstd, w, b, mean if side is not None else None, keep_idx, side)
        ctx.flags = (is_rms, one_plus, x.dtype, triton_path, weight.dtype, bias.dtype if bias is not None else None)
        return y

    backward = staticmethod(_backward)


def plain_norm_affine(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int, eps: float,
                      is_rms: bool, one_plus: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The same norm through torch's own ops (autograd saves its input): exact, nothing saved. What the guard
    falls back to, and what runs under torch.compile where the guard's channel choice would be data-dependent."""
    gamma = 1.0 + weight if one_plus else weight
    if is_rms:
        y = torch.nn.functional.rms_norm(x, (n,), gamma, eps)
        y = y + bias if bias is not None else y
    else:
        y = torch.nn.functional.layer_norm(x, (n,), gamma, bias, eps)
    return y if out_dtype is None else y.to(out_dtype)


def ms_norm_affine(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int, eps: float,
                   is_rms: bool, one_plus: bool = False, keep_idx: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """LayerNorm (``is_rms=False``) / RMSNorm over the trailing ``n`` elements with scale γ (``weight``, or
    1 + ``weight`` with ``one_plus``) and shift β (``bias``), whose backward reads its output.

    ``keep_idx``: sorted channel indices (int64, on x's device) whose input columns are kept for backward instead
    of being recovered from y; None: those `unreliable_channels` finds now (a host sync on GPUs: modules pass the
    indices they cached for the current parameters). Output dtype: ``out_dtype``, else the autocast compute dtype
    under autocast (so the consumer Linear saves this very storage), else x's.

    Under torch.compile, ``keep_idx=None`` means `plain_norm_affine` (the channel search has a data-dependent
    size, which a graph cannot hold); explicit indices compile as they are.
    """
    check_dtype(x, "ms_norm_affine")
    if weight.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"ms_norm_affine: weight/bias must have shape ({n},), got {tuple(weight.shape)}"
                         + (f" and {tuple(bias.shape)}" if bias is not None else ""))
    if x.dim() == 0 or x.shape[-1] != n:
        raise ValueError(f"ms_norm_affine: input of shape {tuple(x.shape)} has no rows of {n}")
    if func_transforms.active():  # torch.func: the same function through torch's ops
        out = out_dtype if out_dtype is not None else autocast_dtype_for(x)
        return func_transforms.ms_norm_affine(x, weight, bias, n, eps, is_rms, one_plus, out)
    if keep_idx is None:
        if torch.compiler.is_compiling():
            return plain_norm_affine(x, weight, bias, n, eps, is_rms, one_plus, out_dtype)
        keep_idx = torch.nonzero(unreliable_channels(weight, bias, one_plus)).reshape(-1)
    out = out_dtype if out_dtype is not None else autocast_dtype_for(x)
    return MSAffineNormFunction.apply(x, weight, bias, n, float(eps), is_rms, one_plus, out, keep_idx)
