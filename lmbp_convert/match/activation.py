"""Activation matcher: every GELU/SiLU-family module (by role) becomes an `ActSwap` to approximate backprop."""
from __future__ import annotations

from typing import Iterator

from ..catalogue import class_key
from .context import MatchContext, code_bytes, tensor_bytes
from .plan import ActSwap
from .roles import RoleKind


def match_activations(ctx: MatchContext) -> Iterator[ActSwap]:
    if not ctx.opt.activations:
        return
    for name, role in ctx.roles.items():
        mod = ctx.modules.get(name)
        if mod is None or name in ctx.claimed or role.kind is not RoleKind.ACTIVATION or not ctx.opt.selected(name):
            continue
        yield ActSwap(name, class_key(mod), role.act, ctx.opt.bits, predicted_act_bytes(ctx, name))


def predicted_act_bytes(ctx: MatchContext, name: str) -> int:
    """Each call's input is kept as a ``bits``-bit code instead of in full."""
    saved = 0
    for node in ctx.g.module_nodes(name):
        if node.inputs:
            n, nbytes = tensor_bytes(ctx.g, node.inputs[0])
            saved += nbytes - code_bytes(n, ctx.opt.bits)
    return saved
