"""Functional consumers: ops that apply a model *parameter* to a norm's output themselves, not an nn.Linear module.
One table (`CONSUMERS`) says, per op, what the fold can go into; the norm walker (`match.norm`) asks it for every op
reading the norm's channels, and the first rule that recognises the op answers (`read_by`):

- **whole parameter** (``linear``, ``mm``/``bmm``/``matmul``, ``grouped_mm``): an MoE router's
  ``F.linear(x, self.weight)``; experts stored as one parameter per projection (transformers ≥ 5: ``gate_up_proj``
  [experts, 2·inter, hidden], or transposed), applied to their routed rows through ``F.linear(rows, P[e])`` in a
  loop, ``bmm(P[ids], rows)`` or ``grouped_mm(rows, P.transpose(-2, -1), offs)``. The weight operand is traced
  back through expert selection (indexing the leading dim), transposes and casts to the parameter, which tells
  which of its dims the channels are contracted with; the fold goes into that whole parameter — every expert,
  routed on the probe or not — as a `LinearTarget` (``through_op``) of the plain `NormFold`. Exact only if *every*
  use of the parameter reads this norm's output (`unknown_uses`, after the walk). β would need a bias inside the
  op: refused.
- **rows and biases** (``linear`` with a bias, ``multi_head_attention_forward``, ``conv1d/2d/3d``): timm EVA /
  BEiT's ``F.linear(x, self.qkv.weight, cat(q_bias, k_bias, v_bias))``, nn.MultiheadAttention's ``in_proj``
  rows of the inputs the norm feeds, an un-padded convolution on a channel-first view (PVT-v2's spatial
  reduction). The weight is a named parameter read by that op alone; the bias a named parameter or buffer, or
  a concatenation of such along the output dim (each piece takes its rows of W·β). These are `ParamTarget`s,
  which make the norm a `ConsumerFold` (`match.consumers`); the walk takes them only when that matcher asks.

A rule answers with its targets, with why the fold cannot go into the op (a `Reason`), or None: not its op. A
whole-parameter rule's reasons also block the way in (the norm's skip names them first). A new functional consumer
is one more `ConsumerRule` in the table (`register_consumer`).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..deprecation import module_renames
from ..enums import Layout
from ..reasons import Reason, ReasonCode
from ..trace.graph import Graph, Node, Callee
from .commute import is_metadata, node_arg, op_short
from .plan import BiasPart, LinearTarget, ParamTarget
from .readers import At, end_readers
from .roles import Role, ModuleRole

if TYPE_CHECKING:
    from .context import MatchContext


@dataclass
class Reading:
    """One op reading the norm's channels (on ``axis`` of tensor ``tid``), and what the walk knows there."""

    ctx: "MatchContext"
    node: Node
    tid: int
    axis: int
    d: int  # the norm's channels
    has_beta: bool  # the norm has a shift
    beta: torch.Tensor | None  # ... and its value, where the walk knows it (the row/bias rules need it)
    via: list[str]  # the commuting ops on the way


@dataclass
class ParamUse:
    """One op applying the whole parameter ``param`` (qualified name) to the norm's channels."""

    param: str
    module: str  # its owner
    attr: str  # its attribute there
    contracted: int  # the parameter's dim contracted with the channels (-1: [..., out, in]; -2: [..., in, out])
    node: int  # the op's index in the graph
    via: list[str] = field(default_factory=list)

    def target(self) -> LinearTarget:
        layout = Layout.OUT_IN if self.contracted == -1 else Layout.IN_OUT
        return LinearTarget(self.module, layout, list(self.via), weight=self.attr, through_op=True)


Found = ParamUse | list[ParamTarget] | Reason | None


@dataclass(frozen=True)
class ConsumerRule:
    """One rule of the consumer table, for a family of functional consumers: the ops it recognises, and what it makes of one (`Found`). ``rows``: its
    targets are `ParamTarget`s (a `ConsumerFold`); else a whole parameter (`ParamUse`, a plain `NormFold`), whose
    reasons block the way (the op applies the parameter the fold would have to enter)."""

    name: str
    ops: frozenset[str]
    find: Callable[[Reading], Found]
    rows: bool


