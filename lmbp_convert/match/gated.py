"""Gated-MLP pattern, found from data flow inside one module call:

    x ─┬─ gate ── act ──┐
       └─ up ───────────┴─ mul ── [pre-down chain] ── down ── [post-down chain] ── (module output)

or a fused ``gate_up(x).chunk(2, -1)`` (Phi-3, ModernBERT, timm GluMlp) feeding act and mul. The pre-down chain
is what models put between the product and the down projection: Dropout (any p: the module is run inside the
fused MLP, see `lmbp_convert.nn.gated_mlp`), nn.Identity, a norm (timm SwiGLU's inner ``norm``), and a dtype
cast to the down projection's weight dtype (T5 / UMT5 keep ``wo`` in fp32); the post-down chain is Dropout /
Identity (timm's ``drop2``). The module is replaced by ``MSGatedMLP`` over the same submodules (same names, same
state_dict keys), which saves only the gate and up outputs of the product. A module that looks gated (one
activation whose output is multiplied into what reaches a Linear) but cannot be fused is reported with why.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple

import torch

from ..catalogue import class_key
from ..reasons import Reason, ReasonCode
from ..enums import GATED_ACT_KINDS, Layout
from ..trace.graph import Node, Callee, ScopeCall
from .commute import is_metadata, op_short
from .context import MatchContext, tensor_bytes
from .plan import GatedMLPSwap, Skip
from .projection import is_projection_node
from .roles import ModuleRole, user_hooks

FUSED_ACTS = GATED_ACT_KINDS  # what the fused op computes (one list, shared with ops.gated_mlp)

#: modules walked through between the product and the down projection (run inside the fused MLP)
PRE_DOWN_ROLES = (ModuleRole.DROPOUT, ModuleRole.IDENTITY, ModuleRole.NORM)
#: modules walked through after the down projection
POST_DOWN_ROLES = (ModuleRole.DROPOUT, ModuleRole.IDENTITY)
#: tensor methods that only change the dtype
CAST_OPS = ("to", "type", "float", "half", "bfloat16", "double")
_MULS = ("mul", "__mul__", "__rmul__")


def match_gated_mlps(ctx: MatchContext) -> Iterator[GatedMLPSwap | Skip]:
    """The matcher (declared in `lmbp_convert.rewrites`)."""
    if ctx.opt.gated_mlp:
        for swap, skip in find_gated_mlps(ctx):
            yield swap if swap is not None else skip


def find_gated_mlps(ctx: MatchContext) -> Iterator[tuple[GatedMLPSwap | None, Skip | None]]:
    g = ctx.g
    inside: dict[int, list] = {}
    for node in g.nodes:
        if node.scopes and not is_metadata(node):
            inside.setdefault(node.scopes[-1], []).append(node)
    children: dict[int, list[ScopeCall]] = {}
    for sc in g.scopes:
        if sc.parent is not None:
            children.setdefault(sc.parent, []).append(sc)
    for sc in g.scopes:
        nodes = inside.get(sc.idx, [])
        mods = [n for n in nodes if n.callee is Callee.MODULE]
        acts = [n for n in mods if ctx.roles.get(n.target) and ctx.roles[n.target].plays is ModuleRole.ACTIVATION]
        if not sc.module or not ctx.opt.selected(sc.module):
            continue
        if not acts:
            reason = _unknown_gate(ctx, sc, nodes, mods, children.get(sc.idx, []))
            if reason:
                yield None, Skip(sc.module, class_key(ctx.modules[sc.module]), Reason(ReasonCode.GATED_MLP, reason))
            continue
        if len(acts) != 1:
            continue
        swap_or_reason = _match(ctx, sc, nodes, acts[0], children.get(sc.idx, []))
        if isinstance(swap_or_reason, GatedMLPSwap):
            yield swap_or_reason, None
        elif swap_or_reason:
            yield None, Skip(sc.module, class_key(ctx.modules[sc.module]),
                             Reason(ReasonCode.GATED_MLP, swap_or_reason))


def _unknown_gate(ctx, sc, nodes, mods, kids: list[ScopeCall]) -> str | None:
    """Why a module gated by something that is no catalogued activation (GLU's sigmoid) is not fused, or None
    when no submodule's output is multiplied into what reaches a Linear."""
    calls = [n for n in mods if ctx.roles.get(n.target) and ctx.roles[n.target].plays is ModuleRole.OTHER]
    for child in kids:  # submodules without a role are walked into by the tracer: their calls
        if child.module in ctx.modules:
            calls.append(Node(-1, Callee.MODULE, child.module, list(child.args), list(child.outputs), ()))
    for node in calls:
        if len(node.inputs) != 1 or len(node.outputs) != 1:
            continue
        if isinstance(_tail(ctx, sc, nodes, node, kids), (_Tail, str)):
            return (f"gated MLP with {type(ctx.modules[node.target]).__name__} ({node.target}) as its activation "
                    f"has no fused op (fused: {', '.join(FUSED_ACTS)})")
    return None


class _Tail(NamedTuple):
    """From the product to the module output: mul → pre-down chain → down → post-down chain."""

    mul: Node
    pre: list  # Nodes: modules of PRE_DOWN_ROLES, then cast ops
    down: Node
    post: list  # Nodes: modules of POST_DOWN_ROLES
    post_problem: str | None  # why down's output does not reach the module output through them


class _Shape(NamedTuple):
    """A module call whose data flow is act(gate(x))·up(x) → down (or gate_up(x).chunk(2) for gate and up)."""

    projections: dict  # "gate", "up" or "gate_up" → its Linear node
    tail: _Tail
    gate_first: bool


def _match(ctx, sc, nodes, act, kids: list[ScopeCall]) -> GatedMLPSwap | str | None:
    """The swap, a reason it cannot be converted, or None when the scope is not a gated MLP at all."""
    tail = _tail(ctx, sc, nodes, act, kids)
    if not isinstance(tail, _Tail):
        return tail
    shape = _gated_shape(ctx, sc, nodes, act, tail, sorted({k.module for k in kids}))
    if isinstance(shape, str):
        return shape
    attrs = _attributes(ctx, sc, act, shape)
    if isinstance(attrs, str):
        return attrs
    saved = 2 * tensor_bytes(ctx.g, act.inputs[0])[1]  # act(g) and act(g)·u are no longer kept
    module = ctx.modules[sc.module]
    return GatedMLPSwap(
        name=sc.module, cls=class_key(module), act=ctx.roles[act.target].act, act_module=act.target,
        gate=attrs.get("gate"), up=attrs.get("up"), gate_up=attrs.get("gate_up"), down=attrs["down"],
        gate_first=shape.gate_first, predicted_saved_bytes=saved,
        pre_down=[attrs[f"pre:{n.target}"] for n in tail.pre if n.callee is Callee.MODULE],
        post_down=[attrs[f"post:{n.target}"] for n in tail.post],
        cast_to_down=any(n.callee is Callee.OP for n in tail.pre),
    )


def _only_consumer(ctx, sc, tid: int) -> Node | str | None:
    """The one node consuming ``tid`` inside the call ``sc``: a node of its own, or the name of the submodule
    call (a container the tracer walked into) that consumes it; None when there are none or several."""
    cons = [n for n in ctx.g.consumers(tid) if not is_metadata(n) and sc.idx in n.scopes]
    if len(cons) != 1:
        return None
    node = cons[0]
    if node.scopes[-1] == sc.idx:
        return node
    child = ctx.g.scopes[node.scopes[node.scopes.index(sc.idx) + 1]]
    return child.module


def _role(ctx, node: Node):
    return ctx.roles.get(node.target) if node.callee is Callee.MODULE else None


def _describe(node: Node) -> str:
    return node.target if node.callee is Callee.MODULE else f"op {op_short(node)}"


def _tail(ctx, sc, nodes, act, kids: list[ScopeCall]) -> _Tail | str | None:
    """The product's way to the module output, a reason when it looks gated but is not fusible, or None when
    the activation's output is not multiplied into something that reaches a Linear (not a gated MLP)."""
    mul = _only_consumer(ctx, sc, act.outputs[0])
    if not isinstance(mul, Node) or mul.callee is not Callee.OP or op_short(mul) not in _MULS or len(mul.inputs) != 2:
        return None
    pre, t, blocker = [], mul.outputs[0], None
    for _ in range(len(nodes) + len(ctx.g.scopes)):
        node = _only_consumer(ctx, sc, t)
        if isinstance(node, str):  # a submodule the tracer walked into: look past it for the down projection
            child = next((c for c in kids if c.module == node and t in c.args), None)
            if child is None or len(child.outputs) != 1 or len(child.args) != 1:
                return None
            blocker = blocker or node
            t = child.outputs[0]
            continue
        if node is None or len(node.outputs) != 1:
            return None
        if is_projection_node(ctx, node):  # a Linear, or a projection-like module (quantized, LoRA over one)
            down = node
            break
        if not _walkable_pre(ctx, node, pre):
            if len(node.inputs) != 1:  # not a unary step on the product: no longer the MLP's hidden path
                return None
            blocker = blocker or node
        pre.append(node)
        t = node.outputs[0]
    else:
        return None
    if blocker is not None:
        what = blocker if isinstance(blocker, str) else _describe(blocker)
        return (f"gated MLP with {what} between the product and the down projection "
                f"{down.target}: only Dropout, Identity, a norm and a cast to the down projection's dtype are "
                f"run inside the fused op")
    post, t = [], down.outputs[0]
    while sc.outputs != [t]:
        node = _only_consumer(ctx, sc, t)
        role = _role(ctx, node) if isinstance(node, Node) else None
        if role is None or role.plays not in POST_DOWN_ROLES:
            what = ("is used more than once, or outside the module," if node is None else f"feeds {node}" if isinstance(node, str)
                    else f"feeds {_describe(node)}")
            return _Tail(mul, pre, down, post, f"gated MLP whose down projection's output ({down.target}) {what}, "
                                               "not the module's output")
        post.append(node)
        t = node.outputs[0]
    return _Tail(mul, pre, down, post, None)


def _walkable_pre(ctx, node: Node, pre: list) -> bool:
    """Whether ``node`` may sit between the product and the down projection: a module of PRE_DOWN_ROLES (none
    after a cast: the cast is replayed right before the down projection) or a dtype-only cast."""
    role = _role(ctx, node)
    if role is not None:
        return role.plays in PRE_DOWN_ROLES and not any(n.callee is Callee.OP for n in pre)
    return node.callee is Callee.OP and _is_cast(node)


def _is_cast(node: Node) -> bool:
    if op_short(node) not in CAST_OPS:
        return False
    args, kwargs = node.info.get("args", ()), node.info.get("kwargs", {})
    others = [a for a in args[1:]] + [v for k, v in kwargs.items() if k == "dtype"]
    extra = set(kwargs) - {"dtype", "non_blocking", "copy"}
    return not extra and all(_is_dtype(a) for a in others)


def _is_dtype(a) -> bool:
    return isinstance(a, torch.dtype) or (isinstance(a, str) and a.startswith("torch.") and
                                          isinstance(getattr(torch, a[6:], None), torch.dtype))


def _gated_shape(ctx, sc, nodes, act, tail: _Tail, child_scopes: list[str]) -> _Shape | str:
    mods = [n for n in nodes if n.callee is Callee.MODULE]
    ops = [n for n in nodes if n.callee is Callee.OP]
    producers = {o: n for n in nodes for o in n.outputs}
    mul = tail.mul
    linears = [n for n in mods if is_projection_node(ctx, n)]
    other = next(t for t in mul.inputs if t != act.outputs[0])
    found = _projections(ctx.g, producers, linears, producers.get(act.inputs[0]), producers.get(other), act)
    if found is None:
        src = [producers.get(t) for t in (act.inputs[0], other)]
        gate, up = (_describe(n) if n is not None else "an input" for n in src)
        return ("gated MLP whose gate and up are not two Linear projections (or one split in two halves) of the "
                f"module's input: the gate comes from {gate}, the up side from {up}")
    projections, gate_first, extra_op = found
    if child_scopes:
        return f"gated MLP whose forward runs submodules the fused op would not run ({', '.join(child_scopes)})"
    known = {id(n) for n in (act, mul, tail.down, *tail.pre, *tail.post, *projections.values())}
    known |= {id(extra_op)} if extra_op is not None else set()
    stray = [n for n in mods + ops if id(n) not in known]
    if stray:
        return f"gated MLP whose forward also runs {_describe(stray[0])}, which the fused op would not run"
    if tail.post_problem:
        return tail.post_problem
    xs = {p.inputs[0] for p in projections.values()}
    if len(xs) != 1 or set(sc.args) != xs:
        return "gated MLP whose gate and up do not both read the module's only input"
    if tail.pre and tail.pre[-1].callee is Callee.OP:
        weight = getattr(ctx.modules[tail.down.target], "weight", None)
        want = str(weight.dtype).removeprefix("torch.") if isinstance(weight, torch.Tensor) else None
        got = str(ctx.g.tensors[tail.pre[-1].outputs[0]].dtype).removeprefix("torch.")
        if got != want:
            return f"gated MLP casting the product to {got}, not to the down projection's weight dtype {want}"
    return _Shape(projections, tail, gate_first)


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
    tail = shape.tail
    down_role = ctx.roles[tail.down.target]
    if down_role.plays is ModuleRole.LINEAR and down_role.layout is not Layout.OUT_IN:
        return f"down projection {tail.down.target} is not an nn.Linear"
    prefix = sc.module + "."
    attrs = {}
    chain = [(f"pre:{n.target}", n) for n in tail.pre if n.callee is Callee.MODULE]
    chain += [(f"post:{n.target}", n) for n in tail.post]
    for role, node in [*shape.projections.items(), ("down", tail.down), ("act", act), *chain]:
        if not node.target.startswith(prefix) or "." in node.target[len(prefix):]:
            what = role.split(":")[0] if ":" in role else f"{role} projection"
            return f"{what} {node.target} is not a direct child of {sc.module}"
        attrs[role] = node.target[len(prefix):]
    names = [v for k, v in attrs.items() if k != "act"]
    if len(set(names)) != len(names):
        return f"gated MLP that calls one of its submodules twice ({', '.join(names)})"
    return _extra_state(ctx, sc, attrs) or attrs


def _extra_state(ctx, sc, attrs: dict[str, str]) -> str | None:
    """Parameters or buffers of the MLP that the fused op (which keeps only the projections) would drop."""
    module = ctx.modules[sc.module]
    kept = {v for k, v in attrs.items() if k != "act"}
    for cname, child in module.named_children():
        if cname not in kept and cname != attrs["act"] and any(True for _ in child.parameters()):
            return f"{sc.module}.{cname} holds parameters the fused op would drop"
    if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
        return f"{sc.module} holds its own parameters or buffers"
    return None
