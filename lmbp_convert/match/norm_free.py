"""Affine-free norm matcher: a LayerNorm/RMSNorm with no weight and no bias (OLMo's) has nothing to fold, so it
becomes a memory-sharing norm as it is (`NormSwap`) wherever a Linear keeps its output for backward anyway — then
its input (and LayerNorm's mean) no longer is."""
from __future__ import annotations

from dataclasses import replace
from typing import Iterator

from ..catalogue import class_key
from ..reasons import Reason, ReasonCode
from ..trace.graph import Callee
from .context import MatchContext
from .norm import inplace_reason, predicted_norm_bytes
from .norm_walk import Refused, walk_readers
from .plan import NormSwap, Skip
from .roles import NormRole, Role, ModuleRole


def match_affine_free_norms(ctx: MatchContext) -> Iterator[NormSwap | Skip]:
    if not ctx.opt.norms:
        return
    for name, role in ctx.roles.items():
        mod = ctx.modules.get(name)
        if (mod is None or name in ctx.claimed or role.plays is not ModuleRole.NORM or role.norm.affine
                or not ctx.opt.selected(name)):
            continue
        try:
            yield plan_affine_free(ctx, name, role.norm)
        except Refused as why:
            yield Skip(name, class_key(mod), why.reason)


def plan_affine_free(ctx: MatchContext, name: str, nr: NormRole) -> NormSwap:
    if nr.channel_dim != -1:
        raise Refused(Reason(ReasonCode.NO_CONSUMER, "channel-first norm without affine: nothing to fold, and its "
                             "memory-sharing form is only made where a fold goes"))
    calls = ctx.g.module_calls.get(name, 0)
    if calls != 1:
        raise Refused(Reason(ReasonCode.NOT_CALLED, "not called by the probe forward") if calls == 0 else
                      Reason(ReasonCode.SHARED_CALL, f"called {calls} times per forward (shared module)"))
    (node,) = ctx.g.module_nodes(name)
    if len(node.inputs) != 1 or len(node.outputs) != 1:
        raise Refused(Reason(ReasonCode.SIGNATURE, "takes or returns more than one tensor"))
    x, y = ctx.g.tensors[node.inputs[0]], ctx.g.tensors[node.outputs[0]]
    if x.shape != y.shape or x.dtype != y.dtype or not x.shape:
        raise Refused(Reason(ReasonCode.SIGNATURE, f"maps {x.dtype} {tuple(x.shape)} to {y.dtype} {tuple(y.shape)} "
                             "(a memory-sharing norm keeps shape and dtype)"))
    d = x.shape[-1]
    if nr.shape and tuple(nr.shape) != (d,):
        raise Refused(Reason(ReasonCode.SIGNATURE, f"normalises {tuple(nr.shape)} by its attributes but is called on a "
                             f"last dim of {d}"))
    nr = replace(nr, shape=(d,))
    walk = walk_readers(ctx, node.outputs[0], nr)
    if walk.inplace:
        raise Refused(inplace_reason(walk))
    readers = list(walk.targets) + [r.node.target for r in walk.others if r.node is not None
                                    and r.node.callee is Callee.MODULE
                                    and ctx.roles.get(r.node.target, Role(ModuleRole.OTHER)).plays is ModuleRole.LINEAR]
    if not readers:
        raise Refused(Reason(ReasonCode.NO_CONSUMER, "no Linear reads its output, so a memory-sharing norm would keep "
                             "its output instead of its input and save nothing"))
    return NormSwap(name, class_key(ctx.modules[name]), nr.norm_type, nr.eps, [d], sorted(set(readers)),
                    predicted_norm_bytes(ctx, node, nr))
