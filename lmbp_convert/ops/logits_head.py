"""The LM head's backward fused with the memory-sharing cross-entropy: the logits' gradient is made one chunk of
rows at a time and multiplied into the head's input (and weight) gradients at once, so backward never holds an
(N, V) gradient beside the (N, V) logits.

Why: with the loss's fp32 copy gone (`lmbp_convert.ops.cross_entropy`), the peak of a checkpointed LLM step is
the logits plus their full gradient, made by the loss's backward only for the head's matmul to read it once.

The hand-off, one backward pass at a time:

- `LogitsHeadFunction` is ``F.linear`` whose node carries an empty hand-off list (``ctx.ce_handoff``).
- The cross-entropy finds that node in its forward when its rows are exactly the head output's storage
  (`head_of`). In its backward it appends its gradient's recipe (`_Pending`: the logits, targets, lse,
  upstream per-row gradient) and returns a stride-0 zero instead of writing (N, V) values — but only when the
  engine will run the head's node in this pass (``torch._C._will_engine_execute_node`` of the nodes it feeds),
  nothing watches the logits' gradient (a hook or ``retain_grad`` on the logits, a hook or pre-hook on the head's
  node: `_watched`), and no graph of the backward is being built (`defer`). Otherwise it writes its gradient as
  before, and the head's backward is a plain Linear's.
- The engine runs the head's node after every consumer of the logits (topological order). Its backward takes
  the list and, per chunk of rows, makes the loss's gradient rows exactly as the loss's own backward would (in
  the logits' dtype, rounded once), adds the rows of whatever other consumers of the logits sent (nothing when it
  is the zero it handed over), and multiplies: ``dx[rows] = d @ W``. A weight (and bias) that trains takes its
  gradient in a second pass by chunks of vocabulary columns, ``dW[cols] = d[:, cols]ᵀ x`` over all rows: one
  matmul per element as unfused, at the cost of making the gradient's values twice.

Where one chunk holds the whole gradient (N·V ≤ ``ROW_CHUNK_ELEMENTS``) it is made once and multiplied by
autograd's own linear backward (``d.mm(W)``, ``(xᵀ.mm(d))ᵀ``, ``d.sum(0)``): with the PyTorch-path loss's gradient
(bitwise ``F.cross_entropy``'s), the head's gradients are bitwise a plain Linear + loss. Beyond one chunk, values
equal the unfused path's up to the matmuls' blocking (a row chunk of ``d @ W`` may round differently from
the whole matmul; measured on MKL at 4096×32000×256). Nothing here runs under
torch.compile or torch.func: the head module calls plain ``F.linear`` there (`fusable`). The one case it cannot
see: ``torch.autograd.grad(loss, [logits, <anything before the head>])`` in one call captures the stride-0 zero
as the logits' gradient (the engine does not tell a captured node that also runs from one that only runs).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from . import func_transforms
from ._common import autocast_dtype_for

__all__ = ["LogitsHeadFunction", "logits_head", "fusable", "head_of", "defer", "ROW_CHUNK_ELEMENTS"]

#: elements of the logits' gradient made at a time (rows per chunk = this // V, at least 1)
ROW_CHUNK_ELEMENTS = 1 << 21
_HANDOFF = "ce_handoff"
#: autograd nodes of pure views between the head's output and the loss's rows
_VIEW_NODES = frozenset({"ViewBackward0", "ReshapeAliasBackward0", "AliasBackward0", "UnsafeViewBackward0"})
_MAX_VIEWS = 4


@dataclass
class _Pending:
    """What the cross-entropy's backward would have computed, left for the head's backward to compute by rows."""

    logits: torch.Tensor  # (N, V), the head output's storage
    targets: torch.Tensor  # (N,)
    lse: torch.Tensor  # (N,) fp32
    upstream: torch.Tensor  # (N,) the gradient of the per-row losses
    ignore_index: int
    triton_path: bool
    zero: torch.Tensor  # the stride-0 zero returned in place of the gradient
    kept: Optional[object] = None  # the loss's `cross_entropy.KeptLogits`: the logits unmodified since forward


def fusable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The head runs `LogitsHeadFunction`: eager autograd that will need a gradient, outside compile and torch.func."""
    return (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            and not torch.compiler.is_compiling() and not func_transforms.active())


