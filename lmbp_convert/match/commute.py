"""Which tensor ops commute with a per-channel affine y = γ·x + β (channels on one axis).

Pure functions over the value-free op records of the trace. ``step(node, tensor_info, axis, d)`` answers for
one op whose input carries the norm's channels on ``axis`` (size ``d``): either ``Pass(new_axis, caveat)``,
the op commutes and its output carries the channels on ``new_axis``; ``Block(reason)``, the op sits on a path
to a Linear but breaks exactness (dropout in training, zero-padding, channel mixing); or ``None``, the op is
an ordinary consumer (add, matmul, cat, ...).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..trace.graph import Node, TensorInfo


@dataclass(frozen=True)
class Pass:
    axis: int
    caveat: str | None = None


@dataclass(frozen=True)
class Block:
    reason: str


# Ops that never look at values: ignored wherever they appear.
METADATA_OPS = {
    "size", "dim", "numel", "stride", "is_contiguous", "data_ptr", "element_size", "nelement", "ndimension",
    "get_device", "is_floating_point", "is_complex", "storage_offset", "__len__", "untyped_storage",
    # new tensors shaped like the input (an MoE block's output buffer): they read its shape and dtype only
    "zeros_like", "ones_like", "empty_like", "full_like",
}
_CASTS = {"to", "float", "half", "bfloat16", "double", "type", "type_as", "contiguous", "clone", "detach_", "cpu", "cuda"}
_SAME_LAST = {"view", "reshape", "flatten", "unflatten", "expand", "expand_as", "squeeze", "unsqueeze",
              "view_as", "reshape_as", "repeat", "__getitem__", "narrow", "select", "split", "chunk", "unbind",
              "roll", "index_select", "split_with_sizes", "tensor_split", "repeat_interleave"}
_PERMUTES = {"permute", "transpose", "swapaxes", "swapdims", "t", "movedim", "moveaxis"}
_DIM_ARG_OPS = {"narrow": 1, "select": 1, "split": 2, "chunk": 2, "unbind": 1, "index_select": 1,
                "split_with_sizes": 2, "tensor_split": 2, "roll": 2, "repeat_interleave": 2}


def op_short(node: Node) -> str:
    return node.target.rsplit(".", 1)[-1] if not node.target.endswith(".__get__") else "__get__"


def is_metadata(node: Node) -> bool:
    return node.kind == "op" and (op_short(node) in METADATA_OPS or node.target.endswith(".__get__"))


def _arg(node: Node, pos: int, name: str, default=None):
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


def step(node: Node, tensors: dict[int, TensorInfo], tid: int, axis: int, d: int, dropout_p: float | None = None):
    """Follow the channels of tensor ``tid`` through op ``node`` (see module doc)."""
    if node.kind == "module":
        return None
    name = op_short(node)
    tin = tensors[tid]
    ndim = len(tin.shape)
    outs = [tensors[o] for o in node.outputs]
    if not outs:
        return None
    if node.info.get("inplace"):
        return None
    if name == "dropout" or node.target.endswith("functional.dropout"):
        p = _arg(node, 1, "p", 0.5)
        return Pass(axis) if p == 0 else Block(f"dropout (p={p}) between norm and Linear")
    if name in _CASTS:
        return Pass(axis) if outs[0].shape == tin.shape else None
    if name in _PERMUTES:
        out = outs[0]
        if name == "t":
            perm = list(range(ndim))[::-1]
        elif name == "permute":
            perm = _arg(node, 1, "dims")
            if isinstance(perm, tuple) and len(perm) == 1 and isinstance(perm[0], tuple):
                perm = perm[0]
            if not isinstance(perm, tuple) or len(node.info["args"]) > 2:
                perm = tuple(a for a in node.info["args"][1:])
            perm = _norm_dims(perm, ndim)
        elif name in ("movedim", "moveaxis"):
            src, dst = _norm_dims(_arg(node, 1, "source"), ndim), _norm_dims(_arg(node, 2, "destination"), ndim)
            if src is None or dst is None:
                return None
            order = [i for i in range(ndim) if i not in src]
            perm = [None] * ndim
            for s_, t_ in zip(src, dst):
                perm[t_] = s_
            it = iter(order)
            perm = [p if p is not None else next(it) for p in perm]
        else:
            a, b = _norm_dims(_arg(node, 1, "dim0"), ndim), _norm_dims(_arg(node, 2, "dim1"), ndim)
            if a is None or b is None:
                return None
            perm = list(range(ndim))
            perm[a[0]], perm[b[0]] = perm[b[0]], perm[a[0]]
        if perm is None or len(perm) != ndim:
            return None
        new_axis = perm.index(axis)
        return Pass(new_axis) if out.shape[new_axis] == d else None
    if name == "mean" or name == "nanmean":
        dims = _norm_dims(_arg(node, 1, "dim"), ndim)
        if dims is None or axis in dims:
            return None
        keep = bool(_arg(node, 2, "keepdim", False))
        return Pass(axis if keep else axis - sum(1 for x in dims if x < axis))
    if name == "pad" and node.target.endswith("functional.pad"):
        pads = _arg(node, 1, "pad")
        mode = _arg(node, 2, "mode", "constant")
        if not isinstance(pads, tuple) or axis != ndim - 1:
            return Block("padding between norm and Linear")
        if any(pads[0:2]):
            return Block("zero-padding of channels between norm and Linear")
        if any(pads):
            return Block(f"{mode}-padding between norm and Linear (padded positions would see β)")
        if outs[0].shape != tin.shape:
            return Block("padding between norm and Linear")
        return Pass(axis, "a pad op on the path was a no-op at the probe shape; inputs that need padding "
                          "would give padded positions β instead of 0")
    if name in _SAME_LAST:
        if axis != ndim - 1:
            return None
        if name in _DIM_ARG_OPS:
            pos = _DIM_ARG_OPS[name]
            dims = _norm_dims(_arg(node, pos, "dims" if name == "roll" else "dim", 0), ndim)
            if dims is None or ndim - 1 in dims:
                return Block(f"{name} over the channel dim between norm and Linear") if dims else None
        if name == "__getitem__":
            touches = _index_touches_last(_arg(node, 1, "idx"), ndim)
            if touches is None or touches:
                return Block("channel slicing between norm and Linear")
        if all(len(o.shape) >= 1 and o.shape[-1] == d for o in outs):
            return Pass(-1)
        return Block(f"{name} reshapes the channel dim between norm and Linear")
    return None
