"""Which tensor ops commute with a per-channel affine y = γ·x + β (channels on one axis).

Pure functions over the value-free op records of the trace. ``step(node, tensor_info, axis, d)`` answers for
one op whose input carries the norm's channels on ``axis`` (size ``d``): either ``Pass(new_axis, caveat)``,
the op commutes and its output carries the channels on ``new_axis``; ``Block(reason)``, the op sits on a path
to a Linear but breaks exactness (dropout in training, zero-padding, channel mixing); or ``None``, the op is
an ordinary consumer (add, matmul, cat, ...).

``RULES`` is the table: op name → a small rule saying how the channel axis moves through that op. An op not in
the table is an ordinary consumer. Teaching the planner a new commuting op is one rule and one table entry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from ..reasons import Reason, ReasonCode
from ..trace.graph import Node, TensorInfo


@dataclass(frozen=True)
class Pass:
    axis: int
    caveat: str | None = None
    #: the op writes zeros (a constant pad): exact for a norm without β (γ·0 = 0), for one with β this is why not
    unless_beta: str | None = None


@dataclass(frozen=True)
class Block:
    reason: Reason


def _blocking(text: str) -> Reason:
    return Reason(ReasonCode.BLOCKING_OP, text)


# Ops that never look at values: ignored wherever they appear.
METADATA_OPS = {
    "size", "dim", "numel", "stride", "is_contiguous", "data_ptr", "element_size", "nelement", "ndimension",
    "get_device", "is_floating_point", "is_complex", "storage_offset", "__len__", "untyped_storage",
    # new tensors shaped like the input (an MoE block's output buffer): they read its shape and dtype only
    "zeros_like", "ones_like", "empty_like", "full_like",
}
#: same values and shape, maybe another dtype or device: channels stay where they are
_CASTS = ("to", "float", "half", "bfloat16", "double", "type", "type_as", "contiguous", "clone", "cpu", "cuda")
#: reshapes that commute when the channels are the last dim and stay whole there
_RESHAPES = ("view", "reshape", "flatten", "unflatten", "expand", "expand_as", "squeeze", "unsqueeze", "view_as",
             "reshape_as", "repeat")
#: ops that work along one dim (argument position of ``dim``): they commute unless that dim is the channel dim
_DIM_ARG_OPS = {"narrow": 1, "select": 1, "split": 2, "chunk": 2, "unbind": 1, "index_select": 1,
                "split_with_sizes": 2, "tensor_split": 2, "repeat_interleave": 2}


def op_short(node: Node) -> str:
    return node.target.rsplit(".", 1)[-1] if not node.target.endswith(".__get__") else "__get__"


def is_metadata(node: Node) -> bool:
    return node.callee == "op" and (op_short(node) in METADATA_OPS or node.target.endswith(".__get__"))


def node_arg(node: Node, pos: int, name: str, default=None):
    """Argument ``pos`` of a traced call, or its keyword ``name`` (as the trace summarises it)."""
    args = node.info.get("args", ())
    if len(args) > pos:
        return args[pos]
    return node.info.get("kwargs", {}).get(name, default)


def _norm_dims(dims, ndim: int) -> list[int] | None:
    if dims is None:
        return None
    if isinstance(dims, (list, tuple)):
        out = []
        for d in dims:
            if not isinstance(d, int):
                return None
            out.append(d % ndim)
        return out
    if isinstance(dims, int):
        return [dims % ndim]
    return None


def _index_touches_last(index, ndim: int) -> bool | None:
    """Whether a __getitem__ index selects within the last dim (None if it cannot be told)."""
    items = list(index) if isinstance(index, tuple) and not (index and index[0] in ("T", "slice")) else [index]
    consumed = 0
    for it in items:
        if it == "..." or it is None:
            continue
        consumed += 1
    if "..." in items:
        last = items[-1] if items else None
        return not (last == "..." or last is None or (isinstance(last, tuple) and last[0] == "slice" and last[1:] == (None, None, None)))
    if consumed < ndim:
        return False
    # every dim indexed: the last item is the channel index
    last = [it for it in items if it is not None][-1]
    return not (isinstance(last, tuple) and last and last[0] == "slice" and last[1:] == (None, None, None))


@dataclass(frozen=True)
class OpCall:
    """One op call as a rule sees it: the node, the followed input's shape, the op's outputs, and where the
    norm's ``d`` channels sit in that input."""

    node: Node
    name: str
    shape: tuple[int, ...]
    outs: list[TensorInfo]
    axis: int
    d: int

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def arg(self, pos: int, name: str, default=None):
        return node_arg(self.node, pos, name, default)