def logits_head(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through `LogitsHeadFunction`; under autocast the inputs are cast the way
    autocast's linear casts them, outside the Function (their casts' backward returns each gradient in its
    tensor's own dtype, as under autocast)."""
    dtype = autocast_dtype_for(x)
    dev = "cuda" if x.is_cuda else x.device.type
    if dtype != x.dtype or torch.is_autocast_enabled(dev):
        x, weight = _cast(x, dtype), _cast(weight, dtype)
        bias = _cast(bias, dtype) if bias is not None else None
        with torch.autocast(dev, enabled=False):
            return _marked(LogitsHeadFunction.apply(x, weight, bias))
    return _marked(LogitsHeadFunction.apply(x, weight, bias))


def _marked(out: torch.Tensor) -> torch.Tensor:
    """The output, known to its node (weakly: a node must not keep its output alive) so the loss can find it."""
    if out.grad_fn is not None:
        out.grad_fn.ce_out = weakref.ref(out)
    return out


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t


class LogitsHeadFunction(torch.autograd.Function):
    """``F.linear`` whose backward takes the hand-off of a cross-entropy on its output (see the module doc)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        setattr(ctx, _HANDOFF, [])
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        pending: list[_Pending] = getattr(ctx, _HANDOFF)
        setattr(ctx, _HANDOFF, [])
        need_x, need_w, need_b = ctx.needs_input_grad
        if not pending:
            return _plain_backward(g, x, weight, need_x, need_w, need_b and ctx.has_bias)
        return _fused_backward(g, x, weight, pending, need_x, need_w, need_b and ctx.has_bias)


def _watching(register):
    """``register`` (a node's ``register_hook`` / ``register_prehook``) that also keeps the hook's handle on the
    node: a hook on the head's node must see the real gradient of the logits (and a pre-hook may change it), so
    `defer` asks `_watched` first. The engine's nodes cannot list their hooks from Python; this node class is the
    Function's own, so its registrations are the ones to see."""
    def watched(node, hook):
        handle = register(node, hook)
        node.ce_hooks = getattr(node, "ce_hooks", ()) + (handle,)
        return handle
    watched.__doc__ = register.__doc__
    return watched


_NODE = LogitsHeadFunction._backward_cls  # the class of the Function's autograd nodes (``logits.grad_fn``)
_NODE.register_hook = _watching(_NODE.register_hook)
_NODE.register_prehook = _watching(_NODE.register_prehook)


def _watched(node) -> bool:
    """A hook registered on ``node`` (by `_watching`) and not removed since."""
    for handle in getattr(node, "ce_hooks", ()):
        hooks = handle.hooks_dict_ref()
        if hooks is not None and handle.id in hooks:
            return True
    return False


def _plain_backward(g, x, weight, need_x, need_w, need_b):
    gx = g.matmul(weight) if need_x else None
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
    gw = g2.t().matmul(x2) if need_w else None
    gb = g2.sum(0) if need_b else None
    return gx, gw, gb


def _fused_backward(g, x, weight, pending: list[_Pending], need_x, need_w, need_b):
    """dx by chunks of rows (each row's products are the unfused ones); dW and db by chunks of vocabulary columns
    over all rows, in a second pass, so each is one matmul (one sum) in the weight's dtype as unfused, not a sum of
    row chunks (which would need fp32 operands: several times slower on a CPU)."""
    for p in pending:  # the logits, read again here, must still be the forward's
        if p.kept is not None:
            p.kept.check(p.logits)
    v = g.shape[-1]
    g2, x2 = g.reshape(-1, v), x.reshape(-1, x.shape[-1])
    n = g2.shape[0]
    other = None if _is_handed_zero(g2, pending) else g2  # what the logits' other consumers sent
    if n * v <= ROW_CHUNK_ELEMENTS:  # one chunk holds the whole gradient: autograd's own matmuls, bitwise
        d = _grad_rows(pending, other, slice(0, n))
        gx = d.mm(weight).reshape(x.shape) if need_x else None
        return gx, x2.t().mm(d).t() if need_w else None, d.sum(0) if need_b else None
    gx = torch.empty_like(x2) if need_x else None
    if need_x:
        step = max(1, ROW_CHUNK_ELEMENTS // max(v, 1))
        for i in range(0, n, step):
            rows = slice(i, min(n, i + step))
            gx[rows] = _grad_rows(pending, other, rows).matmul(weight)
    gw = torch.empty_like(weight) if need_w else None
    gb = torch.empty(v, dtype=g.dtype, device=g.device) if need_b else None
    if need_w or need_b:
        step = max(1, ROW_CHUNK_ELEMENTS // max(n, 1))
        for j in range(0, v, step):
            cols = slice(j, min(v, j + step))
            d = _grad_cols(pending, other, cols)
            if need_w:
                gw[cols] = d.t().matmul(x2)
            if need_b:
                gb[cols] = d.sum(0)
    return gx.reshape(x.shape) if need_x else None, gw, gb


def _is_handed_zero(g2: torch.Tensor, pending: list[_Pending]) -> bool:
    ptr = g2.untyped_storage().data_ptr()
    return all(s == 0 for s in g2.stride()) and any(ptr == p.zero.untyped_storage().data_ptr() for p in pending)


def _grad_rows(pending: list[_Pending], other: Optional[torch.Tensor], rows: slice) -> torch.Tensor:
    """The logits' gradient rows, as each loss's own backward makes them (its kernel or PyTorch path)."""
    from .cross_entropy import _bwd_torch, _bwd_triton

    d = None if other is None else other[rows]
    for p in pending:
        fn = _bwd_triton if p.triton_path else _bwd_torch
        part = fn(p.upstream[rows], p.logits[rows], p.targets[rows], p.lse[rows], p.ignore_index)
        d = part if d is None else d + part
    return d


def _grad_cols(pending: list[_Pending], other: Optional[torch.Tensor], cols: slice) -> torch.Tensor:
    """The logits' gradient columns, by the loss's own formula (`cross_entropy.grad_block`)."""
    from .cross_entropy import grad_block, row_weights, target_columns

    d = None if other is None else other[:, cols]
    for p in pending:
        w = row_weights(p.upstream, p.targets, p.lse, p.ignore_index)
        index, value = target_columns(p.targets, p.ignore_index, cols.start, cols.stop)
        part = grad_block(p.logits[:, cols], p.lse, w, index, value)
        d = part if d is None else d + part
    return d


def head_of(rows: torch.Tensor):
    """(node, output) of the `LogitsHeadFunction` whose output ``rows`` (N, V) is, through views only (the
    reshapes HF and the loss take), element for element in the same storage; else None (and always under
    torch.compile, which runs the head as plain ``F.linear``)."""
    if torch.compiler.is_compiling():
        return None
    node = rows.grad_fn
    for _ in range(_MAX_VIEWS + 1):
        if node is None:
            return None
        if isinstance(getattr(node, _HANDOFF, None), list):
            break
        if type(node).__name__ not in _VIEW_NODES:
            return None
        node = node.next_functions[0][0]
    else:
        return None
    out = node.ce_out() if getattr(node, "ce_out", None) is not None else None
    if out is None or not (out.is_contiguous() and rows.is_contiguous() and rows.dim() == 2
                           and rows.data_ptr() == out.data_ptr() and rows.numel() == out.numel()):
        return None
    return node, out


def _head_runs(node) -> bool:
    """The engine will run ``node``'s backward in this pass: something it sends a gradient to will be run (or
    accumulated). A node only captured (``torch.autograd.grad(loss, logits)``) has none. Under
    ``autograd.grad`` the engine cannot say it of a leaf's accumulator: such an edge counts as not run."""
    for fn, _ in node.next_functions:
        if fn is None:
            continue
        try:
            if torch._C._will_engine_execute_node(fn):
                return True
        except RuntimeError:  # a leaf's AccumulateGrad inside autograd.grad (not supported by the engine)
            continue
    return False


def defer(node, base: torch.Tensor, logits, targets, lse, upstream, ignore_index: int,
          triton_path: bool, kept=None) -> Optional[torch.Tensor]:
    """From the cross-entropy's backward: hand its gradient to the head's ``node`` (whose output is ``base``) and
    return the zero to send in its place, or None when the loss must write it itself (see the module doc)."""
    if torch.is_grad_enabled() or func_transforms.active():
        return None
    if base._backward_hooks or base.retains_grad or _watched(node) or not _head_runs(node):
        return None
    zero = logits.new_zeros(()).expand(logits.shape)
    getattr(node, _HANDOFF).append(_Pending(logits, targets, lse, upstream, ignore_index, triton_path, zero, kept))
    return zero
