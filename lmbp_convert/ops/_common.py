"""Shared plumbing for the ops: dtype policy, Triton availability, autocast output dtype.

Kept free of any model knowledge: ops know tensors, not modules.
"""
from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

import torch

try:  # Triton is optional at import time: CPU-only installs (and macOS) run the PyTorch path.
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAS_TRITON = False

#: dtypes every op accepts; float64 only on the PyTorch path (for gradcheck).
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def env_off(name: str) -> bool:
    """Whether the environment switch ``name`` is set to off (0, false, off or no; unset means on)."""
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "off", "no")


def env_on(name: str) -> bool:
    """Whether the environment switch ``name`` is set to on (1, true, on or yes; unset or anything else means
    off): for paths that run only when asked for."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "on", "yes")


def triton_interpreting() -> bool:
    """True when Triton runs kernels with its CPU interpreter (set before kernels are defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_dtype(x: torch.Tensor, op: str) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{op}: unsupported dtype {x.dtype}; expected one of "
            + ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        )


_TRITON_DTYPE_SET = frozenset(TRITON_DTYPES)
#: Device types whose tensors take the Triton kernels; every other device runs the PyTorch path (`_fwd_torch` /
#: `_bwd_torch` in each op, where a native CPU implementation plugs in).
_TRITON_DEVICE_TYPES = {"cuda"} if HAS_TRITON else set()


def set_triton_device_types(*device_types: str) -> None:
    """Route tensors of these device types to the Triton launchers (default: "cuda"). Host-time benchmarks add
    "cpu" together with testsupport's `stub_triton_driver` to time the CUDA launch path without a GPU."""
    if device_types and not HAS_TRITON:
        raise RuntimeError("Triton is not available")
    _TRITON_DEVICE_TYPES.clear()
    _TRITON_DEVICE_TYPES.update(device_types)


def use_triton(x: torch.Tensor) -> bool:
    """Triton kernels run on CUDA tensors of the dtypes they are built for; everything else uses PyTorch."""
    if x.is_cuda:
        return "cuda" in _TRITON_DEVICE_TYPES and x.dtype in _TRITON_DTYPE_SET
    return bool(_TRITON_DEVICE_TYPES) and x.device.type in _TRITON_DEVICE_TYPES and x.dtype in _TRITON_DTYPE_SET


def twice_differentiable(graph: Callable) -> Callable[[Callable], Callable]:
    """Decorator: ``fn(ctx, *grads)`` as an autograd Function's ``backward`` (the op's kernels), with ``graph(ctx,
    *grads)`` its differentiable form. When grad mode is on inside backward (``create_graph=True``: a gradient
    penalty, a Hessian-vector product) ``graph`` runs instead: torch's own ops on the saved tensors, which carry
    their autograd history, so its result has a graph and a second backward goes through it; otherwise ``fn``
    runs, unchanged (the first-order path's speed and bytes do not depend on it). Each op supplies its ``graph``
    in its own file: the forward recomputed from the saved inputs and differentiated with a graph (`regrad`), or
    the backward formula written in torch ops on the saved tensors, whose graphs lead back to the inputs (a saved
    output's leads through the node itself; a saved statistic that is neither, a norm's rstd, goes through
    `linked`). ``.graph``: that form, for the C++ nodes' create_graph callbacks."""

    def wrap(fn: Callable) -> Callable:
        def backward(ctx, *grads):
            if torch.is_grad_enabled():
                return graph(ctx, *grads)
            return fn(ctx, *grads)

        backward.__doc__, backward.__name__, backward.graph = fn.__doc__, fn.__name__, graph
        return backward

    return wrap


class _Link(torch.autograd.Function):
    """`linked`'s node: ``value`` as it is; its gradient handed to ``owner``, a zero one sent to ``anchor``."""

    @staticmethod
    def forward(ctx, anchor, value, owner, key):
        ctx.owner, ctx.key, ctx.anchor = owner, key, (anchor.shape, anchor.dtype, anchor.device)
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        task = torch._C._current_graph_task_id()
        got = getattr(ctx.owner, _HANDED, None)
        if got is None:
            got = {}
            setattr(ctx.owner, _HANDED, got)
        prev = got.get(ctx.key)
        got[ctx.key] = (task, grad if prev is None or prev[0] != task else prev[1] + grad)
        shape, dtype, device = ctx.anchor
        return torch.zeros((), dtype=dtype, device=device).expand(shape), None, None, None


_HANDED = "lmbp_handed"


def linked(owner, key: str, value: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """For a differentiable backward: ``value``, a tensor the node ``owner`` (its ctx) saved that is neither an
    input nor an output of it (a norm's rstd), as a tensor whose gradient in a later backward is handed to
    ``owner`` under ``key`` (`handed`), so that the node's backward adds what ``value``'s dependence on the
    node's inputs contributes. A hand-off, not a graph edge: the node's own backward could not carry it (a norm's
    Jacobian sends nothing along x̂, which is rstd's gradient direction), and returning ``value`` as an output
    too would cost every first-order call. ``anchor``: an output of the node that it saved: the zero gradient this
    sends there makes the engine run the node, after this one, in that backward."""
    return _Link.apply(anchor, value, owner, key)


def handed(ctx) -> Optional[dict]:
    """The gradients handed to ``ctx`` (`linked`) in the current backward pass, key → tensor, taken; None where
    there are none (the first-order path: one attribute lookup)."""
    got = getattr(ctx, _HANDED, None)
    if not got:
        return None
    task = torch._C._current_graph_task_id()
    out = {k: g for k, (t, g) in got.items() if t == task}
    got.clear()
    return out or None


def regrad(forward: Callable, inputs: Sequence, needs: Sequence[bool], grads) -> list:
    """The gradients of ``forward(*inputs)`` for the output gradients ``grads`` (a tensor, or one per output, None
    for none) w.r.t. the tensors of ``inputs`` whose ``needs`` is set, with a graph: the forward recomputed from
    the saved inputs under autograd, differentiated with ``create_graph=True``, so a second backward runs through
    torch's own ops. None where not needed, not used, or nothing requires a gradient."""
    out: list = [None] * len(inputs)
    wrt = [i for i, (t, need) in enumerate(zip(inputs, needs))
           if need and isinstance(t, torch.Tensor) and t.requires_grad]
    if not wrt:
        return out
    with torch.enable_grad():
        outs = forward(*inputs)
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    grads = tuple(grads) if isinstance(grads, (tuple, list)) else (grads,)
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o is not None and o.requires_grad]
    if not pairs:
        return out
    got = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in wrt], [g for _, g in pairs],
                              create_graph=True, allow_unused=True)
    for i, g in zip(wrt, got):
        out[i] = g
    return out


def autocast_dtype_for(x: torch.Tensor) -> torch.dtype:
    """The dtype a following autocast Linear computes in, or x's own dtype outside autocast.

    Emitting this dtype is what keeps memory sharing alive under mixed precision: the Linear's
    autocast cast becomes a no-op, so it saves the very storage the norm saved.
    """
    dev = "cuda" if x.is_cuda else x.device.type
    if torch.is_autocast_enabled(dev) and x.is_floating_point() and x.dtype != torch.float64:
        return torch.get_autocast_dtype(dev)
    return x.dtype
