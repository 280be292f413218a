"""Gated MLPs computed in a module's own code (MoE experts), found from data flow: a `RecomputeRegion` item.

transformers ≥ 5 keeps a block's experts as 3-D parameters in one module whose forward runs every expert's gated
MLP on the rows routed to it (a loop of ``F.linear`` on ``P[e]``, ``bmm`` or ``grouped_mm``). There is no MLP
module to swap, but the pattern is in the graph: inside one module call, an activation *module*'s output is
multiplied by another tensor and the product is the data operand of a weight op (``linear``, ``bmm``,
``grouped_mm``, a Linear). For such a module every activation call's output and product are recomputed in
backward from the gate and up outputs autograd keeps anyway, and rows gathered from the module's input from
that input (`lmbp_convert.ops.region_recompute`): each expert keeps only its gate and up outputs for its routed
rows. The activation runs exactly (its module is claimed, not swapped for approximate backprop), so gradients are
those of the original model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from ..catalogue import class_key
from ..trace.graph import Node, Callee
from .commute import Pass, is_metadata, op_short, step
from .context import MatchContext, tensor_bytes
from .functional import WEIGHT_OPERAND_OPS, weight_operand
from .plan import PlanItem, Skip
from .readers import At, end_readers
from .roles import ModuleRole

_MULS = ("mul", "__mul__", "__rmul__")


@dataclass
class RecomputeRegion(PlanItem):
    """A module whose own code computes gated MLPs (MoE experts held as parameters): during its call, what
    autograd saves of ``act(g)``, of ``act(g)·u`` and of rows gathered from its input is recomputed in backward
    (hooks on the module and its activations; nothing is swapped, the state dict is unchanged)."""

    tag = "recompute_regions"
    noun = "expert MLP regions"
    noun_one = "expert MLP region"
    heading = "gated MLPs in module code (MoE experts) → gate and up outputs kept, the rest recomputed"

    acts: list[str] = field(default_factory=list)  # the activation modules called inside (claimed)
    act_calls: int = 0  # their calls on the probe (one per expert hit in a loop; one for grouped / batched)
    gathers: int = 0  # row gathers of the module's input that are recomputed
    predicted_saved_bytes: int = 0

    def claims(self) -> set[str]:
        return {self.name, *self.acts}

    def describe(self) -> list[str]:
        gathers = f", {self.gathers} row gather(s) of its input" if self.gathers else ""
        return [f"  {self.name} ({self.cls.split(':')[-1]}; {', '.join(self.acts)}: {self.act_calls} call(s) on the "
                f"probe{gathers})"]


def _feeds_weight_op(ctx: MatchContext, tid: int) -> bool:
    """Every reader of ``tid`` (past casts, views, an unsqueeze: ops that move its last dim as a whole) applies a
    weight to it: a Linear module, or ``linear`` / ``bmm`` / ``grouped_mm`` with it as the data operand."""
    g, d = ctx.g, ctx.g.tensors[tid].shape[-1]

    def through(c: Node, at: At) -> list[At] | None:
        if c.callee is Callee.MODULE or op_short(c) in WEIGHT_OPERAND_OPS:
            return None
        res = step(c, g.tensors, at[0], at[1], d)
        if not isinstance(res, Pass) or op_short(c) == "dropout":
            return None
        return [(o, res.axis % len(g.tensors[o].shape)) for o in c.outputs]

    found = False
    for c, (t, axis) in end_readers(g, (tid, len(g.tensors[tid].shape) - 1), through):
        if not _applies_weight(ctx, c, t, axis):
            return False
        found = True
    return found


def _applies_weight(ctx: MatchContext, c: Node, t: int, axis: int) -> bool:
    """``c`` applies a weight to the channels on ``axis`` of ``t``: a Linear module, or a weight op with ``t`` as
    its data operand."""
    if c.callee is Callee.MODULE:
        role = ctx.roles.get(c.target)
        return role is not None and role.plays is ModuleRole.LINEAR and axis == len(ctx.g.tensors[t].shape) - 1
    return weight_operand(ctx.g, c, t, axis) is not None


def _gated_product(ctx: MatchContext, act: Node) -> bool:
    """The activation's output is multiplied (once) by another tensor, and the product feeds weight ops."""
    if len(act.outputs) != 1:
        return False
    uses = [c for c in ctx.g.consumers(act.outputs[0]) if not is_metadata(c)]
    if len(uses) != 1 or uses[0].callee is not Callee.OP or op_short(uses[0]) not in _MULS:
        return False
    mul = uses[0]
    if len(mul.inputs) != 2 or len(set(mul.inputs)) != 2 or len(mul.outputs) != 1:
        return False
    return _feeds_weight_op(ctx, mul.outputs[0])


