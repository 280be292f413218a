"""Approx-BP activations, the codes: fitted constants, the packed-code layout and the PyTorch reference path.

The maths and the layout are described in `approx_act` (the op); this module is what both execution paths share
and what the PyTorch path computes with (`_fwd_torch`, `_bwd_torch`), split from the op so that the op file holds
the kernels, their launchers and the autograd Function.
"""
from __future__ import annotations

import json
import math
import struct
import sys
from importlib import resources
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .backends import cpu_native
from ._common import SUPPORTED_DTYPES, TRITON_DTYPES
from .activations import ACT_NAMES, ACTIVATIONS

ACT_KINDS = ACT_NAMES  # every kind of the shared activation table has fitted constants
ACT_BITS = (1, 2, 3, 4)
_DTYPE_SET = frozenset(SUPPORTED_DTYPES)
_TRITON_DTYPE_SET = frozenset(TRITON_DTYPES)


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
    if kind not in ACTIVATIONS:
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
    all_bytes = torch.arange(256, dtype=torch.uint8, device="cpu")  # import-time: never the ambient device
    codes = unpack_codes(all_bytes, 256 * (8 // slot_bits(const.bits)), const.bits).long()
    slopes = torch.tensor(const.slopes + (0.0,) * (16 - len(const.slopes)), dtype=torch.float64, device="cpu")
    return slopes[codes].view(256, -1).to(dtype)


def _threshold_below(c: float, dtype: torch.dtype) -> float:
    """Largest value of ``dtype`` ≤ c: for x in ``dtype``, x > c ⟺ x > that value (no value lies between),
    so the code compare runs in the input's own dtype with exactly the fp32 result."""
    t = torch.tensor(c, dtype=torch.float64, device="cpu").to(dtype)
    if float(t) > c:
        t = torch.nextafter(t, torch.tensor(-math.inf, dtype=dtype, device="cpu"))
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


def _act_native(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The activation in x's own dtype via the table's ATen kernels (fp32 inside, fp64 for fp64), one rounding
    like the Triton path. gelu: ATen's vectorised CPU gelu returns nan at +inf; the true limit (and the Triton
    kernel) give +inf."""
    native = cpu_native.act(x, kind)  # the native CPU kernel's values, as its forward with codes gives
    if native is not None:
        return native
    y = ACTIVATIONS[kind].torch_fwd(x)
    if kind == "gelu":
        y = y.masked_fill_(torch.isposinf(x), math.inf)
    return y


#: Elements per chunk of the eager PyTorch path: the temporaries of the forward's codes and of the backward's
#: compute-dtype slopes and products cover one chunk, not the whole tensor, as the C++ and Triton paths hold none.
BWD_CHUNK = 1 << 20


def _fwd_torch(x: torch.Tensor, kind: str, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(activation in x's dtype, packed codes) on any device."""
    const = _CONSTANTS[(kind, bits)]
    native = cpu_native.act_fwd(x, kind, bits, const.c_f32)  # one-pass CPU kernel; None where it does not apply
    if native is not None:
        return native
    y = _act_native(x, kind)
    # no fp32 copy of x: compare against thresholds moved onto x's own grid
    thresholds = const.c if x.dtype == torch.float64 else _THRESHOLDS[((kind, bits), x.dtype)]
    flat = x.reshape(-1)
    n = flat.numel()
    if n <= BWD_CHUNK or torch.compiler.is_compiling():
        return y, pack_codes(_step_codes(flat, thresholds), bits)
    # in chunks of whole packed words: the code bytes and the packing's words cover one chunk, not the tensor
    per = 8 // slot_bits(bits)
    step = max(BWD_CHUNK // (8 * per), 1) * 8 * per
    packed = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=x.device)
    for s in range(0, n, step):
        e = min(s + step, n)
        packed[s // per:-(-e // per)] = pack_codes(_step_codes(flat[s:e], thresholds), bits)
    return y, packed


def _step_codes(flat: torch.Tensor, thresholds) -> torch.Tensor:
    """The step index of each element (uint8): how many thresholds it exceeds."""
    if torch.compiler.is_compiling():
        return _counted_codes(flat, thresholds)
    codes = (flat > thresholds[0]).to(torch.uint8)
    for c in thresholds[1:]:
        codes += flat > c
    return codes


def _counted_codes(flat: torch.Tensor, thresholds) -> torch.Tensor:
    """`_step_codes` as torch.compile traces it: counted in fp32 (exact small integers, the same codes).
    Inductor's CPU code vectorises fp32 compares and adds; the uint8 sums of compare masks it writes as
    mask-to-byte conversions that cost ~15x the activation itself."""
    count = (flat > thresholds[0]).to(torch.float32)
    for c in thresholds[1:]:
        count = count + (flat > c).to(torch.float32)
    return count.to(torch.uint8)


#: Per-device [256, P] slope tables for the PyTorch backward off the CPU (double backward, fp64,
#: backend="torch" on CUDA): built on the device from Python scalars (no host->device copy) and kept.
_DEVICE_SLOPE_TABLES: dict = {}


def _slope_table_on(const: ApproxConstants, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`_byte_slope_table` computed on ``device`` with scalar arithmetic (no upload, capture-safe)."""
    s = slot_bits(const.bits)
    byte = torch.arange(256, dtype=torch.int32, device=device)
    shifts = torch.arange(0, 8, s, dtype=torch.int32, device=device)
    codes = (byte[:, None] >> shifts[None, :]) & ((1 << s) - 1)
    table = torch.zeros(codes.shape, dtype=dtype, device=device)
    for j in range(1, len(const.slopes)):  # the exact (fsum) slope of each code, rounded once: equal to the CPU table
        table = torch.where(codes == j, const.slopes[j], table)
    return table


def _slope_table(key: tuple[str, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return _SLOPE_TABLES[(key, dtype)]
    hit = _DEVICE_SLOPE_TABLES.get((key, dtype, device))
    if hit is None:
        hit = _slope_table_on(_CONSTANTS[key], dtype, device)
        if not _capturing(device):  # a table made inside a CUDA-graph capture lives in the graph's pool
            _DEVICE_SLOPE_TABLES[(key, dtype, device)] = hit
    return hit


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _bwd_torch(grad: torch.Tensor, packed: torch.Tensor, bits: int, kind: str) -> torch.Tensor:
    """grad_out * slope[code], in grad's dtype and shape (products in fp32, fp64 for fp64)."""
    if torch.compiler.is_compiling():
        return _bwd_traced(grad, packed, bits, kind)
    native = cpu_native.act_bwd(grad, packed, bits, _SLOPE_TABLES[((kind, bits), torch.float32)])
    if native is not None:
        return native
    compute = _compute_dtype(grad.dtype)
    n = grad.numel()
    table = _slope_table((kind, bits), compute, grad.device)
    if n <= BWD_CHUNK or (grad.requires_grad and torch.is_grad_enabled()):
        slope = table.index_select(0, packed.to(torch.int32)).view(-1)[:n].view(grad.shape)
        return (grad * slope).to(grad.dtype)
    per = table.shape[1]  # codes per packed byte
    step = max(BWD_CHUNK // per, 1) * per
    flat = grad.reshape(-1)
    out = torch.empty(n, dtype=grad.dtype, device=grad.device)
    for s in range(0, n, step):  # the same products, rounded once to grad's dtype as above
        e = min(s + step, n)
        slope = table.index_select(0, packed[s // per:-(-e // per)].to(torch.int32)).view(-1)[:e - s]
        out[s:e] = slope.mul_(flat[s:e])
    return out.view(grad.shape)


#: (kind, bits), compute dtype -> the slope of each code as Python numbers exactly of that dtype (the slope
#: tables' values; slope[0] = 0): constants of a traced graph, no tensor-to-float conversion while tracing.
_SLOPE_VALUES = {(key, dtype): tuple(torch.tensor(const.slopes, dtype=torch.float64).to(dtype).tolist())
                 for key, const in _CONSTANTS.items() for dtype in (torch.float32, torch.float64)}


#: slot bits -> a code's mask in every byte of the word (0x03030303 for 2-bit slots)
_SPREAD_MASKS = {s: sum(((1 << s) - 1) << (8 * j) for j in range(8 // s)) for s in _WORD}


def spread_codes(packed: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """`unpack_codes` in shifts and masks only: each packed byte widened to a word of P bytes whose byte j is
    code j (the P shifted copies OR-ed land on disjoint bits), read back as bytes. Inductor compiles this into
    vectorised passes; the byte-indexed gather of `unpack_codes` and of the slope table it compiles to scalar
    code."""
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
        return unpack_codes(packed, numel, bits)
    s = slot_bits(bits)
    per_byte = 8 // s
    words = packed.to(_WORD[s])
    spread = words
    for j in range(1, per_byte):
        spread = spread | (words << (j * (8 - s)))
    return (spread & _SPREAD_MASKS[s]).view(torch.uint8)[:numel]


def _bwd_traced(grad: torch.Tensor, packed: torch.Tensor, bits: int, kind: str) -> torch.Tensor:
    """`_bwd_torch` as torch.compile traces it: the same products bitwise, in ops inductor fuses into
    vectorised passes (codes spread by shifts, slopes picked by a chain of selects, no gather)."""
    compute = _compute_dtype(grad.dtype)
    codes = spread_codes(packed, grad.numel(), bits).to(compute)
    values = _SLOPE_VALUES[((kind, bits), compute)]
    slope = torch.zeros_like(codes)  # slope[0] = 0
    for j in range(1, len(values)):
        slope = torch.where(codes == j, values[j], slope)
    return (grad.reshape(-1) * slope).to(grad.dtype).view(grad.shape)