#: the consumer table, in the order its rules are tried
CONSUMERS: list[ConsumerRule] = []


def register_consumer(rule: ConsumerRule) -> ConsumerRule:
    CONSUMERS.append(rule)
    return rule


@dataclass
class Verdict:
    """What the table says about one op: a whole-parameter use, parameter rows, or the reasons of the rules that
    recognised it (none: no functional consumer) — ``blocked`` those of whole-parameter rules, ``problems`` the
    others'."""

    use: ParamUse | None = None
    params: list[ParamTarget] = field(default_factory=list)
    problems: list[Reason] = field(default_factory=list)
    blocked: list[Reason] = field(default_factory=list)


def read_by(reading: Reading, rows: bool) -> Verdict:
    """Ask the table's rules in order (``rows``: the row/bias rules too); the first that takes the op answers."""
    verdict = Verdict()
    short = op_short(reading.node)
    for rule in CONSUMERS:
        if short not in rule.ops or (rule.rows and not rows):
            continue
        got = rule.find(reading)
        if isinstance(got, ParamUse):
            return Verdict(use=got)
        if isinstance(got, list):
            return Verdict(params=got)
        if got is not None:
            (verdict.problems if rule.rows else verdict.blocked).append(got)
    return verdict


def _problem(text: str) -> Reason:
    return Reason(ReasonCode.FUNCTIONAL_CONSUMER, text)


# -- small helpers on traced arguments -----------------------------------------------------------------------------
def _tid(a) -> int | None:
    return a[1] if isinstance(a, tuple) and len(a) == 2 and a[0] == "T" else None


def _bind(node: Node, names: tuple[str, ...]) -> dict:
    args = dict(zip(names, node.info.get("args", ())))
    args.update(node.info.get("kwargs", {}))
    return args


def _named(ctx: "MatchContext", name: str) -> torch.Tensor | None:
    owner, _, attr = name.rpartition(".")
    mod = ctx.modules.get(owner)
    return getattr(mod, attr, None) if mod is not None else None


# -- whole parameters (MoE routers and experts) ----------------------------------------------------------------------
#: ops that hand a weight on unchanged except for selecting experts (its leading dims), its dtype or its layout
_CASTS = {"to", "contiguous", "clone", "float", "half", "bfloat16", "type", "detach"}
_TRANSPOSES = {"transpose", "swapaxes", "swapdims"}
_HANDS_ON = _CASTS | _TRANSPOSES | {"t", "__getitem__", "index_select"}
#: the ops `weight_operand` knows: a weight applied to a data operand
WEIGHT_OPERAND_OPS = frozenset({"linear", "grouped_mm", "_grouped_mm", "mm", "bmm", "matmul", "__matmul__"})


def weight_operand(g: Graph, node: Node, tid: int, axis: int) -> tuple[int, int] | None:
    """(the weight operand's tensor id, its dim contracted with the channels) when tensor ``tid`` with the norm's
    channels at ``axis`` is the data operand of the weight op ``node``; None otherwise."""
    op, ndim = op_short(node), len(g.tensors[tid].shape)
    last = axis == ndim - 1
    first, second = _tid(node_arg(node, 0, "input")), _tid(node_arg(node, 1, "weight"))
    if op == "linear":
        return (second, -1) if first == tid and last and second is not None and second != tid else None
    if op in ("grouped_mm", "_grouped_mm"):
        first, second = _tid(node_arg(node, 0, "mat_a")), _tid(node_arg(node, 1, "mat_b"))
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
        src = _tid(args[0]) if args else None
        if node.callee is not Callee.OP or src is None or len(node.outputs) != 1:
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


def _whole_parameter(r: Reading) -> ParamUse | Reason | None:
    found = weight_operand(r.ctx.g, r.node, r.tid, r.axis)
    traced = trace_to_param(r.ctx.g, *found) if found is not None else None
    if traced is None:
        return None
    ptid, contracted = traced
    info = r.ctx.g.tensors[ptid]
    if info.shape[contracted] != r.d:
        return None
    module, _, attr = info.param.rpartition(".")
    use = ParamUse(info.param, module, attr, contracted, r.node.idx, r.via)
    problem = _whole_problem(r.ctx, use, r.has_beta)
    return problem if problem is not None else use


