"""Approx-BP activations (arXiv 2406.16282): exact forward, k-bit step-function backward.

GELU/SiLU-like activations normally keep their full input for backward. Here the forward is the exact
activation, but the backward uses the derivative of a piecewise-linear fit f(x) = sum_i a_i max(x - c_i, 0)
(constants: ``lmbp_convert/data/approx_constants.json``, fitted by ``ops/fit.py``; 2-bit gelu/silu are the
paper's ReGELU2/ReSiLU2). f' is a step function, so each element only needs its *code*, the number of
thresholds it exceeds (0..2**k - 1), and the backward is ``grad_in = grad_out * slope[code]`` with
``slope[j] = a_1 + ... + a_j`` (slope[0] = 0, slope[-1] = sum(a) = 1).

Saved for backward: ONE uint8 tensor of packed codes and nothing else (not x, not y).
Packing layout, shared by the Triton and PyTorch paths: elements in x's logical row-major order; element i goes
to byte i // P at bit offset (i % P) * S, with slot width S = k for k in {1, 2, 4} and S = 4 for k = 3
(3-bit codes sit in 4-bit slots: P must divide 8, so 3 bits would straddle bytes), and P = 8 // S codes per
byte. The tensor holds exactly ceil(N / P) bytes: N/4 for the default k = 2 (1/16 of an fp32 input).

Numerics: the activation is computed in fp32 (fp64 for fp64 inputs, PyTorch path only) and rounded once to
x's dtype (on the PyTorch path through ATen's fused gelu/silu kernels, which compute in fp32 internally);
thresholds are the fp32 constants, and the PyTorch path compares in x's own dtype against each threshold
moved down onto x's grid, which gives exactly the fp32 comparison without an fp32 copy of x; grad_in is
computed in fp32 and rounded to grad_out's dtype. Special values: +inf exceeds every threshold (slope sum(a) = 1, the true limit), -inf none
(slope 0). NaN compares false with every threshold, so a NaN input gets code 0 and its gradient is
``grad_out * 0`` (0, or NaN only where grad_out is inf/NaN), whereas the exact derivative would be NaN: a
code cannot hold NaN. The forward output there is NaN, so the loss is NaN anyway.

Dispatch: Triton kernels for CUDA tensors, the PyTorch path everywhere else (same codes, same layout, so
either backward can consume either forward's codes). Under ``torch.compile`` the PyTorch path is traced
normally; the Triton path is wrapped in ``torch.library.custom_op`` so dynamo sees an opaque op with a fake
(meta) implementation instead of a graph break.
"""
from __future__ import annotations

import json
import math
import struct
import sys
from importlib import resources
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from . import cpu_native
from ._common import HAS_TRITON, TRITON_DTYPES, check_dtype, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "ACT_KINDS",
    "ACT_BITS",
    "ApproxConstants",
    "ApproxActFunction",
    "approx_act",
    "get_constants",
    "packed_nbytes",
    "pack_codes",
    "unpack_codes",
    "slot_bits",
]

ACT_KINDS = ("gelu", "gelu_tanh", "silu", "quick_gelu")
ACT_BITS = (1, 2, 3, 4)
_KIND_ID = {k: i for i, k in enumerate(ACT_KINDS)}
_SQRT1_2 = 0.7071067811865476
_ELEMS_PER_PROGRAM = 2048  # elements one Triton program handles (BLOCK bytes * codes per byte)


# ---------------------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------------------
class ApproxConstants(NamedTuple):
    """Constants of one approximate activation. ``c`` ascending; ``slopes[j]`` is f' past j thresholds."""

    kind: str
    bits: int
    a: tuple[float, ...]
    c: tuple[float, ...]
    slopes: tuple[float, ...]
    source: str
    c_f32: tuple[float, ...]  # c rounded to fp32: what the fp32 comparisons (both paths) actually use


