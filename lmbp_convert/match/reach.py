"""Where a norm's channels go when no Linear can take its fold: the reasons a skip gives.

`step` (match/commute.py) stops at the first op that does not commute with the affine. To say *why* a norm is
not folded, the channels are followed further here, through any op that keeps them on an axis (elementwise
ops, mixing with another tensor, slicing, dropout), until a Linear reads them or an op consumes them (a
matmul, attention, another module, the model output). That separates "a Linear is downstream but something
on the way breaks the fold" from "no Linear ever reads these channels" (attention's q/k norms)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..trace.graph import Node, Callee
from .commute import Block, Pass, is_metadata, op_short, step
from .context import MatchContext
from .roles import Role, ModuleRole

#: ops that contract or mix the channel axis with another operand: the channels end there
CONSUMING_OPS = {
    "matmul", "__matmul__", "__rmatmul__", "bmm", "mm", "einsum", "linear", "scaled_dot_product_attention",
    "baddbmm", "addmm", "conv1d", "conv2d", "conv3d", "softmax", "log_softmax", "embedding", "cross_entropy",
}
_RESHAPES = {"view", "reshape", "unflatten", "flatten", "view_as", "reshape_as"}
_BUDGET = 400  # tensors followed per reader: the residual stream reaches a Linear within a layer


@dataclass
class Reach:
    """Linears that read the channels (each with the first op on its path that breaks the fold) and where
    the channels end otherwise."""

    linears: dict[str, str] = field(default_factory=dict)  # the nearest ones (fewest non-commuting ops)
    ends: list[str] = field(default_factory=list)
    hops: dict[str, int] = field(default_factory=dict, repr=False)  # non-commuting ops on each Linear's path

    def nearest(self) -> dict[str, str]:
        """The Linears behind the fewest non-commuting ops (a residual stream reaches every later layer)."""
        low = min(self.hops.values(), default=0)
        return {k: v for k, v in self.linears.items() if self.hops[k] == low}


def follow(ctx: MatchContext, node: Node | None, tid: int, axis: int, blocked: str | None = None) -> Reach:
    """Follow the channels on ``axis`` of tensor ``tid`` from its reader ``node`` (None: the model output)."""
    reach, seen = Reach(), set()
    todo = [(node, tid, axis, blocked, 0)]
    while todo and len(seen) < _BUDGET:
        c, t, ax, why, hops = todo.pop()
        if c is None:
            reach.ends.append("the model output")
            continue
        last = ax == len(ctx.g.tensors[t].shape) - 1
        if c.callee is Callee.MODULE:
            role = ctx.roles.get(c.target, Role(ModuleRole.OTHER))
            if role.plays is ModuleRole.LINEAR and last:
                if hops < reach.hops.get(c.target, hops + 1):
                    reach.linears[c.target], reach.hops[c.target] = why or "", hops
                continue
            if role.plays not in (ModuleRole.DROPOUT, ModuleRole.IDENTITY):
                reach.ends.append(c.target)
                continue
            why = why or (f"dropout (p={role.p}) at {c.target}" if role.p else None)
            outs = [(o, ax) for o in c.outputs]
        else:
            outs = _through_op(ctx, c, t, ax)
            if outs is None:
                reach.ends.append(f"{op_short(c)} in {ctx.scope_name(c)}")
                continue
            res = step(c, ctx.g.tensors, t, ax, ctx.g.tensors[t].shape[ax])
            if not isinstance(res, Pass):
                hops += 1
                why = why or (res.reason.text if isinstance(res, Block) else f"{op_short(c)} in {ctx.scope_name(c)}")
        for o, oax in outs:
            if o in seen:
                continue
            seen.add(o)
            if o in ctx.g.root_outputs:
                reach.ends.append("the model output")
            for nxt in ctx.g.consumers(o):
                if not is_metadata(nxt):
                    todo.append((nxt, o, oax, why, hops))
    reach.ends = list(dict.fromkeys(reach.ends))
    return reach


def _through_op(ctx: MatchContext, c: Node, t: int, ax: int) -> list[tuple[int, int]] | None:
    """The outputs of op ``c`` that still carry the channels (and on which axis), None where they end."""
    if op_short(c) in CONSUMING_OPS:
        return None
    res = step(c, ctx.g.tensors, t, ax, ctx.g.tensors[t].shape[ax])
    if isinstance(res, Pass):
        return [(o, res.axis % len(ctx.g.tensors[o].shape)) for o in c.outputs]
    ndim = len(ctx.g.tensors[t].shape)
    if ax == ndim - 1 and op_short(c) in _RESHAPES:  # heads split off the channels: follow the last dim
        return [(o, len(ctx.g.tensors[o].shape) - 1) for o in c.outputs if ctx.g.tensors[o].shape] or None
    kept = [(o, ax) for o in c.outputs if len(ctx.g.tensors[o].shape) == ndim]  # elementwise, cat, slices
    return kept or None
