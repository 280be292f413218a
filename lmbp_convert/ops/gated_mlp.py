"""Memory-sharing gated MLP tail: ``out = down(act(g) * u)`` saving only g and u (MS-BP, arXiv 2406.16282).

In a LLaMA-style MLP ``down(act(gate(x)) * up(x))`` eager autograd keeps g (for act), a = act(g) and u (for
the mul) and h = a·u (for down's weight gradient): four T×f tensors besides x. An exact backward needs only
g and u; a and h are cheap elementwise recomputations. This op therefore saves the very g and u it is given
(views of one fused gate_up output stay one storage) and, for backward,

    h  = act(g) · u                  (recomputed, rounded to h's dtype exactly as in forward)
    dW = dYᵀ·h, db = Σ dY            (only when needed)
    dh = dY·W (+ LoRA terms)
    dg = dh · u · act'(g),  du = dh · act(g)

with exact act' for ``silu``, ``gelu`` (erf) and ``gelu_tanh``. The down projection is given as tensors: its
weight / optional bias, plus any number of LoRA adapters (PEFT ``lora.Linear`` semantics with dropout off):
``out = W h + b + Σ scale · B(A(h))``. The rank-r intermediates A(h) are recomputed too, so nothing beyond g
and u (and the parameters) is saved.

Dtypes follow eager PyTorch step by step: h has the promoted dtype of g and u; under torch.autocast every
Linear casts its eligible operands to the autocast dtype (as ``F.linear`` would), LoRA inputs are cast to
the adapter weight dtype first (PEFT's ``_cast_input_dtype``), LoRA terms are accumulated with type
promotion and the result is cast back to the base output dtype. Weights are saved as given (never the cast
copies) and recast in backward; gradients come back in each input's dtype.

Dispatch: the elementwise parts (forward h; backward dg, du and the h recompute fused in one kernel) run as
Triton kernels on CUDA tensors (`use_triton`; fp32 math in registers, one rounding per output), as the PyTorch
path (ATen's act and act-backward kernels in the inputs' dtype: bitwise the roundings of eager autograd, and
no fp32 copies of T×f tensors, which on CPU would cost more than the maths) (`_fwd_torch` / `_bwd_torch`, the reference
in tests) everywhere else. Activation codes and maths come from the shared table (`ops.activations`). Eager
calls of `gated_mlp` run in C++ where the host path is on (`cuda_host`, LMBP_CUDA_HOST=1: a step-for-step port of `GatedMLPFunction`),
other launches go through `LeanKernel`; under torch.compile the Triton path is the triton_ops
``lmbp_convert::gated_act_fwd`` / ``gated_act_bwd`` (inductor emits the launches) and the PyTorch path the opaque
custom ops ``lmbp_convert::gated_mlp_fwd`` / ``gated_mlp_bwd``. The matmuls are ordinary PyTorch calls.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from ..enums import GATED_ACT_KINDS
from . import cuda_host, func_transforms
from ._common import HAS_TRITON, SUPPORTED_DTYPES, check_dtype, use_triton
from ._launch import LeanKernel, kernel_op, next_pow2, rows_view
from .activations import ACTIVATIONS, act_code

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .activations import act_and_grad_f32, act_f32

_DTYPE_SET = frozenset(SUPPORTED_DTYPES)
_CONTIGUOUS = torch.contiguous_format

__all__ = ["ACT_KINDS", "LoraAdapter", "gated_mlp", "gated_act", "GatedMLPFunction", "GatedActFunction"]

#: The activation-table kinds this op offers (the table holds their codes, PyTorch and Triton maths); the list is
#: `lmbp_convert.enums.GATED_ACT_KINDS`, which the gated-MLP matcher reads too.
ACT_KINDS = GATED_ACT_KINDS
if not set(ACT_KINDS) <= set(ACTIVATIONS):  # pragma: no cover
    raise AssertionError(f"gated_mlp: {sorted(set(ACT_KINDS) - set(ACTIVATIONS))} not in the activation table")


class LoraAdapter(NamedTuple):
    """One LoRA adapter on the down projection: adds ``scale · B(A(h))`` (B's bias included when present).

    ``a_weight`` is (r, f), ``b_weight`` (n, r), ``b_bias`` (n,) or None (PEFT ``lora_bias``).
    ``cast_input``: cast h to ``a_weight.dtype`` before A, as PEFT does unless input casting is disabled.
    """

    a_weight: torch.Tensor
    b_weight: torch.Tensor
    b_bias: Optional[torch.Tensor]
    scale: float
    cast_input: bool = True


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


# ------------------------------------------------------------------------------------------------------
# dtype policy helpers: mirror what eager F.linear does with and without autocast.
# ------------------------------------------------------------------------------------------------------
def _autocast_available(device_type: str) -> bool:
    try:
        return bool(torch.amp.is_autocast_available(device_type))
    except Exception:  # pragma: no cover - unknown device type string
        return False


# Looked up once at import: some torch releases' dynamo cannot trace torch.amp.is_autocast_available (a graph
# break inside every converted MLP under torch.compile).
_AUTOCAST_DEVICE_TYPES = frozenset(d for d in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla")
                                   if _autocast_available(d))


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype active for this device type, or None when autocast is off (or unavailable)."""
    if device_type in _AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


_NULL = contextlib.nullcontext()  # reusable and reentrant


def _no_autocast(device_type: str):
    """Disable autocast inside the op: every cast is explicit, so results do not depend on ambient state. Off
    already (the common case): nothing to enter (torch.autocast's context costs a few µs of host time)."""
    if device_type in _AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return _NULL


def _lin_dtype(dtype: torch.dtype, ac: Optional[torch.dtype]) -> torch.dtype:
    """The dtype autocast casts a Linear operand of ``dtype`` to (floating, non-fp64 operands only)."""
    if ac is not None and dtype.is_floating_point and dtype != torch.float64:
        return ac
    return dtype


def _cast(t: Optional[torch.Tensor], ac: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    if t is None:
        return None
    d = _lin_dtype(t.dtype, ac)
    return t if d == t.dtype else t.to(d)


def _to(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _mm_t(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """aᵀ·b for (M, p) and (M, q): the weight-gradient product."""
    return a.t().matmul(b)


# ------------------------------------------------------------------------------------------------------
# autograd.Functions
# ------------------------------------------------------------------------------------------------------
class GatedMLPFunction(torch.autograd.Function):
    """``down(act(g)·u)`` with the down projection given as tensors; saves g and u (and the weights as given).

    Positional inputs: g, u, weight, bias, act, lora_meta, then 3 tensors (A, B, B-bias or None) per adapter;
    ``lora_meta`` is a tuple of (scale, cast_input) per adapter.
    """

    @staticmethod
    def forward(ctx, g, u, weight, bias, act, lora_meta, *lora):
        dev = "cuda" if g.is_cuda else g.device.type
        ac = _autocast_dtype(dev)
        h_dtype = g.dtype if g.dtype == u.dtype else torch.promote_types(g.dtype, u.dtype)
        triton_path = use_triton(g) and use_triton(u) and g.get_device() == u.get_device()
        with _no_autocast(dev):
            h = _elementwise_fwd(g, u, act, h_dtype, triton_path)
            out = (F.linear(h, weight, bias) if ac is None
                   else F.linear(_cast(h, ac), _cast(weight, ac), _cast(bias, ac)))
            out_dtype = out.dtype
            acc = out
            for i, (scale, cast_input) in enumerate(lora_meta):
                a_w, b_w, b_b = lora[3 * i: 3 * i + 3]
                hx = _to(h, a_w.dtype) if cast_input else h
                t = F.linear(_cast(hx, ac), _cast(a_w, ac))
                acc = acc + F.linear(_cast(t, ac), _cast(b_w, ac), _cast(b_b, ac)) * scale
            out = _to(acc, out_dtype)
            del h, acc
        # dh needs the weights only when g or u needs a gradient; h is recomputed from g, u.
        need_dh = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        ctx.save_for_backward(g, u, weight if need_dh else None, *lora)
        ctx.spec = (ac, h_dtype, act, lora_meta, triton_path, weight.dtype, bias.dtype if bias is not None else None)
        return out

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():  # create_graph=True: the result must refuse a second backward
            return _gated_mlp_backward_once(ctx, dy)
        return _gated_mlp_backward(ctx, dy)


def _gated_mlp_backward(ctx, dy):
    """`GatedMLPFunction`'s backward (see the module docstring for the maths)."""
    g, u, weight, *lora = ctx.saved_tensors
    needs = ctx.needs_input_grad
    ac, h_dtype, act, meta, triton_path, weight_dtype, bias_dtype = ctx.spec
    lora_needs = needs[6:]
    need_dh = needs[0] or needs[1]
    need_h = needs[2] or (bool(meta) and any(lora_needs[3 * i] or lora_needs[3 * i + 1] for i in range(len(meta))))
    f = g.shape[-1]
    dy2 = dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])
    dyc = dy2 if ac is None else _cast(dy2, ac)
    grads_lora: list[Optional[torch.Tensor]] = [None] * len(lora)
    dg = du = dw = db = h = None

    with _no_autocast("cuda" if g.is_cuda else g.device.type):
        # Per adapter: gy = grad of B(A(h)) (dY through the promoted sum, times scale), gt = gy·B.
        gys, gts = [], []
        for i, (scale, cast_input) in enumerate(meta):
            a_w, b_w, _ = lora[3 * i: 3 * i + 3]
            y_dtype = _lin_dtype(a_w.dtype if cast_input else h_dtype, ac)
            used = need_dh or any(lora_needs[3 * i: 3 * i + 3])
            gy = _to(dy2, y_dtype) * scale if used else None
            gt = gy.matmul(_cast(b_w, ac)) if (need_dh or lora_needs[3 * i]) else None
            gys.append(gy)
            gts.append(gt)
        if need_dh:
            # dh = dY·W + Σ (gt·A), each term cast back along the eager chain of dtypes.
            dh = _to(dyc.matmul(weight if ac is None else _cast(weight, ac)), h_dtype)
            for i, (scale, cast_input) in enumerate(meta):
                a_w = lora[3 * i]
                hx_dtype = a_w.dtype if cast_input else h_dtype
                dh = dh + _to(_to(gts[i].matmul(_cast(a_w, ac)), hx_dtype), h_dtype)
            dh = dh.view(g.shape)
            dg, du, h = _elementwise_bwd(dh, g, u, act, h_dtype if need_h else None, triton_path,
                                         dg_into_dh=True)
            del dh
            dg = dg if needs[0] else None
            du = du if needs[1] else None
        elif need_h:
            h = _elementwise_fwd(g, u, act, h_dtype, triton_path)
        if need_h:
            h2 = h.reshape(-1, f)
            if needs[2]:
                dw = _to(_mm_t(dyc, _cast(h2, ac)), weight_dtype)
            for i, (scale, cast_input) in enumerate(meta):
                a_w, b_w, _ = lora[3 * i: 3 * i + 3]
                if not (lora_needs[3 * i] or lora_needs[3 * i + 1]):
                    continue
                hxc = _cast(_to(h2, a_w.dtype) if cast_input else h2, ac)
                if lora_needs[3 * i]:
                    grads_lora[3 * i] = _to(_mm_t(gts[i], hxc), a_w.dtype)
                if lora_needs[3 * i + 1]:
                    t = F.linear(hxc, _cast(a_w, ac))  # A(h) recomputed, never saved
                    grads_lora[3 * i + 1] = _to(_mm_t(gys[i], _cast(t, ac)), b_w.dtype)
            del h, h2
        if needs[3]:
            db = _to(dyc.sum(0), bias_dtype)
        for i in range(len(meta)):
            b_b = lora[3 * i + 2]
            if lora_needs[3 * i + 2] and b_b is not None:
                grads_lora[3 * i + 2] = _to(gys[i].sum(0), b_b.dtype)
    return (dg, du, dw, db, None, None, *grads_lora)


_gated_mlp_backward_once = torch.autograd.function.once_differentiable(_gated_mlp_backward)


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

    @staticmethod
    def backward(ctx, dh):
        if torch.is_grad_enabled():  # create_graph=True: the result must refuse a second backward
            return _gated_act_backward_once(ctx, dh)
        return _gated_act_backward(ctx, dh)


def _gated_act_backward(ctx, dh):
    g, u = ctx.saved_tensors
    dg, du, _ = (_bwd_triton if ctx.triton_path else _bwd_torch)(dh, g, u, ctx.act, None)
    return (dg if ctx.needs_input_grad[0] else None), (du if ctx.needs_input_grad[1] else None), None


_gated_act_backward_once = torch.autograd.function.once_differentiable(_gated_act_backward)


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
    if torch.compiler.is_compiling() and use_triton(g) and use_triton(u):
        return torch.ops.lmbp_convert.gated_act_fwd(g, u, act, torch.promote_types(g.dtype, u.dtype))
    return GatedActFunction.apply(g, u, act)


def gated_mlp(g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
              act: str = "silu", lora: Sequence[LoraAdapter] = ()) -> torch.Tensor:
    """``F.linear(act(g)·u, weight, bias) + Σ scale·B(A(act(g)·u))``, saving only g and u for backward.

    g, u: the gate and up projection outputs (..., f), possibly strided views (e.g. the two halves of a
    fused gate_up output). weight (n, f), bias (n,) or None: the down projection, frozen or trainable.
    lora: adapters on the down projection (PEFT semantics, dropout off). Output (..., n) in the dtype the
    eager module would produce (the autocast dtype under torch.autocast).
    """
    _check_gu(g, u, act, "gated_mlp")
    f = g.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != f:
        raise ValueError(f"gated_mlp: down weight of shape {tuple(weight.shape)} does not take {f} features")
    n = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"gated_mlp: down bias of shape {tuple(bias.shape)}, expected ({n},)")
    meta, flat = [], []
    for ad in lora:
        a_w, b_w, b_b = ad.a_weight, ad.b_weight, ad.b_bias
        if a_w.dim() != 2 or b_w.dim() != 2 or a_w.shape[1] != f or b_w.shape != (n, a_w.shape[0]):
            raise ValueError(f"gated_mlp: LoRA shapes A {tuple(a_w.shape)}, B {tuple(b_w.shape)} do not fit a "
                             f"{f} -> {n} projection")
        if b_b is not None and tuple(b_b.shape) != (n,):
            raise ValueError(f"gated_mlp: LoRA B bias of shape {tuple(b_b.shape)}, expected ({n},)")
        if isinstance(ad.scale, torch.Tensor) or not isinstance(ad.scale, (int, float)):
            raise TypeError(f"gated_mlp: LoRA scale must be a Python number, got {type(ad.scale).__name__}")
        meta.append((float(ad.scale), bool(ad.cast_input)))
        flat += [a_w, b_w, b_b]
    if func_transforms.active():  # torch.func: the same function through torch's ops
        return func_transforms.gated_mlp(g, u, weight, bias, act, meta, flat)
    if use_triton(g) and use_triton(u) and not torch.compiler.is_compiling() and g.get_device() == u.get_device():
        host = _HOST.get(0)
        if host is None:
            host = _host_entry()
        if host:  # forward, graph node and backward in C++ (the same ATen calls as GatedMLPFunction)
            out = host(g, u, weight, bias, _act_code(act), tuple(flat), tuple(m[0] for m in meta),
                       sum(1 << i for i, m in enumerate(meta) if m[1]))
            if out is not NotImplemented:
                return out
    return GatedMLPFunction.apply(g, u, weight, bias, act, tuple(meta), *flat)


#: The C++ host path's ``gated_mlp`` under key 0, or False (Python path).
_HOST = cuda_host.state_cache()
_ACT_BY_CODE = {code: k for k, code in _CODES.items()}


def _host_entry():
    ext = cuda_host.ext() if HAS_TRITON else None
    fn = False
    if ext is not None and hasattr(ext, "gated_mlp"):
        ext.set_gated_callbacks(_host_plan, _host_backward_graph, torch.nn.Parameter)
        fn = ext.gated_mlp
    _HOST[0] = fn
    return fn


def _host_plan(code: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK, forward slot, backward slot, backward slot that also stores h) for rows of ``n``."""
    block = _BLOCKS.get(n) or _block(n)
    return (block, cuda_host.slot(_FWD, (code, block), 4), cuda_host.slot(_BWD, (code, False, block), 4),
            cuda_host.slot(_BWD, (code, True, block), 4))


class _SavedCtx:
    __slots__ = ("saved_tensors", "needs_input_grad", "spec")


def _host_backward_graph(dy, saved, needs, ac, h_dtype, code, scales, casts, weight_dtype, bias_dtype):
    """The C++ node's backward under create_graph: `GatedMLPFunction`'s, whose result refuses a second one."""
    ctx = _SavedCtx()
    ctx.saved_tensors = saved
    ctx.needs_input_grad = tuple(needs[:4]) + (False, False) + tuple(needs[4:])
    meta = tuple((s, bool(casts >> i & 1)) for i, s in enumerate(scales))
    ctx.spec = (ac, h_dtype, _ACT_BY_CODE[code], meta, True, weight_dtype, bias_dtype)
    return _gated_mlp_backward_once(ctx, dy)
