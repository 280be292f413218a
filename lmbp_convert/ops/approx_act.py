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

Dispatch (in the order of `backends.dispatch.TABLE`): Triton kernels for CUDA tensors, the PyTorch path
everywhere else (same codes, same layout, so either backward can consume either forward's codes). The kernels take the thresholds and slopes as constexpr
tuples (no device tables). Eager calls run in C++ where the host path is on (`cuda_host`, LMBP_CUDA_HOST=1: forward, autograd node
and backward, kernels launched with cuLaunchKernelEx), else through `LeanKernel` (cached compiled kernels); under
``torch.compile`` the Triton path is the ``triton_op`` ``lmbp_convert::approx_act_fwd`` with its autograd, so
inductor emits the launches itself; the PyTorch path traces in forms inductor's CPU code vectorises (codes
counted in fp32, `approx_codes._counted_codes`; the backward's codes spread by shifts and its slopes picked by
selects, `approx_codes._bwd_traced`), bitwise the eager codes and gradients.

Files: the constants, the packing and the PyTorch path are `approx_codes` (re-exported here); this file holds the
Triton kernels, their launchers, the autograd Functions and the dispatch.
"""
from __future__ import annotations

import functools
import struct
from typing import NamedTuple, Optional

import torch

from . import func_transforms
from ._common import HAS_TRITON, TRITON_DTYPES, check_dtype, use_triton
from ._launch import LeanKernel
from .backends import cuda_host
from .backends.dispatch import Backend, route
from .backends.compiled import kernel_op
from .activations import ACTIVATIONS
# The constants, the code layout and the PyTorch path (re-exported: this module is the op's one import).
from .approx_codes import (_CONSTANTS, _DEVICE_SLOPE_TABLES, _DTYPE_SET, _SLOPE_TABLES,  # noqa: F401
                           _TRITON_DTYPE_SET, ACT_BITS, ACT_KINDS, ApproxConstants, _act_native,
                           _bwd_torch, _fwd_torch, _slope_table_on, _validate, get_constants, pack_codes,
                           packed_nbytes, slot_bits, unpack_codes)

if HAS_TRITON:
    from .activations import act_f32

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


# ---------------------------------------------------------------------------------------------------------
# Triton path
# ---------------------------------------------------------------------------------------------------------
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


#: Launch shape per direction: (elements per program, num_warps). One kernel each way: the forward packs with
#: tl.sum over a [BLOCK, P] tile, the backward unpacks the P lanes of a byte in registers and interleaves them
#: with tl.join. Alternatives measured and deleted (H200, torch 2.11, Triton 3.6, bf16 / fp32 at 16M / 64M
#: elements): forward flat tile packed with reshape + tl.split, and one strided vector per lane, both 3-5 %
#: slower than the tl.sum tile in all four cells; backward [BLOCK, P] tile with broadcast shifts, and a flat tile
#: loading each element's own code byte, within 3 % of tl.join (scripts/gpu_check.py's variant table, commit
#: 96c0fff; the variants and that table were deleted afterwards).
FWD_LAUNCH = (2048, 4)
BWD_LAUNCH = (4096, 8)

if HAS_TRITON:

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
    def _codes(x, THR: tl.constexpr):
        """Number of thresholds x exceeds (int32)."""
        code = (x > THR[0]).to(tl.int32)
        for j in tl.static_range(1, len(THR)):
            code += (x > THR[j]).to(tl.int32)
        return code

    @triton.jit
    def _slopes(code, SLOPES: tl.constexpr):
        """slope[code] from a constexpr table (selects, no memory)."""
        s = tl.where(code == 1, SLOPES[1], SLOPES[0])
        for j in tl.static_range(2, len(SLOPES)):
            s = tl.where(code == j, SLOPES[j], s)
        return s

    @triton.jit
    def _unpack_pairs(packed, BLOCK: tl.constexpr, PER_BYTE: tl.constexpr, SLOT: tl.constexpr):
        """[BLOCK] bytes -> [BLOCK * PER_BYTE] codes in element order (lane j at bit j*SLOT), in registers."""
        mask = (1 << SLOT) - 1
        if PER_BYTE == 2:
            out = tl.reshape(tl.join(packed & mask, (packed >> SLOT) & mask), [BLOCK * 2])
        elif PER_BYTE == 4:
            lo = tl.join(packed & mask, (packed >> (2 * SLOT)) & mask)  # lanes 0, 2
            hi = tl.join((packed >> SLOT) & mask, (packed >> (3 * SLOT)) & mask)  # lanes 1, 3
            out = tl.reshape(tl.join(lo, hi), [BLOCK * 4])
        else:
            tl.static_assert(PER_BYTE == 8)
            l0 = tl.join(tl.join(packed & mask, (packed >> (4 * SLOT)) & mask),
                         tl.join((packed >> (2 * SLOT)) & mask, (packed >> (6 * SLOT)) & mask))
            l1 = tl.join(tl.join((packed >> SLOT) & mask, (packed >> (5 * SLOT)) & mask),
                         tl.join((packed >> (3 * SLOT)) & mask, (packed >> (7 * SLOT)) & mask))
            out = tl.reshape(tl.join(l0, l1), [BLOCK * 8])
        return out

    @triton.jit
    def _approx_act_fwd_kernel(x_ptr, y_ptr, packed_ptr, n_elements, n_bytes, n_cols, stride_row, stride_col,
                               ACT: tl.constexpr, THR: tl.constexpr, SLOT: tl.constexpr, PER_BYTE: tl.constexpr,
                               BLOCK: tl.constexpr, CONTIGUOUS: tl.constexpr):
        """act(x) and its step codes over a [BLOCK, PER_BYTE] tile; tl.sum across the lanes packs the bytes."""
        pid = tl.program_id(0).to(tl.int64)
        byte = pid * BLOCK + tl.arange(0, BLOCK)
        lane = tl.arange(0, PER_BYTE)
        idx = byte[:, None] * PER_BYTE + lane[None, :]
        mask = idx < n_elements
        x = tl.load(x_ptr + _source_offsets(idx, n_cols, stride_row, stride_col, CONTIGUOUS), mask=mask,
                    other=0.0).to(tl.float32)
        tl.store(y_ptr + idx, act_f32(x, ACT).to(y_ptr.dtype.element_ty), mask=mask)
        code = tl.where(mask, _codes(x, THR), 0)
        packed = tl.sum(code << (lane[None, :] * SLOT), axis=1)  # slots do not overlap: sum == or
        tl.store(packed_ptr + byte, packed.to(tl.uint8), mask=byte < n_bytes)

    @triton.jit
    def _approx_act_bwd_kernel(g_ptr, packed_ptr, dx_ptr, n_elements, n_bytes, n_cols, stride_row, stride_col,
                               SLOPES: tl.constexpr, SLOT: tl.constexpr, PER_BYTE: tl.constexpr,
                               BLOCK: tl.constexpr, CONTIGUOUS: tl.constexpr):
        """grad * slope[code]: one load per code byte, its lanes unpacked and interleaved in registers."""
        pid = tl.program_id(0).to(tl.int64)
        byte = pid * BLOCK + tl.arange(0, BLOCK)
        packed = tl.load(packed_ptr + byte, mask=byte < n_bytes, other=0).to(tl.int32)
        code = _unpack_pairs(packed, BLOCK, PER_BYTE, SLOT)
        idx = pid * (BLOCK * PER_BYTE) + tl.arange(0, BLOCK * PER_BYTE)
        mask = idx < n_elements
        g = tl.load(g_ptr + _source_offsets(idx, n_cols, stride_row, stride_col, CONTIGUOUS), mask=mask,
                    other=0.0).to(tl.float32)
        tl.store(dx_ptr + idx, (g * _slopes(code, SLOPES)).to(dx_ptr.dtype.element_ty), mask=mask)

    _FWD = LeanKernel(_approx_act_fwd_kernel)
    _BWD = LeanKernel(_approx_act_bwd_kernel)


_CONTIGUOUS = torch.contiguous_format
_U8 = torch.uint8


class _KernelConsts(NamedTuple):
    act: int
    thresholds: tuple[float, ...]  # fp32 thresholds
    slopes: tuple[float, ...]  # fp32-rounded slopes
    slot: int
    per_byte: int


#: Everything a launch needs per (kind, bits), computed once.
_KCONSTS = {key: _KernelConsts(ACTIVATIONS[key[0]].code, c.c_f32,
                               tuple(struct.unpack("f", struct.pack("f", v))[0] for v in c.slopes),
                               slot_bits(key[1]), 8 // slot_bits(key[1]))
            for key, c in _CONSTANTS.items()}


class _Plan:
    """Launch constants of one (kind, bits, direction), made once: hashed by identity in the launch key.
    ``consts[contiguous]``: the kernel's trailing constexprs for a contiguous / strided input."""

    __slots__ = ("per_byte", "block", "warps", "consts")

    def __init__(self, kind: str, bits: int, fwd: bool) -> None:
        k = _KCONSTS[(kind, bits)]
        elems, self.warps = FWD_LAUNCH if fwd else BWD_LAUNCH
        self.per_byte, self.block = k.per_byte, elems // k.per_byte
        head = ((k.act, k.thresholds) if fwd else (k.slopes,)) + (k.slot, k.per_byte, self.block)
        self.consts = (head + (False,), head + (True,))


