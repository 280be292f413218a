"""Activation matcher: every GELU/SiLU-family module (by role) becomes an `ActSwap` to approximate backprop; every
other elementwise activation module the forward runs (ReLU, squared ReLU, Tanh, …) is listed with its reason, so
nothing is left out of the report."""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from ..catalogue import class_key
from .context import MatchContext, code_bytes, tensor_bytes
from .plan import ActSwap, Skip
from .roles import RoleKind

#: where libraries keep their activation modules: a leaf module from here that acts elementwise is an activation
_ACTIVATION_MODULES = ("torch.nn.modules.activation", "transformers.activations", "timm.layers.activations")


def match_activations(ctx: MatchContext) -> Iterator[ActSwap | Skip]:
    if not ctx.opt.activations:
        return
    for name, role in ctx.roles.items():
        mod = ctx.modules.get(name)
        if mod is None or name in ctx.claimed or not ctx.opt.selected(name):
            continue
        if role.kind is RoleKind.ACTIVATION:
            yield ActSwap(name, class_key(mod), role.act, ctx.opt.bits, predicted_act_bytes(ctx, name))
        elif role.kind is RoleKind.OTHER and ctx.g.module_calls.get(name):
            why = unconverted_activation(mod)
            if why is not None:
                yield Skip(name, class_key(mod), why)


def unconverted_activation(mod: nn.Module) -> str | None:
    """Why an activation module without an approximate-backprop kind stays as it is; None when ``mod`` is not an
    elementwise activation (a container, a module with parameters, softmax, attention)."""
    if (not type(mod).__module__.startswith(_ACTIVATION_MODULES) or next(mod.children(), None) is not None
            or next(mod.parameters(), None) is not None):
        return None
    x = torch.linspace(-4.0, 4.0, 16).reshape(2, 8).requires_grad_()
    saved: list[torch.Tensor] = []
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = mod(x)
        with torch.no_grad():
            elementwise = isinstance(y, torch.Tensor) and y.shape == x.shape and torch.allclose(
                mod(x[:1, :4].detach()), y[:1, :4].detach(), atol=1e-4)
    except Exception:  # noqa: BLE001 - not a plain tensor-in tensor-out activation
        return None
    if not elementwise:
        return None
    if saved and all(t.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for t in saved):
        return ("no approximate-backprop kind (those are GELU/SiLU-family); its backward reads only its output, "
                "which a following Linear usually keeps anyway: nothing of its own to shrink")
    return "no approximate-backprop kind for this activation (those are GELU/SiLU-family): its input stays kept"


def predicted_act_bytes(ctx: MatchContext, name: str) -> int:
    """Each call's input is kept as a ``bits``-bit code instead of in full."""
    saved = 0
    for node in ctx.g.module_nodes(name):
        if node.inputs:
            n, nbytes = tensor_bytes(ctx.g, node.inputs[0])
            saved += nbytes - code_bytes(n, ctx.opt.bits)
    return saved