def _whole_problem(ctx: "MatchContext", use: ParamUse, has_beta: bool) -> Reason | None:
    """Why the fold cannot go into this parameter (None: it can)."""
    mod = ctx.modules.get(use.module)
    p = getattr(mod, use.attr, None) if mod is not None else None
    op = op_short(ctx.g.nodes[use.node])
    if p is None or not p.is_floating_point():
        return Reason(ReasonCode.WEIGHTS, f"{use.param} has weights that cannot be rewritten "
                      f"({getattr(p, 'dtype', None)})", use.param)
    if has_beta:
        return Reason(ReasonCode.SHIFT, f"{use.module} ({type(mod).__name__}) applies {use.attr} {tuple(p.shape)} "
                      f"through {op}: the norm's shift β would need a bias inside that op, which folding into a "
                      "parameter does not add", use.module)
    if ctx.opt.excluded(use.module):
        return Reason(ReasonCode.EXCLUDED, f"{use.module} is excluded by the options", use.module)
    owners = ctx.param_owners.get(id(p), [])
    if len(owners) > 1:
        return Reason(ReasonCode.TIED_WEIGHT, f"{use.param} is shared with "
                      f"{', '.join(o for o in owners if o != use.param)}", use.param)
    return None


def unknown_uses(ctx: "MatchContext", uses: dict[str, set[int]]) -> Reason | None:
    """A use of a whole-parameter target that is not one of the recognised weight ops reading the norm's output
    (the parameter would be folded for a consumer of something else), or None when every use the trace saw is
    one. Checked after the walk, which is when all of them are known (an expert loop applies one parameter in
    many ops)."""
    for pname, known in uses.items():
        ptid = next((t for t, info in ctx.g.tensors.items() if info.param == pname), None)
        if ptid is None:
            continue

        def through(c: Node, at: At, known: set[int] = known) -> list[At] | None:
            if c.idx in known:
                return []
            if c.callee is Callee.OP and _tid(node_arg(c, 0, "")) == at[0] and op_short(c) in _HANDS_ON:
                return [(o, None) for o in c.outputs]
            return None

        for c, _ in end_readers(ctx.g, (ptid, None), through):
            return Reason(ReasonCode.FUNCTIONAL_CONSUMER, f"{pname} is also used by {op_short(c)} in "
                          f"{ctx.scope_name(c)}, which does not read this norm's output (folding the norm into it would "
                          "change that use)", pname)
    return None


# -- rows of a named weight and the pieces of its bias (F.linear with a bias, in_proj, convolutions) -----------------
_LINEAR_ARGS = ("input", "weight", "bias")
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_MHA_ARGS = tuple(inspect.signature(F.multi_head_attention_forward).parameters)
_MHA_SLOTS = ("query", "key", "value")


def _nonzero(beta: torch.Tensor | None) -> bool:
    return beta is not None and (beta.device.type == "meta" or bool(beta.detach().ne(0).any()))


def _linear_rows(r: Reading) -> list[ParamTarget] | Reason | None:
    a = _bind(r.node, _LINEAR_ARGS)
    if _tid(a.get("input")) != r.tid or r.axis != len(r.ctx.g.tensors[r.tid].shape) - 1:
        return None
    return _weight_and_bias(r, a, f"linear in {r.ctx.scope_name(r.node)}", "linear", 2)


def _conv(r: Reading) -> list[ParamTarget] | Reason | None:
    a = _bind(r.node, _CONV_ARGS)
    if _tid(a.get("input")) != r.tid or r.axis != 1:
        return None
    op = op_short(r.node)
    where = f"{op} in {r.ctx.scope_name(r.node)}"
    if a.get("groups", 1) not in (1, None):
        return _problem(f"{where} is grouped (groups={a['groups']}): its input channels are not all summed")
    pad = a.get("padding", 0)
    padded = pad not in ("valid", 0, None) and not (isinstance(pad, tuple) and not any(pad))
    if padded and _nonzero(r.beta):
        return _problem(f"{where} pads its input (padding={pad}): padded positions would see 0 instead of the norm's "
                       "β, so β cannot fold into its bias")
    return _weight_and_bias(r, a, where, op, int(op[-2]) + 2, conv=True)