def _load_constants() -> dict[tuple[str, int], ApproxConstants]:
    text = resources.files("lmbp_convert").joinpath("data/approx_constants.json").read_text()
    table = json.loads(text)["constants"]
    out = {}
    for kind in ACT_KINDS:
        for bits in ACT_BITS:
            e = table[kind][str(bits)]
            a, c = tuple(float(v) for v in e["a"]), tuple(float(v) for v in e["c"])
            if len(a) != 2**bits - 1 or len(c) != len(a) or list(c) != sorted(c):
                raise ValueError(f"approx_constants.json: bad entry {kind}/{bits}")
            slopes = tuple(math.fsum(a[:j]) for j in range(len(a) + 1))
            c_f32 = tuple(struct.unpack("f", struct.pack("f", v))[0] for v in c)
            out[(kind, bits)] = ApproxConstants(kind, bits, a, c, slopes, e["source"], c_f32)
    return out


# A plain dict (not an lru_cache) so that torch.compile can trace the lookups.
_CONSTANTS = _load_constants()


def _validate(kind: str, bits: int) -> None:
    if kind not in _KIND_ID:
        raise ValueError(f"unknown activation kind {kind!r}; expected one of {', '.join(ACT_KINDS)}")
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in ACT_BITS:
        raise ValueError(f"bits must be an int in 1..4, got {bits!r}")


def get_constants(kind: str, bits: int = 2) -> ApproxConstants:
    """The constants the op uses for ``kind`` at ``bits`` bits."""
    _validate(kind, bits)
    return _CONSTANTS[(kind, bits)]


