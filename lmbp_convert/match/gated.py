"""Gated-MLP pattern, found from data flow inside one module call:

    x ─┬─ gate ── act ──┐
       └─ up ───────────┴─ mul ── down ── (module output)

or Phi-3 style ``gate_up(x).chunk(2, -1)`` feeding act and mul. The module is replaced by ``MSGatedMLP`` over
the same projection submodules (same names, same state_dict keys), which saves only the gate and up outputs.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple

from ..catalogue import class_key
from ..kinds import GATED_ACT_KINDS, Layout
from ..trace.graph import Node, NodeKind
from .commute import is_metadata, op_short
from .context import MatchContext, tensor_bytes
from .plan import GatedMLPSwap, Skip
from .roles import RoleKind, user_hooks

FUSED_ACTS = GATED_ACT_KINDS  # what the fused op computes (one list, shared with ops.gated_mlp)


def match_gated_mlps(ctx: MatchContext) -> Iterator[GatedMLPSwap | Skip]:
    """The matcher (see `lmbp_convert.match.planner.MATCHERS`)."""
    if ctx.opt.gated_mlp:
        for swap, skip in find_gated_mlps(ctx):
            yield swap if swap is not None else skip


def find_gated_mlps(ctx: MatchContext) -> Iterator[tuple[GatedMLPSwap | None, Skip | None]]:
    g = ctx.g
    inside: dict[int, list] = {}
    for node in g.nodes:
        if node.scopes and not is_metadata(node):
            inside.setdefault(node.scopes[-1], []).append(node)
    nested = {sc.parent for sc in g.scopes if sc.parent is not None}
    for sc in g.scopes:
        nodes = inside.get(sc.idx, [])
        mods = [n for n in nodes if n.kind is NodeKind.MODULE]
        acts = [n for n in mods if ctx.roles.get(n.target) and ctx.roles[n.target].kind is RoleKind.ACTIVATION]
        if len(acts) != 1 or not sc.module or sc.idx in nested:
            continue
        if not ctx.opt.selected(sc.module):
            continue
        swap_or_reason = _match(ctx, sc, nodes, acts[0])
        if isinstance(swap_or_reason, GatedMLPSwap):
            yield swap_or_reason, None
        elif swap_or_reason:
            yield None, Skip(sc.module, class_key(ctx.modules[sc.module]), swap_or_reason)


class _Shape(NamedTuple):
    """A module call whose data flow is act(gate(x))·up(x) → down (or gate_up(x).chunk(2) for gate and up)."""

    projections: dict  # "gate", "up" or "gate_up" → its Linear node
    down: Node
    gate_first: bool


def _match(ctx, sc, nodes, act) -> GatedMLPSwap | str | None:
    """The swap, a reason it cannot be converted, or None when the scope is not a gated MLP at all."""
    shape = _gated_shape(ctx, sc, nodes, act)
    if shape is None:
        return None
    attrs = _attributes(ctx, sc, act, shape)
    if isinstance(attrs, str):
        return attrs
    saved = 2 * tensor_bytes(ctx.g, act.inputs[0])[1]  # act(g) and act(g)·u are no longer kept
    module = ctx.modules[sc.module]
    return GatedMLPSwap(
        name=sc.module, cls=class_key(module), act=ctx.roles[act.target].act, act_module=act.target,
        gate=attrs.get("gate"), up=attrs.get("up"), gate_up=attrs.get("gate_up"), down=attrs["down"],
        gate_first=shape.gate_first, predicted_saved_bytes=saved,
    )


def _gated_shape(ctx, sc, nodes, act) -> _Shape | None:
    mods = [n for n in nodes if n.kind is NodeKind.MODULE]
    ops = [n for n in nodes if n.kind is NodeKind.OP]
    linears = [n for n in mods if ctx.roles[n.target].kind is RoleKind.LINEAR]
    if len(linears) not in (2, 3) or len(mods) != len(linears) + 1:
        return None
    producers = {o: n for n in nodes for o in n.outputs}
    muls = [n for n in ops if op_short(n) in ("mul", "__mul__", "__rmul__")]
    if len(muls) != 1 or len(muls[0].inputs) != 2 or act.outputs[0] not in muls[0].inputs:
        return None
    mul = muls[0]
    downs = [n for n in linears if n.inputs and n.inputs[0] == mul.outputs[0]]
    if len(downs) != 1 or sc.outputs != downs[0].outputs:
        return None
    other = next(t for t in mul.inputs if t != act.outputs[0])
    found = _projections(ctx.g, producers, linears, producers.get(act.inputs[0]), producers.get(other), act)
    if found is None:
        return None
    projections, gate_first, extra_op = found
    allowed_ops = {id(mul)} | ({id(extra_op)} if extra_op is not None else set())
    if any(id(n) not in allowed_ops for n in ops):
        return None
    xs = {p.inputs[0] for p in projections.values()}
    if len(xs) != 1 or set(sc.args) != xs:
        return None
    return _Shape(projections, downs[0], gate_first)


def _projections(g, producers, linears, gate_node, up_node, act):
    """({role: Linear node}, gate first, the chunk op or None) for separate gate/up or a fused gate_up."""
    if gate_node is not None and gate_node is up_node and op_short(gate_node) == "chunk":
        chunk = gate_node
        args = chunk.info.get("args", ())
        n_chunks = args[1] if len(args) > 1 else chunk.info["kwargs"].get("chunks")
        dim = args[2] if len(args) > 2 else chunk.info["kwargs"].get("dim", 0)
        src = producers.get(chunk.inputs[0])
        if n_chunks != 2 or dim not in (-1, len(g.tensors[chunk.inputs[0]].shape) - 1) or src not in linears:
            return None
        return {"gate_up": src}, chunk.outputs.index(act.inputs[0]) == 0, chunk
    if gate_node not in linears or up_node not in linears or gate_node is up_node:
        return None
    return {"gate": gate_node, "up": up_node}, True, None


def _attributes(ctx, sc, act, shape: _Shape) -> dict[str, str] | str:
    """It is a gated MLP: the child attribute of each projection, or the reason it cannot be converted."""
    if ctx.g.module_calls.get(sc.module, 0) != 1:
        return f"gated MLP called {ctx.g.module_calls.get(sc.module)} times per forward"
    hooks = user_hooks(ctx.modules[act.target])
    if hooks or ctx.modules[act.target]._forward_pre_hooks:
        return (f"activation {act.target} has hooks registered, which the fused op would not run (it computes "
                "the activation itself); the activation is converted on its own")
    act_kind = ctx.roles[act.target].act
    if act_kind not in FUSED_ACTS:
        return f"gated MLP with {act_kind} has no fused op (the activation is converted on its own)"
    if ctx.roles[shape.down.target].layout is not Layout.OUT_IN:
        return f"down projection {shape.down.target} is not an nn.Linear"
    prefix = sc.module + "."
    attrs = {}
    for role, node in [*shape.projections.items(), ("down", shape.down), ("act", act)]:
        if not node.target.startswith(prefix) or "." in node.target[len(prefix):]:
            return f"{role} projection {node.target} is not a direct child of {sc.module}"
        attrs[role] = node.target[len(prefix):]
    return _extra_state(ctx, sc, attrs) or attrs


def _extra_state(ctx, sc, attrs: dict[str, str]) -> str | None:
    """Parameters or buffers of the MLP that the fused op (which keeps only the projections) would drop."""
    module = ctx.modules[sc.module]
    kept = {attrs[k] for k in ("gate", "up", "gate_up", "down") if k in attrs}
    for cname, child in module.named_children():
        if cname not in kept and cname != attrs["act"] and any(True for _ in child.parameters()):
            return f"{sc.module}.{cname} holds parameters the fused op would drop"
    if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
        return f"{sc.module} holds its own parameters or buffers"
    return None