def _weight_and_bias(r: Reading, a: dict, where: str, op: str, dims: int, *, conv: bool = False
                     ) -> list[ParamTarget] | Reason:
    """The target of an op applying a named weight (``dims``-D, ``d`` input channels) and a bias of named parts to
    the norm's output, or why not."""
    weight = _weight(r, a.get("weight"), where, dims=dims)
    if isinstance(weight, Reason):
        return weight
    out = r.ctx.g.tensors[_tid(a["weight"])].shape[0]
    parts = _bias_parts(r, a.get("bias"), out, where)
    if isinstance(parts, Reason):
        return parts
    return [ParamTarget(weight, op, r.ctx.scope_name(r.node), None, parts, conv=conv)]


def _mha(r: Reading) -> list[ParamTarget] | Reason | None:
    a = _bind(r.node, _MHA_ARGS)
    slots = [i for i, s in enumerate(_MHA_SLOTS) if _tid(a.get(s)) == r.tid]
    if not slots or r.axis != len(r.ctx.g.tensors[r.tid].shape) - 1:
        return None
    where = f"multi_head_attention_forward in {r.ctx.scope_name(r.node)}"
    if any(a.get(f"static_{_MHA_SLOTS[i][0]}") is not None for i in slots if i):
        return _problem(f"{where} uses a static key/value instead of projecting its input")
    if a.get("use_separate_proj_weight"):
        return _problem(f"{where} uses separate q/k/v projection weights (kdim or vdim ≠ embed_dim): not folded")
    weight = _weight(r, a.get("in_proj_weight"), where, dims=2)  # one in_proj_weight for q, k and v
    if isinstance(weight, Reason):
        return weight
    e = a.get("embed_dim_to_check")
    found = []
    for i in slots:
        rows = [i * e, (i + 1) * e]
        parts = _bias_parts(r, a.get("in_proj_bias"), 3 * e, where, rows=rows)
        if isinstance(parts, Reason):
            return parts
        found.append(ParamTarget(weight, "multi_head_attention_forward", r.ctx.scope_name(r.node), rows, parts))
    return found


def _weight(r: Reading, summary, where: str, dims: int) -> str | Reason:
    """The qualified name of the weight parameter an op applies, or why the fold cannot go into it."""
    ctx, tid = r.ctx, _tid(summary)
    name = ctx.g.params.get(tid) if tid is not None else None
    if name is None:
        return _problem(f"{where} applies a weight computed in forward, not a parameter: the fold cannot go into it")
    param = _named(ctx, name)
    if not isinstance(param, nn.Parameter) or not param.is_floating_point():
        return _problem(f"{where} applies {name}, which is not a floating-point parameter")
    if param.dim() != dims or param.shape[1] != r.d:
        return _problem(f"{where} applies {name} of shape {tuple(param.shape)}, which does not take the norm's {r.d} "
                       "channels")
    owners = ctx.param_owners.get(id(param), [])
    if len(owners) > 1:
        return _problem(f"{where} applies {name}, which is tied to {', '.join(o for o in owners if o != name)}")
    problem = _other_uses(ctx, r.node, tid, name, where)
    if problem:
        return _problem(problem)
    owner = name.rpartition(".")[0]
    if ctx.opt.excluded(owner):
        return _problem(f"{owner} is excluded by the options")
    return name


def _other_uses(ctx: "MatchContext", node: Node, tid: int, name: str, where: str) -> str | None:
    """A parameter used elsewhere as well (another op, or a leaf module that owns it and runs) would see the
    fold there too."""
    others = [c for c in ctx.g.consumers(tid) if c is not node and not is_metadata(c)]
    if others:
        return f"{where}: {name} is also used by {op_short(others[0])} in {ctx.scope_name(others[0])}"
    owner = name.rsplit(".", 1)[0] if "." in name else ""
    role = ctx.roles.get(owner, Role(ModuleRole.OTHER))
    if role.plays is not ModuleRole.OTHER and ctx.g.module_calls.get(owner, 0):
        return f"{where}: {name} is also used by its module {owner}, which runs in the forward"
    return None


