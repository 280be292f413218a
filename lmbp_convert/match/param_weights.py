"""Fold targets that are parameters a module applies through an op itself, not nn.Linear layers.

An MoE router calls ``F.linear(x, self.weight)``; experts stored as one parameter per projection (transformers ≥ 5:
``gate_up_proj`` [experts, 2·inter, hidden], ``down_proj`` [experts, hidden, inter], or transposed) are applied to
the rows routed to them through ``F.linear(rows, P[e])`` in a loop, ``bmm(P[ids], rows)`` or
``grouped_mm(rows, P.transpose(-2, -1), offs)``. The norm's channels reach such an op as the data operand (row
selection and casts commute with a per-channel scale); the weight operand is traced back through expert
selection (indexing the leading dim), transposes and casts to the parameter, which tells which of its dims the
channels are contracted with. The fold then goes into that whole parameter — every expert, routed on the probe
or not, since they all live in the same tensor and are reached by the same code.

The fold is exact only if *every* use of that parameter reads this norm's output: each use the trace saw must be
one of the recognised weight ops of this walk (`unknown_uses`); otherwise the fold is refused, naming the use.
β would need a bias inside the op, so norms with β are refused here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..kinds import Layout
from ..trace.graph import Graph, Node, NodeKind
from .commute import op_short
from .plan import LinearTarget
from .readers import At, end_readers

if TYPE_CHECKING:
    from .context import MatchContext

#: ops that hand a weight on unchanged except for selecting experts (its leading dims), its dtype or its layout
_CASTS = {"to", "contiguous", "clone", "float", "half", "bfloat16", "type", "detach"}
_TRANSPOSES = {"transpose", "swapaxes", "swapdims"}


@dataclass
class ParamUse:
    """One op applying parameter ``param`` (qualified name) to the norm's channels."""

    param: str
    module: str  # its owner
    attr: str  # its attribute there
    contracted: int  # the parameter's dim contracted with the channels (-1: [..., out, in]; -2: [..., in, out])
    node: int  # the op's index in the graph


def _t(args, pos: int):
    a = args[pos] if len(args) > pos else None
    return a[1] if isinstance(a, tuple) and len(a) == 2 and a[0] == "T" else None


def _arg(node: Node, pos: int, name: str):
    args = node.info.get("args", ())
    if len(args) > pos:
        return args[pos]
    return node.info.get("kwargs", {}).get(name)


def _tid(a) -> int | None:
    return a[1] if isinstance(a, tuple) and len(a) == 2 and a[0] == "T" else None


def weight_operand(g: Graph, node: Node, tid: int, axis: int) -> tuple[int, int] | None:
    """(the weight operand's tensor id, its dim contracted with the channels) when tensor ``tid`` with the norm's
    channels at ``axis`` is the data operand of the weight op ``node``; None otherwise."""
    op, ndim = op_short(node), len(g.tensors[tid].shape)
    last = axis == ndim - 1
    first, second = _tid(_arg(node, 0, "input")), _tid(_arg(node, 1, "weight"))
    if op == "linear":
        return (second, -1) if first == tid and last and second is not None and second != tid else None
    if op in ("grouped_mm", "_grouped_mm"):
        first, second = _tid(_arg(node, 0, "mat_a")), _tid(_arg(node, 1, "mat_b"))
        return (second, -2) if first == tid and last and second is not None and second != tid else None
    if op in ("mm", "bmm", "matmul", "__matmul__"):
        if first == tid and last and second is not None and second != tid:
            return second, -2
        if second == tid and ndim >= 2 and axis == ndim - 2 and first is not None and first != tid:
            return first, -1
    return None


def _neg(d: int, ndim: int) -> int:
    return d - ndim if d >= 0 else d