Step = Union[Pass, Block, None]
Rule = Callable[[OpCall], Step]


def _dropout(op: OpCall) -> Step:
    p = op.arg(1, "p", 0.5)
    return Pass(op.axis) if p == 0 else Block(_blocking(f"dropout (p={p}) between norm and Linear"))


def _cast(op: OpCall) -> Step:
    return Pass(op.axis) if op.outs[0].shape == op.shape else None


def _permuted(op: OpCall, perm: list[int] | None) -> Step:
    """Channels follow a permutation of the dims (output dim i is input dim perm[i])."""
    if perm is None or len(perm) != op.ndim:
        return None
    new_axis = perm.index(op.axis)
    return Pass(new_axis) if op.outs[0].shape[new_axis] == op.d else None


def _t(op: OpCall) -> Step:
    return _permuted(op, list(range(op.ndim))[::-1])


def _permute(op: OpCall) -> Step:
    perm = op.arg(1, "dims")
    if isinstance(perm, tuple) and len(perm) == 1 and isinstance(perm[0], tuple):
        perm = perm[0]
    if not isinstance(perm, tuple) or len(op.node.info["args"]) > 2:  # x.permute(0, 2, 1): dims as varargs
        perm = tuple(a for a in op.node.info["args"][1:])
    return _permuted(op, _norm_dims(perm, op.ndim))


def _movedim(op: OpCall) -> Step:
    src, dst = _norm_dims(op.arg(1, "source"), op.ndim), _norm_dims(op.arg(2, "destination"), op.ndim)
    if src is None or dst is None:
        return None
    order = [i for i in range(op.ndim) if i not in src]
    perm: list = [None] * op.ndim
    for s_, t_ in zip(src, dst):
        perm[t_] = s_
    it = iter(order)
    return _permuted(op, [p if p is not None else next(it) for p in perm])


def _transpose(op: OpCall) -> Step:
    a, b = _norm_dims(op.arg(1, "dim0"), op.ndim), _norm_dims(op.arg(2, "dim1"), op.ndim)
    if a is None or b is None:
        return None
    perm = list(range(op.ndim))
    perm[a[0]], perm[b[0]] = perm[b[0]], perm[a[0]]
    return _permuted(op, perm)


def _mean(op: OpCall) -> Step:
    """A mean over other dims (tokens) commutes with a per-channel affine; over the channels it does not."""
    dims = _norm_dims(op.arg(1, "dim"), op.ndim)
    if dims is None or op.axis in dims:
        return None
    keep = bool(op.arg(2, "keepdim", False))
    return Pass(op.axis if keep else op.axis - sum(1 for x in dims if x < op.axis))


def _pad(op: OpCall) -> Step:
    """Padding along dims other than the channels. replicate / reflect / circular copy elements within their
    channel: they commute with the affine. A constant pad writes its value where the original's Linear also sees
    it: exact for value 0 and a norm without β only (γ·0 = 0), at *every* shape, so a pad that is a no-op at the
    probe's shape (Swin's window padding) is judged like any other, not by the probe's shape."""
    if not op.node.target.endswith("functional.pad"):
        return None
    pads = op.arg(1, "pad")
    mode = op.arg(2, "mode", "constant") or "constant"
    value = op.arg(3, "value", None)
    if not isinstance(pads, tuple) or op.axis != op.ndim - 1 or len(op.outs) != 1:
        return Block(_blocking("padding between norm and Linear"))
    if any(pads[0:2]):
        return Block(_blocking("padding of channels between norm and Linear"))
    if mode != "constant":
        return Pass(op.axis)
    if value not in (None, 0, 0.0):
        return Block(_blocking(f"constant-padding with {value!r} between norm and Linear (the folded Linear would "
                               f"see γ·{value!r} + β there)"))
    where = ("a pad that is a no-op at the probe's shape pads inputs of other shapes (window padding)"
             if not any(pads) else "zero-padding")
    return Pass(op.axis, unless_beta=f"{where} between norm and Linear: padded positions hold 0 where the folded "
                                     "Linear would add its W·β")