def _bias_parts(r: Reading, summary, out: int, where: str, rows: list[int] | None = None
                ) -> list[BiasPart] | Reason:
    """Where the norm's β goes: the bias the op adds, as pieces of named tensors covering rows ``rows`` of the
    output (a named parameter/buffer, or a concatenation of them made in forward). [] when β is zero; a `Reason`
    when β is not zero but no named tensor can take it."""
    if not _nonzero(r.beta):
        return []
    ctx, tid = r.ctx, _tid(summary)
    if tid is None:
        return _problem(f"{where} adds no bias, so the norm's β has nowhere to go")
    pieces = _pieces(ctx, r.node, tid)
    if isinstance(pieces, str):
        return _problem(f"{where}: {pieces}")
    a, b = rows if rows is not None else (0, out)
    found, pos = [], 0
    for name, n in pieces:
        if pos < b and pos + n > a:
            t = _named(ctx, name)
            is_param = isinstance(t, nn.Parameter)
            mod = ctx.modules[name.rpartition(".")[0]]
            persistent = is_param or name.rpartition(".")[2] not in mod._non_persistent_buffers_set
            if not t.is_floating_point():
                return _problem(f"{where}: its bias piece {name} cannot take the norm's β ({t.dtype})")
            found.append(BiasPart(name, pos, pos + n, is_param, persistent))
        pos += n
    if pos != out:
        return _problem(f"{where}: its bias has {pos} entries for {out} outputs")
    return found


def _pieces(ctx: "MatchContext", node: Node, tid: int) -> list[tuple[str, int]] | str:
    """(name, length) of the named 1-D tensors the bias ``tid`` is, or is concatenated from (dim 0)."""
    g = ctx.g
    name = g.params.get(tid)
    if name is not None:
        other = _other_uses(ctx, node, tid, name, "")
        return f"its bias {name} is used elsewhere too{other}" if other else [(name, g.tensors[tid].shape[0])]
    prod = g.tensors[tid].producer
    cat = g.nodes[prod] if prod is not None else None
    if cat is None or op_short(cat) not in ("cat", "concat", "concatenate"):
        return "its bias is computed in forward (not a parameter or a concatenation of parameters and buffers)"
    dim = _bind(cat, ("tensors", "dim")).get("dim", 0)
    if dim not in (0, -1, None):
        return f"its bias is concatenated along dim {dim}"
    found = []
    for t in cat.inputs:
        name = g.params.get(t)
        if name is None or len(g.tensors[t].shape) != 1:
            return "its bias is concatenated from a tensor computed in forward"
        if [c for c in g.consumers(t) if c is not cat and not is_metadata(c)] or any(n == name for n, _ in found):
            return f"its bias piece {name} is used elsewhere too"
        found.append((name, g.tensors[t].shape[0]))
    return found


# -- the table ---------------------------------------------------------------------------------------------------
register_consumer(ConsumerRule("whole parameter (MoE routers and experts)", WEIGHT_OPERAND_OPS, _whole_parameter, rows=False))
register_consumer(ConsumerRule("F.linear rows and bias pieces", frozenset({"linear"}), _linear_rows, rows=True))
register_consumer(ConsumerRule("convolution on a channel-first view", frozenset({"conv1d", "conv2d", "conv3d"}), _conv, rows=True))
register_consumer(ConsumerRule("nn.MultiheadAttention in_proj rows", frozenset({"multi_head_attention_forward"}), _mha,
                   rows=True))


# 0.1.0's names of the consumer table (DeprecationWarning; lmbp_convert.deprecation)
__getattr__ = module_renames(__name__, {
    "KINDS": ("lmbp_convert.match.functional.CONSUMERS", lambda: CONSUMERS),
    "Kind": ("lmbp_convert.match.functional.ConsumerRule", lambda: ConsumerRule),
    "register_kind": ("lmbp_convert.match.functional.register_consumer", lambda: register_consumer),
})
