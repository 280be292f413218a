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

Double backward (``create_graph=True``): the backward recomputes the forward from the saved g, u and parameters by
torch's own ops (the PyTorch path's h, `_down`) and differentiates it with a graph (`_common.twice_differentiable`),
so a gradient penalty through the op is the original's; the first-order path above is unchanged.

Files: the elementwise half (kernels, PyTorch path, compile registration, `gated_act`) is `ops.gated_act`,
re-exported here; this file holds the down projection, its LoRA terms, dtype policy and the autograd Function.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from . import func_transforms
from ._common import HAS_TRITON, regrad, twice_differentiable, use_triton
from .saved_hooks import Watched
from .backends import cuda_host
from .backends.dispatch import Backend, route
# The elementwise half (kernels, PyTorch path, compile registration, `gated_act`), re-exported.
from .gated_act import (_BLOCKS, _CODES, ACT_KINDS, GatedActFunction, _act_code, _block,  # noqa: F401
                        _bwd_torch, _bwd_triton, _check_gu, _elementwise_bwd, _elementwise_fwd, _fwd_torch,
                        _fwd_triton, gated_act)

if HAS_TRITON:
    from .gated_act import _BWD, _FWD, _gated_bwd_kernel, _gated_fwd_kernel  # noqa: F401

__all__ = ["ACT_KINDS", "LoraAdapter", "gated_mlp", "gated_act", "GatedMLPFunction", "GatedActFunction"]


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
def _down(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], lora_meta, lora,
          ac: Optional[torch.dtype]) -> torch.Tensor:
    """``W h + b + Σ scale · B(A(h))`` with eager's casts (autocast dtype ``ac``, PEFT's input cast; the callers turn
    autocast off around it): the forward's down projection, and what the double backward and torch.func run."""
    out = (F.linear(h, weight, bias) if ac is None
           else F.linear(_cast(h, ac), _cast(weight, ac), _cast(bias, ac)))
    out_dtype = out.dtype
    acc = out
    for i, (scale, cast_input) in enumerate(lora_meta):
        a_w, b_w, b_b = lora[3 * i: 3 * i + 3]
        hx = _to(h, a_w.dtype) if cast_input else h
        t = F.linear(_cast(hx, ac), _cast(a_w, ac))
        acc = acc + F.linear(_cast(t, ac), _cast(b_w, ac), _cast(b_b, ac)) * scale
    return _to(acc, out_dtype)


def _saved(ctx) -> tuple:
    """g, u, the down weight and the LoRA tensors, each checked against the version it had in forward."""
    saved = ctx.saved_tensors
    for w, t in zip(getattr(ctx, "watched", ()), saved):
        if w is not None and t is not None:
            w.check(t, "the fused gated MLP, which recomputes from it (gated_mlp=False saves as plain autograd)")
    return saved


def _gated_mlp_backward_graph(ctx, dy):
    """create_graph=True: the forward recomputed from the saved g, u and parameters by torch's own ops (the
    PyTorch path's h, `_down` with the forward's autocast dtype), differentiated with a graph. The down weight is
    saved only where g or u needs a gradient, the bias never: the output is linear in both, so a zero stand-in
    gives their gradients (dW = dYᵀ·h, db = Σ dY) and nothing else depends on their values."""
    g, u, weight, *lora = _saved(ctx)
    needs = ctx.needs_input_grad
    ac, h_dtype, act, meta, _, weight_dtype, bias_dtype = ctx.spec
    if weight is None:
        weight = torch.zeros(dy.shape[-1], g.shape[-1], dtype=weight_dtype, device=g.device,
                             requires_grad=needs[2])
    bias = (torch.zeros(dy.shape[-1], dtype=bias_dtype, device=g.device, requires_grad=True)
            if bias_dtype is not None and needs[3] else None)

    def forward(g, u, weight, bias, *lora):
        with _no_autocast("cuda" if g.is_cuda else g.device.type):
            return _down(_fwd_torch(g, u, act, h_dtype), weight, bias, meta, lora, ac)

    grads = regrad(forward, (g, u, weight, bias, *lora), needs[:4] + needs[6:], dy)
    return (*grads[:4], None, None, *grads[4:])


@twice_differentiable(_gated_mlp_backward_graph)
def _gated_mlp_backward(ctx, dy):
    """`GatedMLPFunction`'s backward (see the module docstring for the maths)."""
    g, u, weight, *lora = _saved(ctx)
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
            out = _down(h, weight, bias, lora_meta, lora, ac)
            del h
        # dh needs the weights only when g or u needs a gradient; h is recomputed from g, u.
        need_dh = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        ctx.save_for_backward(g, u, weight if need_dh else None, *lora)
        ctx.spec = (ac, h_dtype, act, lora_meta, triton_path, weight.dtype, bias.dtype if bias is not None else None)
        # backward recomputes h, A(h) and (under autocast) the weights' casts from these: an in-place edit since
        # forward must raise, also where enclosing saved-tensor hooks switch autograd's own check off
        # (not traced: under torch.compile the graph saves and checks its own tensors)
        ctx.watched = () if torch.compiler.is_compiling() else \
            tuple(None if t is None else Watched(t) for t in (g, u, weight if need_dh else None, *lora))
        return out

    backward = staticmethod(_gated_mlp_backward)


# ------------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------------
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
    kernels = use_triton(g) and use_triton(u) and g.get_device() == u.get_device()
    if route("gated_mlp", g, kernels) is Backend.CUDA_HOST:
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
    """The C++ node's backward under create_graph: `GatedMLPFunction`'s differentiable one (recomputed forward)."""
    ctx = _SavedCtx()
    ctx.saved_tensors = saved
    ctx.needs_input_grad = tuple(needs[:4]) + (False, False) + tuple(needs[4:])
    meta = tuple((s, bool(casts >> i & 1)) for i, s in enumerate(scales))
    ctx.spec = (ac, h_dtype, _ACT_BY_CODE[code], meta, True, weight_dtype, bias_dtype)
    return _gated_mlp_backward.graph(ctx, dy)
