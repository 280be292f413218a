"""Functional consumers: a norm's output read by an op that applies a model *parameter* as its weight, not by an
nn.Linear module — ``F.linear(x, self.qkv.weight, cat(q_bias, k_bias, v_bias))`` (timm EVA / BEiT attention, MoE
routers), ``F.multi_head_attention_forward`` with ``in_proj_weight`` (nn.MultiheadAttention, nn.Transformer*),
``F.conv1d/2d/3d`` on channel-first views of the norm's output (PVT-v2's spatial reduction).

Found from the traced data flow, not from attribute names: the op's weight argument is a tensor the trace knows as
a named parameter (``Graph.params``), read by that op alone; its bias is a named parameter or buffer, or a
concatenation of such along the output dim (the pieces each take their rows of W·β). A convolution takes the fold
only when every output reads real input positions (no padding) unless the norm has no shift.

The norm becomes a `ConsumerFold`: a `NormFold` (its Linear targets and re-apply sites as usual) plus
`ParamTarget`s, the rows of a parameter the affine folds into (fold maths: ``fold.fold_weight_rows``,
``fold.rows_shift``, ``fold.add_shift``, ``fold.fold_conv_input``).

Reuse (e.g. an MoE router that calls F.linear on its own weight): `param_consumer(ctx, reader, beta)` turns one
walk reader into `ParamTarget`s or says why not; `take_param_consumers(ctx, nr, beta)` is the ``take`` callback of
`match.norm.plan_norm`.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..catalogue import class_key
from ..trace.graph import Node, NodeKind
from .commute import is_metadata, op_short
from .context import MatchContext
from .norm import Reader, Refused, Walk, _adopt_prefolded, _own_weight_use, plan_norm
from .plan import NormFold, Skip, register_item
from .roles import NormRole, Role, RoleKind

_LINEAR_ARGS = ("input", "weight", "bias")
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_MHA_ARGS = tuple(inspect.signature(F.multi_head_attention_forward).parameters)
_MHA_SLOTS = ("query", "key", "value")


class Problem(str):
    """Why a functional consumer cannot take the fold (a str, told apart from a parameter name)."""


@dataclass
class BiasPart:
    """Output rows [start, stop) of an op's bias come from the 1-D parameter or buffer ``tensor``."""

    tensor: str
    start: int
    stop: int
    parameter: bool = True  # False: a buffer (``persistent``: saved in the state dict)
    persistent: bool = True


@dataclass
class ParamTarget:
    """Rows [rows[0], rows[1]) (all: None) of the parameter ``weight`` read the norm's output through ``op``: the
    norm's γ folds into them; its β into the ``bias`` parts covering those rows (W·β, or Σ_k W·β for a conv)."""

    weight: str
    op: str  # "linear", "multi_head_attention_forward", "conv2d", ...
    scope: str  # the module the call runs in (the report)
    rows: list[int] | None = None
    bias: list[BiasPart] = field(default_factory=list)
    conv: bool = False

    def __post_init__(self) -> None:
        self.bias = [BiasPart(**b) if isinstance(b, dict) else b for b in self.bias]

    def describe(self) -> str:
        rows = f"[{self.rows[0]}:{self.rows[1]}]" if self.rows else ""
        parts = f" (+β into {', '.join(b.tensor for b in self.bias)})" if self.bias else ""
        return f"{self.weight}{rows} via {self.op} in {self.scope}{parts}"


