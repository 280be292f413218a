"""Tolerance table shared by the op tests: one entry per dtype, for forward values and for gradients.

The ops compute in fp32 (fp64 for fp64 inputs) and round once to the output dtype, so the forward budget is
about one rounding in that dtype plus the ulps by which two fp32 implementations of a transcendental differ
(Triton vs ATen). Gradients get a looser budget: norm backwards contain row reductions whose summation order
differs between a Triton kernel and ATen.

Usage::

    from tolerances import tol          # conftest.py (checkout root) puts tests/ops on sys.path
    torch.testing.assert_close(out, ref, **tol(out.dtype))          # forward
    torch.testing.assert_close(dx, dx_ref, **tol(dx.dtype, "bwd"))  # backward
"""
from __future__ import annotations

import torch

#: dtype -> {"fwd": {atol, rtol}, "bwd": {atol, rtol}}
TOLERANCES: dict[torch.dtype, dict[str, dict[str, float]]] = {
    torch.float64: {"fwd": {"atol": 1e-10, "rtol": 1e-10}, "bwd": {"atol": 1e-9, "rtol": 1e-9}},
    torch.float32: {"fwd": {"atol": 1e-5, "rtol": 1e-5}, "bwd": {"atol": 1e-4, "rtol": 1e-4}},
    # fp16: one rounding is 2**-11 ~ 4.9e-4 relative; allow two roundings and small-magnitude atol.
    torch.float16: {"fwd": {"atol": 1e-3, "rtol": 1e-3}, "bwd": {"atol": 5e-3, "rtol": 5e-3}},
    # bf16: one rounding is 2**-8 ~ 3.9e-3 relative; a value near a rounding boundary can land one ulp off.
    torch.bfloat16: {"fwd": {"atol": 1e-2, "rtol": 1.6e-2}, "bwd": {"atol": 3e-2, "rtol": 3e-2}},
}


def tol(dtype: torch.dtype, which: str = "fwd") -> dict[str, float]:
    """``{"atol": ..., "rtol": ...}`` for ``dtype``; ``which`` is "fwd" or "bwd"."""
    if which not in ("fwd", "bwd"):
        raise ValueError(f"which must be 'fwd' or 'bwd', got {which!r}")
    try:
        return dict(TOLERANCES[dtype][which])
    except KeyError:
        raise KeyError(f"no tolerance entry for {dtype}") from None