def trace_to_param(g: Graph, wt: int, contracted: int) -> tuple[int, int] | None:
    """Follow a weight operand back to a model parameter through expert selection (an index on the leading dim),
    transposes and casts: (the parameter's tensor id, its contracted dim, negative), or None."""
    while True:
        info = g.tensors[wt]
        if info.param is not None:
            return (wt, contracted) if len(info.shape) >= 2 and contracted in (-1, -2) else None
        if info.producer is None:
            return None
        node = g.nodes[info.producer]
        op, args = op_short(node), node.info.get("args", ())
        src = _t(args, 0)
        if node.kind is not NodeKind.OP or src is None or len(node.outputs) != 1:
            return None
        ndim = len(info.shape)
        if op in _CASTS:
            pass
        elif op in _TRANSPOSES and len(args) >= 3 and all(isinstance(a, int) for a in args[1:3]):
            d0, d1 = _neg(args[1], ndim), _neg(args[2], ndim)
            contracted = d1 if contracted == d0 else d0 if contracted == d1 else contracted
        elif op == "t" and ndim == 2:
            contracted = -1 if contracted == -2 else -2
        elif op == "__getitem__" and len(args) >= 2 and _leading_index(args[1]):
            pass  # P[e] / P[ids]: selects experts; the trailing [out, in] dims stay as they were
        elif op == "index_select" and len(args) >= 2 and args[1] == 0:
            pass
        else:
            return None
        if -contracted > len(g.tensors[src].shape):
            return None
        wt = src


def _leading_index(index) -> bool:
    """An index that selects along the leading dim only: an int or an integer tensor (alone, or followed by
    whole slices / an Ellipsis)."""
    items = list(index) if isinstance(index, tuple) and not (index and index[0] in ("T", "slice")) else [index]
    if not items or not (isinstance(items[0], int) and not isinstance(items[0], bool) or _tid(items[0]) is not None):
        return False
    return all(it == "..." or it == ("slice", None, None, None) for it in items[1:])


def param_use(ctx: "MatchContext", node: Node, tid: int, axis: int, d: int) -> ParamUse | None:
    """The parameter the weight op ``node`` applies to the channels of ``tid`` (None: not such a use)."""
    found = weight_operand(ctx.g, node, tid, axis)
    if found is None:
        return None
    traced = trace_to_param(ctx.g, *found)
    if traced is None:
        return None
    ptid, contracted = traced
    info = ctx.g.tensors[ptid]
    if info.shape[contracted] != d:
        return None
    module, _, attr = info.param.rpartition(".")
    return ParamUse(info.param, module, attr, contracted, node.idx)


def param_problem(ctx: "MatchContext", use: ParamUse, has_beta: bool) -> str | None:
    """Why the fold cannot go into this parameter (None: it can)."""
    mod = ctx.modules.get(use.module)
    p = getattr(mod, use.attr, None) if mod is not None else None
    op = op_short(ctx.g.nodes[use.node])
    if p is None or not p.is_floating_point():
        return f"{use.param} has weights that cannot be rewritten ({getattr(p, 'dtype', None)})"
    if has_beta:
        return (f"{use.module} ({type(mod).__name__}) applies {use.attr} {tuple(p.shape)} through {op}: the norm's "
                "shift β would need a bias inside that op, which folding into a parameter does not add")
    if ctx.opt.excluded(use.module):
        return f"{use.module} is excluded by the options"
    owners = ctx.param_owners.get(id(p), [])
    if len(owners) > 1:
        return f"{use.param} is shared with {', '.join(o for o in owners if o != use.param)}"
    return None


def target_of(use: ParamUse, via: list[str]) -> LinearTarget:
    layout = Layout.OUT_IN if use.contracted == -1 else Layout.IN_OUT
    return LinearTarget(use.module, layout, list(via), weight=use.attr, through_op=True)


def unknown_uses(ctx: "MatchContext", uses: dict[str, set[int]]) -> str | None:
    """A use of a target parameter that is not one of the recognised weight ops reading the norm's output (the
    parameter would be folded for a consumer of something else), or None when every use the trace saw is one."""
    hands_on = _CASTS | _TRANSPOSES | {"t", "__getitem__", "index_select"}
    for pname, known in uses.items():
        ptid = next((t for t, info in ctx.g.tensors.items() if info.param == pname), None)
        if ptid is None:
            continue

        def through(c: Node, at: At, known: set[int] = known) -> list[At] | None:
            if c.idx in known:
                return []
            if c.kind is NodeKind.OP and _t(c.info.get("args", ()), 0) == at[0] and op_short(c) in hands_on:
                return [(o, None) for o in c.outputs]
            return None

        for c, _ in end_readers(ctx.g, (ptid, None), through):
            return (f"{pname} is also used by {op_short(c)} in {ctx.scope_name(c)}, which does not read this norm's "
                    "output (folding the norm into it would change that use)")
    return None