@register_item
@dataclass
class ConsumerFold(NormFold):
    """A norm fold some of whose consumers are functional ops on parameters (`ParamTarget`), besides any Linear
    targets and re-apply sites of an ordinary `NormFold`."""

    tag = "consumer_folds"
    noun = "norms into functional consumers"
    heading = "norms → memory-sharing (affine folded into parameters used by functional ops)"
    counted_when_none = False

    params: list[ParamTarget] = field(default_factory=list)
    channel_dim: int = -1  # 1: a channel-first norm (NCHW), swapped for its channel-first memory-sharing form

    def describe(self) -> list[str]:
        lines = super().describe()
        if self.params:
            lines[0] = lines[0].rstrip(" →") + (" and" if self.targets else " →")
        if self.channel_dim != -1:
            lines[0] = lines[0].replace("] ", f", channels at dim {self.channel_dim}] ", 1)
        notes = [f"      note: part of β went into {b}, a buffer the state dict does not hold (kept by this model; a "
                 "plain export refuses it)" for b in self.buffer_notes()] if self.has_bias else []
        return lines[:1] + [f"      into {p.describe()}" for p in self.params] + lines[1:] + notes

    def buffer_notes(self) -> list[str]:
        """Buffers not saved in the state dict that take a part of β (a plain checkpoint cannot hold the fold)."""
        return [b.tensor for p in self.params for b in p.bias if not b.parameter and not b.persistent]

    @classmethod
    def from_dict(cls, data: dict) -> "ConsumerFold":
        d = dict(data)
        params = [ParamTarget(**p) for p in d.pop("params", [])]
        item = NormFold.from_dict.__func__(cls, d)
        item.params = params
        return item


# -- matcher ---------------------------------------------------------------------------------------------------
def match_consumer_folds(ctx: MatchContext) -> Iterator[ConsumerFold | Skip]:
    """Norms with at least one functional consumer. A norm without any is left to `match.norm.match_norms`; one
    whose functional consumer cannot take the fold is skipped here with that reason (and claimed, so the norm
    matcher does not report it a second time)."""
    if not ctx.opt.norms:
        return
    for name, role in ctx.roles.items():
        mod = ctx.modules.get(name)
        if (mod is None or name in ctx.claimed or not ctx.opt.selected(name) or role.problem
                or role.kind is not RoleKind.NORM or not role.norm.affine):
            continue
        nr = role.norm
        beta = mod.bias if nr.has_bias else None
        taker = _Taker(ctx, nr, beta)
        try:
            fold = plan_norm(ctx, name, mod, nr, taker)
        except Refused as why:
            if taker.found or taker.problems or nr.channel_dim != -1:
                ctx.claimed.add(name)
                could = [f"the fold could go into {', '.join(t.describe() for t in taker.found)}, but not into every "
                         "consumer"] if taker.found else []
                yield Skip(name, class_key(mod), "; ".join(dict.fromkeys(taker.problems + [str(why)] + could)))
            continue
        if taker.problems:
            ctx.claimed.add(name)
            yield Skip(name, class_key(mod), "; ".join(dict.fromkeys(taker.problems)))
            continue
        if not taker.found and nr.channel_dim == -1:
            continue  # an ordinary norm fold: match_norms plans it
        fold = _adopt_prefolded(ctx, fold)
        fields = {k: v for k, v in fold.__dict__.items()}
        yield ConsumerFold(**fields, params=[] if fold.prefolded else taker.found, channel_dim=nr.channel_dim)


class _Taker:
    """The ``take`` callback of `plan_norm`: moves the functional consumers out of the walk's other readers."""

    def __init__(self, ctx: MatchContext, nr: NormRole, beta: torch.Tensor | None):
        self.ctx, self.nr, self.beta = ctx, nr, beta
        self.found: list[ParamTarget] = []
        self.problems: list[str] = []

    def __call__(self, walk: Walk) -> int:
        keep = []
        for r in walk.others:
            got = param_consumer(self.ctx, r, self.nr.shape[0], self.beta)
            if got is None:
                keep.append(r)
            elif isinstance(got, str):
                self.problems.append(got)
                keep.append(r)
            else:
                self.found += got
                walk.active_scopes.update(r.node.scopes)  # no re-apply site may enclose it
                own = _own_weight_use(self.ctx, r.node, self.nr.shape[0])  # "not an nn.Linear": it now is a target
                walk.blocks = [b for b in walk.blocks if b != own]
                walk.opaque = [b for b in walk.opaque if b != own]
        walk.others = keep
        return len(self.found)


take_param_consumers = _Taker  # the public name: ``plan_norm(ctx, name, mod, nr, take_param_consumers(...))``