def _last_dim_whole(op: OpCall) -> Step:
    """Channels last in, and every output still ends in the ``d`` channels: they passed through untouched."""
    if all(len(o.shape) >= 1 and o.shape[-1] == op.d for o in op.outs):
        return Pass(-1)
    return Block(_blocking(f"{op.name} reshapes the channel dim between norm and Linear"))


def _reshape(op: OpCall) -> Step:
    if op.axis != op.ndim - 1:
        return _channel_dim_kept(op)
    return _last_dim_whole(op)


def _channel_dim_kept(op: OpCall) -> Step:
    """Channels not last (a channel-first view): a view/reshape/flatten/unflatten that keeps every dim up to and
    including the channels (reshaping only the dims after them: (B, C, N) → (B, C, H, W)), or every dim from the
    channels on (reshaping only the dims before them), leaves each channel's elements in that channel."""
    if op.name not in ("view", "reshape", "flatten", "unflatten") or len(op.outs) != 1:
        return None
    out, k = op.outs[0].shape, op.axis
    if len(out) > k and tuple(out[:k + 1]) == tuple(op.shape[:k + 1]):
        return Pass(k)
    tail = op.ndim - k
    if len(out) >= tail and tuple(out[len(out) - tail:]) == tuple(op.shape[k:]):
        return Pass(len(out) - tail)
    return None


def _unsqueeze(op: OpCall) -> Step:
    """A new size-1 dim: the channels keep their values, one dim further right when it lands before them
    (``x.unsqueeze(-1)`` of a batched matmul's column vectors)."""
    dim = op.arg(1, "dim")
    if not isinstance(dim, int) or not -op.ndim - 1 <= dim <= op.ndim:
        return None
    dim %= op.ndim + 1
    new = op.axis + 1 if dim <= op.axis else op.axis
    return Pass(-1) if new == op.ndim else Pass(new)


def _along_dim(pos: int, keyword: str = "dim", default: int | None = 0) -> Rule:
    """Rule for an op working along the dim given at argument ``pos``; ``default`` when the call names none
    (None: the op then works on the flattened tensor, across channels, so it is not followed)."""

    def rule(op: OpCall) -> Step:
        if op.axis != op.ndim - 1:
            return None
        dims = _norm_dims(op.arg(pos, keyword, default), op.ndim)
        if dims is None or op.ndim - 1 in dims:
            return Block(_blocking(f"{op.name} over the channel dim between norm and Linear")) if dims else None
        return _last_dim_whole(op)

    return rule


def _getitem(op: OpCall) -> Step:
    if op.axis != op.ndim - 1:
        return None
    touches = _index_touches_last(op.arg(1, "idx"), op.ndim)
    if touches is None or touches:
        return Block(_blocking("channel slicing between norm and Linear"))
    return _last_dim_whole(op)


#: op name (``op_short``) → how the channels move through it; ops not listed are ordinary consumers
RULES: dict[str, Rule] = {
    "dropout": _dropout,
    **{name: _cast for name in _CASTS},
    "t": _t, "permute": _permute, "movedim": _movedim, "moveaxis": _movedim,
    "transpose": _transpose, "swapaxes": _transpose, "swapdims": _transpose,
    "mean": _mean, "nanmean": _mean,
    "pad": _pad,
    **{name: _reshape for name in _RESHAPES},
    **{name: _along_dim(pos) for name, pos in _DIM_ARG_OPS.items()},
    "roll": _along_dim(2, "dims", None),  # x.roll(1) rolls the flattened tensor: elements change channel
    "__getitem__": _getitem,
    "unsqueeze": _unsqueeze,
}


def step(node: Node, tensors: dict[int, TensorInfo], tid: int, axis: int, d: int,
         dropout_p: float | None = None) -> Step:
    """Follow the channels of tensor ``tid`` through op ``node`` (see module doc)."""
    if node.callee == "module" or not node.outputs or node.info.get("inplace"):
        return None
    rule = RULES.get(op_short(node))
    if rule is None:
        return None
    tin = tensors[tid]
    return rule(OpCall(node, op_short(node), tin.shape, [tensors[o] for o in node.outputs], axis, d))
