"""Shared plumbing for the ops: dtype policy, Triton availability, autocast output dtype.

Kept free of any model knowledge: ops know tensors, not modules.
"""
from __future__ import annotations

import os
from typing import Callable

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


def refusing_double_backward(fn: Callable) -> Callable:
    """``fn(ctx, *grads)`` as an autograd Function's ``backward``: under create_graph=True (grad mode on inside
    backward) through ``once_differentiable``, so the result refuses a second backward rather than give a wrong
    one. ``.once``: that wrapped form, for callers that make a graph node's backward themselves (the C++ node)."""
    once = torch.autograd.function.once_differentiable(fn)

    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            return once(ctx, *grads)
        return fn(ctx, *grads)

    backward.once = once
    return backward


def autocast_dtype_for(x: torch.Tensor) -> torch.dtype:
    """The dtype a following autocast Linear computes in, or x's own dtype outside autocast.

    Emitting this dtype is what keeps memory sharing alive under mixed precision: the Linear's
    autocast cast becomes a no-op, so it saves the very storage the norm saved.
    """
    dev = "cuda" if x.is_cuda else x.device.type
    if torch.is_autocast_enabled(dev) and x.is_floating_point() and x.dtype != torch.float64:
        return torch.get_autocast_dtype(dev)
    return x.dtype