# -- one reader → parameter targets ------------------------------------------------------------------------------
def param_consumer(ctx: MatchContext, reader: Reader, d: int, beta: torch.Tensor | None
                   ) -> list[ParamTarget] | str | None:
    """The parameter rows a functional op reading the norm's output applies (None: the reader is no such op;
    a string: it is one, but cannot take the fold, and why)."""
    node = reader.node
    if node is None or node.kind is not NodeKind.OP:
        return None
    short = op_short(node)
    if short == "linear":
        return _linear(ctx, node, reader, d, beta)
    if short in ("conv1d", "conv2d", "conv3d"):
        return _conv(ctx, node, reader, d, beta)
    if short == "multi_head_attention_forward":
        return _mha(ctx, node, reader, d, beta)
    return None


def _bind(node: Node, names: tuple[str, ...]) -> dict:
    args = dict(zip(names, node.info.get("args", ())))
    args.update(node.info.get("kwargs", {}))
    return args


def _tid(summary) -> int | None:
    return summary[1] if isinstance(summary, tuple) and len(summary) == 2 and summary[0] == "T" else None


def _nonzero(beta: torch.Tensor | None) -> bool:
    return beta is not None and (beta.device.type == "meta" or bool(beta.detach().ne(0).any()))


def _linear(ctx: MatchContext, node: Node, reader: Reader, d: int, beta) -> list[ParamTarget] | str | None:
    a = _bind(node, _LINEAR_ARGS)
    if _tid(a.get("input")) != reader.tid:
        return None
    if reader.axis != len(ctx.g.tensors[reader.tid].shape) - 1:
        return None
    return _weight_and_bias(ctx, node, a, d, f"linear in {ctx.scope_name(node)}", beta, "linear", 2)


def _conv(ctx: MatchContext, node: Node, reader: Reader, d: int, beta) -> list[ParamTarget] | str | None:
    a = _bind(node, _CONV_ARGS)
    if _tid(a.get("input")) != reader.tid:
        return None
    if reader.axis != 1:
        return None
    where = f"{op_short(node)} in {ctx.scope_name(node)}"
    if a.get("groups", 1) not in (1, None):
        return f"{where} is grouped (groups={a['groups']}): its input channels are not all summed"
    pad = a.get("padding", 0)
    padded = pad not in ("valid", 0, None) and not (isinstance(pad, tuple) and not any(pad))
    if padded and _nonzero(beta):
        return (f"{where} pads its input (padding={pad}): padded positions would see 0 instead of the norm's β, so "
                "β cannot fold into its bias")
    return _weight_and_bias(ctx, node, a, d, where, beta, op_short(node), int(op_short(node)[-2]) + 2, conv=True)


def _weight_and_bias(ctx: MatchContext, node: Node, a: dict, d: int, where: str, beta, op: str, dims: int, *,
                     conv: bool = False) -> list[ParamTarget] | str:
    """The target of an op applying a named weight (``dims``-D, ``d`` input channels) and a bias of named parts to
    the norm's output, or why not."""
    weight = _weight(ctx, node, a.get("weight"), d, where, dims=dims)
    if isinstance(weight, Problem):
        return str(weight)
    out = ctx.g.tensors[_tid(a["weight"])].shape[0]
    parts = _bias_parts(ctx, node, a.get("bias"), out, where, beta)
    if isinstance(parts, str):
        return parts
    return [ParamTarget(weight, op, ctx.scope_name(node), None, parts, conv=conv)]


def _mha(ctx: MatchContext, node: Node, reader: Reader, d: int, beta) -> list[ParamTarget] | str | None:
    a = _bind(node, _MHA_ARGS)
    slots = [i for i, s in enumerate(_MHA_SLOTS) if _tid(a.get(s)) == reader.tid]
    if not slots or reader.axis != len(ctx.g.tensors[reader.tid].shape) - 1:
        return None
    where = f"multi_head_attention_forward in {ctx.scope_name(node)}"
    if any(a.get(f"static_{_MHA_SLOTS[i][0]}") is not None for i in slots if i):
        return f"{where} uses a static key/value instead of projecting its input"
    if a.get("use_separate_proj_weight"):
        return f"{where} uses separate q/k/v projection weights (kdim or vdim ≠ embed_dim): not folded"
    e = a.get("embed_dim_to_check")
    found = []
    for i in slots:
        rows = [i * e, (i + 1) * e]
        weight = _weight(ctx, node, a.get("in_proj_weight"), d, where, dims=2)
        if isinstance(weight, Problem):
            return str(weight)
        parts = _bias_parts(ctx, node, a.get("in_proj_bias"), 3 * e, where, beta, rows=rows)
        if isinstance(parts, str):
            return parts
        found.append(ParamTarget(weight, "multi_head_attention_forward", ctx.scope_name(node), rows, parts))
    return found


