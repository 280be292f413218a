"""Projection-like modules, found by behaviour: a module that maps its input's last dim linearly (plus a bias),
row by row, whatever its class — a quantized Linear that dequantizes a packed weight (bitsandbytes Linear4bit,
GPTQ/AWQ kernels), a LoRA adapter over one, a custom Linear.

Its weight cannot be rewritten (so no fold goes into it), but the matchers that only need a consumer's data flow
accept it: a norm already folded on disk (identity affine) is swapped for a memory-sharing one whose output
these modules read, and a gated MLP whose projections are such modules is fused (the down projection then runs
unchanged, its saved input recomputed: `lmbp_convert.ops.gated_recompute`).

The check runs the module on a small probe: y(a·x₁ + (1-a)·x₂) = a·y(x₁) + (1-a)·y(x₂) (affine in x), and each
row's output depends on that row alone. A module on the meta device cannot be probed and is not accepted.
"""
from __future__ import annotations

import torch
from torch import nn

from ..trace.graph import Node, Callee
from .roles import Role, ModuleRole

#: roles whose modules may be projection-like (LINEAR ones are projections by their catalogue entry)
PROBED_ROLES = (ModuleRole.QUANTIZED_LINEAR,)


def _width(module: nn.Module) -> int | None:
    d = getattr(module, "in_features", None)
    return d if isinstance(d, int) and d > 0 else None


def _where(module: nn.Module) -> tuple[torch.device, torch.dtype] | None:
    """Device and floating dtype to probe in: the module's floating tensors', or its declared compute dtype."""
    dev, dtype = None, None
    for t in [*module.parameters(), *module.buffers()]:
        dev = dev or t.device
        if dtype is None and t.is_floating_point():
            dtype = t.dtype
    compute = getattr(module, "compute_dtype", None)
    if isinstance(compute, torch.dtype) and compute.is_floating_point:
        dtype = compute
    if dev is None or dev.type == "meta":
        return None
    return dev, dtype or torch.float32


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.float(), b.float()
    tol = 2e-2 if a.dtype != torch.float64 else 1e-6
    scale = float(b.abs().max()) if b.numel() else 0.0
    return a.shape == b.shape and bool(torch.isfinite(a).all()) and float((a - b).abs().max()) <= tol * max(scale, 1e-3)


def projection_problem(module: nn.Module, d_in: int | None = None) -> str | None:
    """Why ``module`` is not projection-like (None: it is). ``d_in``: its input width, if it has no
    ``in_features``."""
    d = d_in or _width(module)
    where = _where(module)
    if d is None:
        return "input width unknown (no in_features)"
    if where is None:
        return "on the meta device (cannot be probed)"
    dev, dtype = where
    gen = torch.Generator().manual_seed(0)
    x1, x2 = (torch.randn(3, d, generator=gen).to(dev, dtype) for _ in range(2))
    a = 0.25
    was = module.training
    module.eval()  # no dropout on the probe
    try:
        with torch.no_grad():
            y1, y2, ymix = module(x1), module(x2), module(a * x1 + (1 - a) * x2)
            yrow = module(x1[:1])
    except Exception as exc:
        return f"fails on a probe ({type(exc).__name__}: {str(exc).strip()[:120]})"
    finally:
        module.train(was)
    if not all(isinstance(y, torch.Tensor) and y.is_floating_point() for y in (y1, y2, ymix, yrow)):
        return "does not return a floating-point tensor"
    if y1.dim() != 2 or y1.shape[0] != 3:
        return f"maps (3, {d}) to {tuple(y1.shape)}, not row by row"
    if not _close(ymix, a * y1.float() + (1 - a) * y2.float()):
        return "is not a linear map of its input"
    if not _close(yrow, y1[:1]):
        return "mixes rows"
    return None


def is_projection_node(ctx, node: Node) -> bool:
    """Whether the module called at ``node`` is a projection: a catalogued Linear (or LoRA over one), or a module
    of a `PROBED_ROLES` role that passes the probe on the traced input width."""
    if node.callee is not Callee.MODULE:
        return False
    role = ctx.roles.get(node.target, Role(ModuleRole.OTHER))
    if role.plays is ModuleRole.LINEAR:
        return True
    if role.plays not in PROBED_ROLES or not node.inputs:
        return False
    cache = ctx.projection_checked
    if node.target not in cache:
        shape = ctx.g.tensors[node.inputs[0]].shape
        cache[node.target] = projection_problem(ctx.modules[node.target], shape[-1] if shape else None) is None
    return cache[node.target]