_PLANS: dict = {}


def _plan(kind: str, bits: int, fwd: bool) -> _Plan:
    p = _PLANS.get((kind, bits, fwd))
    if p is None:
        p = _PLANS[(kind, bits, fwd)] = _Plan(kind, bits, fwd)
    return p


def _fwd_triton(x: torch.Tensor, kind: str, bits: int,
                traced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward launcher: (activation in x's dtype, contiguous, x's shape; packed codes).

    ``traced``: launch through ``wrap_triton`` (inside the ``triton_op``, so inductor emits the launch itself).
    """
    p = _PLANS.get((kind, bits, True)) or _plan(kind, bits, True)
    n = x.numel()
    nbytes = -(-n // p.per_byte)
    y = torch.empty_like(x, memory_format=_CONTIGUOUS)  # empty_like: a third of torch.empty's host time
    packed = torch.empty(nbytes, dtype=_U8, device=x.device)
    if n == 0:
        return y, packed
    if x.is_contiguous():  # the common case: no view analysis
        args, contiguous = (x, y, packed, n, nbytes, 1, 0, 1), True
    else:
        src, contiguous, rs, cs, cols = _as_rows(x)
        args = (src, y, packed, n, nbytes, cols, rs, cs)
    grid = (-(-nbytes // p.block), 1, 1)
    if traced:
        _FWD.launch_traced(grid, x.device.index, args, p.consts[contiguous], p.warps)
        return y, packed
    # y and packed are fresh (aligned); their dtypes follow from x's and the kernel
    dev = x.get_device()
    _FWD.launch((p, contiguous, x.dtype, args[0].data_ptr() & 15, n, args[5], args[6], args[7], dev), grid, args,
                dev, p.consts[contiguous], p.warps)
    return y, packed


def _bwd_triton(grad: torch.Tensor, packed: torch.Tensor, bits: int, kind: str,
                traced: bool = False) -> torch.Tensor:
    """Triton backward launcher: grad_out * slope[code], contiguous, in grad's dtype and shape."""
    p = _PLANS.get((kind, bits, False)) or _plan(kind, bits, False)
    n = grad.numel()
    dx = torch.empty_like(grad, memory_format=_CONTIGUOUS)
    if n == 0:
        return dx
    nbytes = -(-n // p.per_byte)
    if packed.numel() != nbytes:
        raise ValueError(f"approx_act: {packed.numel()} code bytes for {n} elements at {bits} bits")
    if grad.is_contiguous():
        args, contiguous = (grad, packed, dx, n, nbytes, 1, 0, 1), True
    else:
        src, contiguous, rs, cs, cols = _as_rows(grad)
        args = (src, packed, dx, n, nbytes, cols, rs, cs)
    grid = (-(-nbytes // p.block), 1, 1)
    if traced:
        _BWD.launch_traced(grid, grad.device.index, args, p.consts[contiguous], p.warps)
        return dx
    dev = grad.get_device()
    _BWD.launch((p, contiguous, grad.dtype, args[0].data_ptr() & 15, packed.data_ptr() & 15, n, args[5], args[6],
                 args[7], dev), grid, args, dev, p.consts[contiguous], p.warps)
    return dx


if HAS_TRITON:
    # Under torch.compile the Triton path is one triton_op with its autograd: inductor sees the kernels
    # (wrap_triton) and emits their launches itself; no Python launcher runs per call.
    def _fwd_fake(x, kind, bits):
        return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
                x.new_empty((packed_nbytes(x.numel(), bits),), dtype=torch.uint8))

    def _bwd_fake(grad, packed, bits, kind):
        return torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)

    @kernel_op("lmbp_convert::approx_act_fwd", _fwd_fake)
    def _approx_act_fwd_op(x: torch.Tensor, kind: str, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _fwd_triton(x, kind, bits, traced=True)

    @kernel_op("lmbp_convert::approx_act_bwd", _bwd_fake)
    def _approx_act_bwd_op(grad: torch.Tensor, packed: torch.Tensor, bits: int, kind: str) -> torch.Tensor:
        return _bwd_triton(grad, packed, bits, kind, traced=True)

    def _fwd_op_setup_context(ctx, inputs, output):
        _, kind, bits = inputs
        ctx.save_for_backward(output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.kind, ctx.bits = kind, bits

    def _fwd_op_backward(ctx, grad, _grad_packed):
        (packed,) = ctx.saved_tensors
        return torch.ops.lmbp_convert.approx_act_bwd(grad, packed, ctx.bits, ctx.kind), None, None

    _approx_act_fwd_op.register_autograd(_fwd_op_backward, setup_context=_fwd_op_setup_context)


# ---------------------------------------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------------------------------------
class ApproxActFunction(torch.autograd.Function):
    """Exact activation forward; saves only the packed codes; backward = grad * slope[code]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, kind: str, bits: int, backend: str) -> torch.Tensor:
        y, packed = _fwd_triton(x, kind, bits) if backend == "triton" else _fwd_torch(x, kind, bits)
        ctx.save_for_backward(packed)
        ctx.spec = (kind, bits, backend == "triton")
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (packed,) = ctx.saved_tensors
        kind, bits, triton_path = ctx.spec
        return _backward(grad, packed, kind, bits, triton_path), None, None, None


class _TritonApproxAct(torch.autograd.Function):
    """`ApproxActFunction` on the Triton path with nothing else per call: the eager hot path (a converted model
    calls it once per activation)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, kind: str, bits: int) -> torch.Tensor:
        y, packed = _fwd_triton(x, kind, bits)
        ctx.save_for_backward(packed)
        ctx.spec = (kind, bits)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (packed,) = ctx.saved_tensors
        kind, bits = ctx.spec
        return _backward(grad, packed, kind, bits, True), None, None


#: (kind, bits) -> the C++ host path's entry point bound to its plan (``f(x) -> y``), or False (Python path).
_HOST = cuda_host.state_cache()


def _host_entry(kind: str, bits: int):
    """Register (kind, bits) with the C++ host path: the kernel slots of both directions, their launch constants
    and the backward the PyTorch path takes when C++ must not (double backward, non-Triton grad dtypes)."""
    ext = cuda_host.ext() if HAS_TRITON else None
    fn = False
    if ext is not None:
        pf, pb = _plan(kind, bits, True), _plan(kind, bits, False)
        plan = ext.register_act_plan(
            cuda_host.slot(_FWD, pf.consts[False], pf.warps), cuda_host.slot(_FWD, pf.consts[True], pf.warps),
            cuda_host.slot(_BWD, pb.consts[False], pb.warps), cuda_host.slot(_BWD, pb.consts[True], pb.warps),
            pf.per_byte, pf.block, pb.block,
            lambda grad, packed: _backward(grad, packed, kind, bits, True))
        fn = functools.partial(ext.approx_act, plan)
    _HOST[(kind, bits)] = fn
    return fn


def _backward(grad: torch.Tensor, packed: torch.Tensor, kind: str, bits: int, triton_path: bool) -> torch.Tensor:
    # The Triton result is not differentiable: double backward (create_graph) takes the PyTorch path.
    if triton_path and grad.dtype in _TRITON_DTYPE_SET and not (grad.requires_grad and torch.is_grad_enabled()):
        return _bwd_triton(grad, packed, bits, kind)
    return _bwd_torch(grad, packed, bits, kind)


def _resolve_backend(x: torch.Tensor, backend: Optional[str]) -> str:
    if backend is None or backend == "auto":
        return "triton" if use_triton(x) else "torch"
    if backend == "torch":
        return backend
    if backend == "triton":
        _check_triton(x, "backend='triton'")
        return backend
    raise ValueError(f"approx_act: backend must be None, 'auto', 'torch' or 'triton', got {backend!r}")


def approx_act_unchecked(x: torch.Tensor, kind: str, bits: int, backend: Optional[str] = None) -> torch.Tensor:
    """`approx_act` for callers that validated ``kind`` and ``bits`` once (modules, at construction)."""
    if func_transforms.active():  # torch.func: functorch tensors, a setup_context Function
        return func_transforms.approx_act(x, kind, bits)
    # the hot path first: a CUDA tensor of a Triton dtype, eager, training
    on = route("approx_act", x, use_triton(x)) if backend is None else None
    if on is Backend.COMPILED:
        return torch.ops.lmbp_convert.approx_act_fwd(x, kind, bits)[0]
    if on is Backend.CUDA_HOST:  # forward, graph node and backward in C++
        host = _HOST.get((kind, bits))
        if host is None:
            host = _host_entry(kind, bits)
        y = host(x) if host else NotImplemented
        if y is not NotImplemented:
            return y
        on = Backend.TRITON  # a call C++ declines
    if on is Backend.TRITON:
        if x.requires_grad and torch.is_grad_enabled():
            return _TritonApproxAct.apply(x, kind, bits)
        return _fwd_triton(x, kind, bits)[0]  # nothing to save: no codes kept, no autograd
    if x.dtype not in _DTYPE_SET:
        check_dtype(x, "approx_act")
    backend = "torch" if backend is None else _resolve_backend(x, backend)
    if backend == "triton" and torch.compiler.is_compiling():
        return torch.ops.lmbp_convert.approx_act_fwd(x, kind, bits)[0]
    if not (x.requires_grad and torch.is_grad_enabled()):  # nothing to save: skip codes and autograd
        return _fwd_triton(x, kind, bits)[0] if backend == "triton" else _act_native(x, kind)
    return ApproxActFunction.apply(x, kind, bits, backend)


def approx_act(x: torch.Tensor, kind: str = "gelu", bits: int = 2, *, backend: Optional[str] = None) -> torch.Tensor:
    """Exact ``kind`` activation of ``x`` whose backward keeps only a ``bits``-bit code per element.

    kind: "gelu" (erf), "gelu_tanh", "silu", "quick_gelu" (x * sigmoid(1.702 x)); bits: 1..4.
    Output: x's dtype and shape (computed in fp32), so a following autocast Linear saves it without a copy.
    backend: None/"auto" (Triton for CUDA tensors, PyTorch otherwise), "torch" or "triton" (e.g. to run the
    kernels under TRITON_INTERPRET=1 on CPU tensors).
    """
    _validate(kind, bits)
    return approx_act_unchecked(x, kind, bits, backend)