def _weight(ctx: MatchContext, node: Node, summary, d: int, where: str, dims: int) -> str:
    """The qualified name of the weight parameter an op applies, or a `Problem`: why the fold cannot go into it."""
    tid = _tid(summary)
    name = ctx.g.params.get(tid) if tid is not None else None
    if name is None:
        return Problem(f"{where} applies a weight computed in forward, not a parameter: the fold cannot go into it")
    param = _named(ctx, name)
    if not isinstance(param, nn.Parameter) or not param.is_floating_point():
        return Problem(f"{where} applies {name}, which is not a floating-point parameter")
    if param.dim() != dims or param.shape[1] != d:
        return Problem(f"{where} applies {name} of shape {tuple(param.shape)}, which does not take the norm's {d} "
                       "channels")
    owners = ctx.param_owners.get(id(param), [])
    if len(owners) > 1:
        return Problem(f"{where} applies {name}, which is tied to {', '.join(o for o in owners if o != name)}")
    problem = _other_uses(ctx, node, tid, name, where)
    if problem:
        return Problem(problem)
    owner = name.rpartition(".")[0]
    if ctx.opt.excluded(owner):
        return Problem(f"{owner} is excluded by the options")
    return name


def _other_uses(ctx: MatchContext, node: Node, tid: int, name: str, where: str) -> str | None:
    """A parameter used elsewhere as well (another op, or a leaf module that owns it and runs) would see the
    fold there too."""
    others = [c for c in ctx.g.consumers(tid) if c is not node and not is_metadata(c)]
    if others:
        return f"{where}: {name} is also used by {op_short(others[0])} in {ctx.scope_name(others[0])}"
    owner = name.rsplit(".", 1)[0] if "." in name else ""
    role = ctx.roles.get(owner, Role(RoleKind.OTHER))
    if role.kind is not RoleKind.OTHER and ctx.g.module_calls.get(owner, 0):
        return f"{where}: {name} is also used by its module {owner}, which runs in the forward"
    return None


def _named(ctx: MatchContext, name: str) -> torch.Tensor | None:
    owner, _, attr = name.rpartition(".")
    mod = ctx.modules.get(owner)
    return getattr(mod, attr, None) if mod is not None else None


def _bias_parts(ctx: MatchContext, node: Node, summary, out: int, where: str, beta,
                rows: list[int] | None = None) -> list[BiasPart] | str:
    """Where the norm's β goes: the bias the op adds, as pieces of named tensors covering rows ``rows`` of the
    output (a named parameter/buffer, or a concatenation of them made in forward). [] when β is zero; a string
    when β is not zero but no named tensor can take it."""
    if not _nonzero(beta):
        return []
    tid = _tid(summary)
    if tid is None:
        return f"{where} adds no bias, so the norm's β has nowhere to go"
    pieces = _pieces(ctx, node, tid)
    if isinstance(pieces, str):
        return f"{where}: {pieces}"
    a, b = rows if rows is not None else (0, out)
    found, pos = [], 0
    for name, n in pieces:
        if pos < b and pos + n > a:
            t = _named(ctx, name)
            is_param = isinstance(t, nn.Parameter)
            mod = ctx.modules[name.rpartition(".")[0]]
            persistent = is_param or name.rpartition(".")[2] not in mod._non_persistent_buffers_set
            if not t.is_floating_point():
                return f"{where}: its bias piece {name} cannot take the norm's β ({t.dtype})"
            found.append(BiasPart(name, pos, pos + n, is_param, persistent))
        pos += n
    if pos != out:
        return f"{where}: its bias has {pos} entries for {out} outputs"
    return found


def _pieces(ctx: MatchContext, node: Node, tid: int) -> list[tuple[str, int]] | str:
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