# ---------------------------------------------------------------------------------------------------------
# Code packing (PyTorch; the Triton kernels implement the same layout)
# ---------------------------------------------------------------------------------------------------------
def slot_bits(bits: int) -> int:
    """Bits per stored code: k, except 3-bit codes use 4-bit slots."""
    return 4 if bits == 3 else bits


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes of the saved code tensor for ``numel`` elements: ceil(numel / (8 // slot_bits(bits)))."""
    per_byte = 8 // slot_bits(bits)
    return -(-numel // per_byte)


_WORD = {1: torch.int64, 2: torch.int32, 4: torch.int16}  # slot bits -> int holding one packed byte's codes


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a flat uint8 tensor of codes (each < 2**bits) into ceil(N / P) bytes, low slot first.

    The P code bytes of one packed byte are read as one little-endian integer, so packing is a handful of
    shifts and masks over N/P words instead of P strided passes.
    """
    s = slot_bits(bits)
    per_byte = 8 // s
    n = codes.numel()
    nbytes = packed_nbytes(n, bits)
    codes = codes.reshape(-1)
    if nbytes * per_byte != n:
        codes = F.pad(codes, (0, nbytes * per_byte - n))
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
        lanes = codes.view(nbytes, per_byte)
        packed = lanes[:, 0].clone()
        for j in range(1, per_byte):
            packed |= lanes[:, j] << (j * s)
        return packed
    # One multiply gathers the P code bytes of a word into its top byte: byte j (value < 2**s) times
    # 2**(8(P-1) - k(8-s)) lands at bit 8(P-1) + j*s when k == j; the cross terms (k ≠ j) land on distinct
    # fields below the top byte (no carries) or overflow past the word (wrap-around is harmless).
    words = codes.contiguous().view(_WORD[s])
    top = 8 * (per_byte - 1)
    k = sum(1 << (top - j * (8 - s)) for j in range(per_byte))
    k = k - (1 << 64) if k >= 1 << 63 else k  # as a signed int64 scalar
    return ((words * k) >> top).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: a flat uint8 tensor of ``numel`` codes."""
    s = slot_bits(bits)
    shifts = torch.arange(0, 8, s, dtype=torch.uint8, device=packed.device)
    lanes = (packed[:, None] >> shifts[None, :]) & ((1 << s) - 1)
    return lanes.reshape(-1)[:numel]


def _byte_slope_table(const: "ApproxConstants", dtype: torch.dtype) -> torch.Tensor:
    """[256, P] table: the P slopes a packed byte stands for, so unpacking is one gather."""
    all_bytes = torch.arange(256, dtype=torch.uint8)
    codes = unpack_codes(all_bytes, 256 * (8 // slot_bits(const.bits)), const.bits).long()
    slopes = torch.tensor(const.slopes + (0.0,) * (16 - len(const.slopes)), dtype=torch.float64)
    return slopes[codes].view(256, -1).to(dtype)


def _threshold_below(c: float, dtype: torch.dtype) -> float:
    """Largest value of ``dtype`` ≤ c: for x in ``dtype``, x > c ⟺ x > that value (no value lies between),
    so the code compare runs in the input's own dtype with exactly the fp32 result."""
    t = torch.tensor(c, dtype=torch.float64).to(dtype)
    if float(t) > c:
        t = torch.nextafter(t, torch.tensor(-math.inf, dtype=dtype))
    return float(t)


# Precomputed once at import, so tracing (torch.compile) meets no cache mutation and no tensor-to-float
# conversion (either would break the graph).
_SLOPE_TABLES = {(key, dtype): _byte_slope_table(const, dtype)
                 for key, const in _CONSTANTS.items() for dtype in (torch.float32, torch.float64)}
_THRESHOLDS = {
    (key, dtype): tuple(_threshold_below(c, dtype) for c in const.c_f32)
    for key, const in _CONSTANTS.items()
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
}


# ---------------------------------------------------------------------------------------------------------
# PyTorch path (every non-CUDA device; the reference for the Triton kernels)
# ---------------------------------------------------------------------------------------------------------
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _act_torch(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "gelu":
        # Written out rather than F.gelu: ATen's vectorised CPU fp32 gelu returns nan at +inf.
        return x * 0.5 * (1.0 + torch.erf(x * _SQRT1_2))
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if kind == "silu":
        return F.silu(x)
    return x * torch.sigmoid(1.702 * x)


def _act_native(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The activation in x's own dtype via ATen's fused kernels (fp32 inside), one rounding, like the
    Triton path; quick_gelu has no fused kernel and is computed in fp32."""
    native = cpu_native.act(x, kind)  # the native CPU kernel's values, as its forward with codes gives
    if native is not None:
        return native
    if kind == "gelu":
        # ATen's vectorised CPU gelu returns nan at +inf; the true limit (and the Triton kernel) give +inf.
        return F.gelu(x).masked_fill_(torch.isposinf(x), math.inf)
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if kind == "silu":
        return F.silu(x)
    return _act_torch(x.to(torch.float32), kind).to(x.dtype)


def _fwd_torch(x: torch.Tensor, kind: str, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(activation in x's dtype, packed codes) on any device."""
    const = _CONSTANTS[(kind, bits)]
    native = cpu_native.act_fwd(x, kind, bits, const.c_f32)  # one-pass CPU kernel; None where it does not apply
    if native is not None:
        return native
    if x.dtype == torch.float64:
        y = _act_torch(x, kind)
        thresholds = const.c
    else:  # no fp32 copy of x: compare against thresholds moved onto x's own grid
        y = _act_native(x, kind)
        thresholds = _THRESHOLDS[((kind, bits), x.dtype)]
    flat = x.reshape(-1)
    codes = (flat > thresholds[0]).to(torch.uint8)
    for c in thresholds[1:]:
        codes += flat > c
    return y, pack_codes(codes, bits)


def _bwd_torch(grad: torch.Tensor, packed: torch.Tensor, bits: int, kind: str) -> torch.Tensor:
    """grad_out * slope[code], in grad's dtype and shape (products in fp32, fp64 for fp64)."""
    native = cpu_native.act_bwd(grad, packed, bits, _SLOPE_TABLES[((kind, bits), torch.float32)])
    if native is not None:
        return native
    compute = _compute_dtype(grad.dtype)
    n = grad.numel()
    table = _SLOPE_TABLES[((kind, bits), compute)].to(grad.device)
    slope = table.index_select(0, packed.to(torch.int32)).view(-1)[:n].view(grad.shape)
    return (grad * slope).to(grad.dtype)


# ---------------------------------------------------------------------------------------------------------
# Triton path
# ---------------------------------------------------------------------------------------------------------
_DEVICE_TABLES: dict = {}


def _device_tables(kind: str, bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 thresholds and slopes on ``device`` (cached: one small upload per kind/bits/device)."""
    key = (kind, bits, device)
    hit = _DEVICE_TABLES.get(key)
    if hit is None:
        const = _CONSTANTS[(kind, bits)]
        hit = (torch.tensor(const.c, dtype=torch.float32, device=device),
               torch.tensor(const.slopes, dtype=torch.float32, device=device))
        _DEVICE_TABLES[key] = hit
    return hit


def _as_rows(t: torch.Tensor) -> tuple[torch.Tensor, bool, int, int, int]:
    """(tensor, contiguous, row stride, col stride, cols): a 2-D strided view when one exists, so a slice
    such as ``gate_up[..., :d]`` is read in place; otherwise a contiguous copy."""
    if t.is_contiguous():
        return t, True, 0, 1, 1
    cols = t.shape[-1]
    try:
        t2 = t.view(-1, cols)
    except RuntimeError:
        return t.contiguous(), True, 0, 1, 1
    return t2, False, t2.stride(0), t2.stride(1), cols


def _check_triton(t: torch.Tensor, what: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"approx_act: Triton is not available ({what})")
    if t.dtype not in TRITON_DTYPES:
        raise TypeError(f"approx_act: the Triton path supports float32, float16, bfloat16; got {t.dtype} ({what})")


if HAS_TRITON:

    @triton.jit
    def _act_f32(x, KIND: tl.constexpr):
        if KIND == 0:  # gelu (erf)
            y = x * 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
        elif KIND == 1:  # gelu (tanh): 0.5 x (1 + tanh(u)) == x * sigmoid(2u); saturates cleanly at +-inf
            u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            y = x / (1.0 + tl.exp(-2.0 * u))
        elif KIND == 2:  # silu, as ATen: x / (1 + exp(-x))
            y = x / (1.0 + tl.exp(-x))
        else:  # quick_gelu: x * sigmoid(1.702 x)
            y = x / (1.0 + tl.exp(-1.702 * x))
        return y

    @triton.jit
    def _source_offsets(idx, n_cols, stride_row, stride_col, CONTIGUOUS: tl.constexpr):
        """Memory offsets of logical row-major element indices in a (rows, n_cols) strided view."""
        if CONTIGUOUS:
            src = idx
        else:
            row = idx // n_cols
            src = row * stride_row + (idx - row * n_cols) * stride_col
        return src

    @triton.jit
    def _approx_act_fwd_kernel(x_ptr, y_ptr, packed_ptr, thr_ptr, n_elements, n_bytes, n_cols, stride_row,
                               stride_col, KIND: tl.constexpr, N_THR: tl.constexpr, SLOT: tl.constexpr,
                               PER_BYTE: tl.constexpr, BLOCK: tl.constexpr, CONTIGUOUS: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        byte = pid * BLOCK + tl.arange(0, BLOCK)
        lane = tl.arange(0, PER_BYTE)
        idx = byte[:, None] * PER_BYTE + lane[None, :]  # [BLOCK, PER_BYTE] logical element index
        mask = idx < n_elements
        src = _source_offsets(idx, n_cols, stride_row, stride_col, CONTIGUOUS)
        x = tl.load(x_ptr + src, mask=mask, other=0.0).to(tl.float32)
        y = _act_f32(x, KIND)
        tl.store(y_ptr + idx, y.to(y_ptr.dtype.element_ty), mask=mask)
        code = tl.zeros([BLOCK, PER_BYTE], dtype=tl.int32)
        for j in tl.static_range(N_THR):
            code += (x > tl.load(thr_ptr + j)).to(tl.int32)
        code = tl.where(mask, code, 0)
        packed = tl.sum(code << (lane[None, :] * SLOT), axis=1)  # slots do not overlap: sum == bitwise or
        tl.store(packed_ptr + byte, packed.to(tl.uint8), mask=byte < n_bytes)

    @triton.jit
    def _approx_act_bwd_kernel(g_ptr, packed_ptr, slope_ptr, dx_ptr, n_elements, n_bytes, n_cols, stride_row,
                               stride_col, SLOT: tl.constexpr, PER_BYTE: tl.constexpr, BLOCK: tl.constexpr,
                               CONTIGUOUS: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        byte = pid * BLOCK + tl.arange(0, BLOCK)
        lane = tl.arange(0, PER_BYTE)
        packed = tl.load(packed_ptr + byte, mask=byte < n_bytes, other=0).to(tl.int32)
        code = (packed[:, None] >> (lane[None, :] * SLOT)) & ((1 << SLOT) - 1)
        idx = byte[:, None] * PER_BYTE + lane[None, :]
        mask = idx < n_elements
        src = _source_offsets(idx, n_cols, stride_row, stride_col, CONTIGUOUS)
        g = tl.load(g_ptr + src, mask=mask, other=0.0).to(tl.float32)
        slope = tl.load(slope_ptr + code, mask=mask, other=0.0)
        tl.store(dx_ptr + idx, (g * slope).to(dx_ptr.dtype.element_ty), mask=mask)


def _fwd_triton(x: torch.Tensor, kind: str, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward launcher: (activation in x's dtype, contiguous, x's shape; packed codes)."""
    _check_triton(x, "forward")
    n = x.numel()
    nbytes = packed_nbytes(n, bits)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    if n == 0:
        return y, packed
    thr, _ = _device_tables(kind, bits, x.device)
    src, contiguous, rs, cs, cols = _as_rows(x)
    s = slot_bits(bits)
    per_byte = 8 // s
    block = _ELEMS_PER_PROGRAM // per_byte
    grid = (triton.cdiv(nbytes, block),)
    _approx_act_fwd_kernel[grid](src, y, packed, thr, n, nbytes, cols, rs, cs, KIND=_KIND_ID[kind],
                                 N_THR=2**bits - 1, SLOT=s, PER_BYTE=per_byte, BLOCK=block, CONTIGUOUS=contiguous)
    return y, packed


def _bwd_triton(grad: torch.Tensor, packed: torch.Tensor, bits: int, kind: str) -> torch.Tensor:
    """Triton backward launcher: grad_out * slope[code], contiguous, in grad's dtype and shape."""
    _check_triton(grad, "backward")
    n = grad.numel()
    dx = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
    if n == 0:
        return dx
    nbytes = packed_nbytes(n, bits)
    if packed.numel() != nbytes:
        raise ValueError(f"approx_act: {packed.numel()} code bytes for {n} elements at {bits} bits")
    _, slopes = _device_tables(kind, bits, grad.device)
    src, contiguous, rs, cs, cols = _as_rows(grad)
    s = slot_bits(bits)
    per_byte = 8 // s
    block = _ELEMS_PER_PROGRAM // per_byte
    grid = (triton.cdiv(nbytes, block),)
    _approx_act_bwd_kernel[grid](src, packed, slopes, dx, n, nbytes, cols, rs, cs, SLOT=s, PER_BYTE=per_byte,
                                 BLOCK=block, CONTIGUOUS=contiguous)
    return dx


if HAS_TRITON:
    # Opaque ops for torch.compile: dynamo records one node per launch (shapes from the fake impls) instead
    # of tracing into the launcher. Eager calls go to the launchers directly.
    @torch.library.custom_op("lmbp_convert::approx_act_fwd", mutates_args=())
    def _approx_act_fwd_op(x: torch.Tensor, kind: str, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _fwd_triton(x, kind, bits)

    @_approx_act_fwd_op.register_fake
    def _(x, kind, bits):
        return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
                x.new_empty((packed_nbytes(x.numel(), bits),), dtype=torch.uint8))

    @torch.library.custom_op("lmbp_convert::approx_act_bwd", mutates_args=())
    def _approx_act_bwd_op(grad: torch.Tensor, packed: torch.Tensor, bits: int, kind: str) -> torch.Tensor:
        return _bwd_triton(grad, packed, bits, kind)

    @_approx_act_bwd_op.register_fake
    def _(grad, packed, bits, kind):
        return torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)


# ---------------------------------------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------------------------------------
def _fwd(x: torch.Tensor, kind: str, bits: int, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "triton":
        if torch.compiler.is_compiling():
            return torch.ops.lmbp_convert.approx_act_fwd(x, kind, bits)
        return _fwd_triton(x, kind, bits)
    return _fwd_torch(x, kind, bits)


class ApproxActFunction(torch.autograd.Function):
    """Exact activation forward; saves only the packed codes; backward = grad * slope[code]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, kind: str, bits: int, backend: str) -> torch.Tensor:
        y, packed = _fwd(x, kind, bits, backend)
        ctx.save_for_backward(packed)
        ctx.kind, ctx.bits, ctx.backend = kind, bits, backend
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (packed,) = ctx.saved_tensors
        # The Triton result is not differentiable: double backward (create_graph) takes the PyTorch path.
        if (ctx.backend == "triton" and grad.dtype in TRITON_DTYPES
                and not (torch.is_grad_enabled() and grad.requires_grad)):
            if torch.compiler.is_compiling():
                dx = torch.ops.lmbp_convert.approx_act_bwd(grad, packed, ctx.bits, ctx.kind)
            else:
                dx = _bwd_triton(grad, packed, ctx.bits, ctx.kind)
        else:
            dx = _bwd_torch(grad, packed, ctx.bits, ctx.kind)
        return dx, None, None, None


def _resolve_backend(x: torch.Tensor, backend: Optional[str]) -> str:
    if backend is None or backend == "auto":
        return "triton" if use_triton(x) else "torch"
    if backend == "torch":
        return backend
    if backend == "triton":
        _check_triton(x, "backend='triton'")
        return backend
    raise ValueError(f"approx_act: backend must be None, 'auto', 'torch' or 'triton', got {backend!r}")


def approx_act(x: torch.Tensor, kind: str = "gelu", bits: int = 2, *, backend: Optional[str] = None) -> torch.Tensor:
    """Exact ``kind`` activation of ``x`` whose backward keeps only a ``bits``-bit code per element.

    kind: "gelu" (erf), "gelu_tanh", "silu", "quick_gelu" (x * sigmoid(1.702 x)); bits: 1..4.
    Output: x's dtype and shape (computed in fp32), so a following autocast Linear saves it without a copy.
    backend: None/"auto" (Triton for CUDA tensors, PyTorch otherwise), "torch" or "triton" (e.g. to run the
    kernels under TRITON_INTERPRET=1 on CPU tensors).
    """
    _validate(kind, bits)
    check_dtype(x, "approx_act")
    backend = _resolve_backend(x, backend)
    if not (torch.is_grad_enabled() and x.requires_grad):  # nothing to save: skip codes and autograd
        if backend == "triton":
            return _fwd(x, kind, bits, backend)[0]
        return _act_torch(x, kind) if x.dtype == torch.float64 else _act_native(x, kind)
    return ApproxActFunction.apply(x, kind, bits, backend)