def match_recompute_regions(ctx: MatchContext) -> Iterator[RecomputeRegion | Skip]:
    """The matcher (declared in `lmbp_convert.rewrites`): one item per module call scope whose activation
    calls all form gated products feeding weight ops."""
    if not ctx.opt.gated_mlp:
        return
    by_scope: dict[int, list[Node]] = {}
    for node in ctx.g.nodes:
        role = ctx.roles.get(node.target) if node.callee is Callee.MODULE else None
        if role is not None and role.plays is ModuleRole.ACTIVATION and node.scopes:
            by_scope.setdefault(node.scopes[-1], []).append(node)
    done: set[str] = set()
    for sidx, acts in by_scope.items():
        sc = ctx.g.scopes[sidx]
        name = sc.module
        if not name or name in done or name in ctx.claimed or not ctx.opt.selected(name):
            continue
        names = sorted({a.target for a in acts})
        if any(n in ctx.claimed or ctx.g.module_calls.get(n, 0) != sum(a.target == n for a in acts) for n in names):
            continue  # an activation also called elsewhere, or already taken by another rewrite
        if ctx.g.module_calls.get(name, 0) != 1 or not all(_gated_product(ctx, a) for a in acts):
            continue
        if any(ctx.opt.excluded(n) or _hooked(ctx.modules[n]) for n in names):
            continue  # a hook on the activation could change its output: the recomputation would not replay it
        done.add(name)
        saved, gathers = 0, 0
        for a in acts:
            mul = ctx.g.consumers(a.outputs[0])[0]
            saved += tensor_bytes(ctx.g, a.outputs[0])[1] + tensor_bytes(ctx.g, mul.outputs[0])[1]
        for tid in _first_float_input(ctx, sc):
            for c in ctx.g.consumers(tid):
                if c.callee is Callee.OP and op_short(c) == "__getitem__" and _row_gather(c, tid):
                    gathers += 1
                    saved += tensor_bytes(ctx.g, c.outputs[0])[1]
        for node in ctx.g.nodes:  # a parameter's rows gathered per routed row (P[ids] of a batched matmul)
            if node.scopes and node.scopes[-1] == sidx and op_short(node) == "__getitem__" and node.inputs and \
                    ctx.g.tensors[node.inputs[0]].param is not None and _row_gather(node, node.inputs[0]):
                gathers += 1
                saved += tensor_bytes(ctx.g, node.outputs[0])[1]
        yield RecomputeRegion(name, class_key(ctx.modules[name]), names, len(acts), gathers, saved)


def _hooked(mod) -> bool:
    return bool(mod._forward_hooks or mod._forward_pre_hooks or getattr(mod, "_forward_hooks_with_kwargs", None)
                or mod._backward_hooks or mod._backward_pre_hooks)


def _row_gather(node: Node, tid: int) -> bool:
    """``x[idx]`` with an integer tensor index on the leading dim (the routed rows of an expert)."""
    args = node.info.get("args", ())
    if len(args) < 2 or args[0] != ("T", tid):
        return False
    idx = args[1]
    return isinstance(idx, tuple) and len(idx) == 2 and idx[0] == "T"


def _first_float_input(ctx: MatchContext, sc) -> list[int]:
    """The module call's first floating-point tensor argument (positional first, then keywords): the input whose
    gathered rows the region recomputes (`lmbp_convert.nn.recompute_region`)."""
    def order(item):
        slots = item[1]
        return min((0, s.position) if s.keyword is None else (1, 0) for s in slots)

    for tid, _ in sorted(sc.args.items(), key=order):
        if ctx.g.tensors[tid].dtype.startswith(("float", "bfloat")):
            return [tid]
    return []
