"""Memory-sharing cross-entropy for LM heads: the loss from the logits in their own dtype.

HF's loss functions upcast the logits (``logits.float()``) before ``F.cross_entropy``: for bf16 logits of a
large vocabulary that is an fp32 copy of all of them, whose ``log_softmax`` keeps a second fp32 (N, V) tensor for
backward, and backward then makes an fp32 gradient plus its bf16 cast. The logits themselves are kept anyway:
the model returns them (``outputs.logits``). This op saves exactly that storage (no copy, no upcast), the per-row
fp32 logsumexp and the targets, and its backward writes ONE gradient in the logits' dtype,

    d loss_i / d x_ij = g_i · (exp(x_ij − lse_i) − [j = t_i])     (0 for a row whose target is ignore_index),

computed in fp32 per element and rounded once. Forward and backward run in row chunks: the PyTorch path's fp32
scratch is one chunk of at most ``CHUNK_ELEMENTS`` values in backward (a few such chunks inside ``logsumexp`` in
forward), never an fp32 (N, V); the Triton kernels hold none (one program per row streams the row in
``BLOCK``-element pieces: an online logsumexp forward, one pass backward).

Non-finite logits as HF's ``F.cross_entropy(logits.float(), ...)``: a row whose log-softmax is undefined (a +inf
or NaN logit, or all -inf) has a NaN loss and a gradient row all NaN, ignored or not (the forward stores such a
row's lse as NaN: the Triton forward's online sum makes it so by itself, the PyTorch path maps logsumexp's +inf);
a -inf logit at the target is a +inf loss with a finite gradient. A target that is neither ``ignore_index`` nor a
class raises torch's ``IndexError`` before any launch (the kernels read each kept row's target column).

Backward reads the logits the model returned, not a copy: edited in place after forward (``logits.div_(T)``) they
would give a wrong gradient, so backward raises `LogitsModifiedError` instead (`KeptLogits`), as autograd does for
a saved tensor, also where saved-tensor hooks switch autograd's own check off.

``cross_entropy_rows`` returns the per-row losses (fp32; 0 on ignored rows); `cross_entropy` reduces them: "sum",
"mean" (over rows whose target is not ignored: HF's and torch's mean), or a sum divided by ``divisor``
(``num_items_in_batch`` of gradient accumulation). Statistics are fp32 (fp64 for fp64 logits, PyTorch path only).

Dispatch: Triton kernels for CUDA tensors (`use_triton`), the PyTorch path everywhere else, with one signature so
tests compare them directly. Eager calls go through `LeanKernel`; under torch.compile the Triton path is the
``triton_op`` ``lmbp_convert::cross_entropy_fwd`` (its backward ``cross_entropy_bwd`` registered as its autograd),
and the PyTorch path is traced by dynamo (its chunk loop unrolls over a static row count).
"""
from __future__ import annotations

import weakref

import torch

from ..errors import LogitsModifiedError
from . import logits_head
from ._common import HAS_TRITON, check_dtype, regrad, twice_differentiable, use_triton
from ._launch import LeanKernel, next_pow2, spec_key
from .saved_hooks import Watched, top_hooks
from .backends.dispatch import Backend, route
from .backends.compiled import kernel_op

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["cross_entropy", "cross_entropy_rows", "CrossEntropyFunction", "KeptLogits", "CHUNK_ELEMENTS", "BLOCK"]

#: fp32 elements of scratch the PyTorch path works on at a time (rows per chunk = this // V, at least 1)
CHUNK_ELEMENTS = 1 << 20
#: elements of a row one Triton program handles per loop step
BLOCK = 4096
_REDUCTIONS = ("mean", "sum", "none")


# ------------------------------------------------------------------------------------------------------
# Triton kernels: one program per row, fp32 math, the row streamed in BLOCK pieces.
# ------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _ce_fwd_kernel(X, T, LOSS, LSE, stride_x, V, ignore_index, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_x
        cols = tl.arange(0, BLOCK)
        m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        s = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
        for off in range(0, V, BLOCK):
            mask = off + cols < V
            x = tl.load(x_row + off + cols, mask=mask, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            # exp(-inf - -inf) is NaN: a row (or piece) that is -inf so far contributes 0, not NaN
            e = tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
            s = s * tl.where(m == m_new, 1.0, tl.exp(m - m_new)) + tl.sum(e, axis=0)
            m = m_new
        lse = m + tl.log(s)
        t = tl.load(T + row)
        valid = t != ignore_index
        x_t = tl.load(x_row + tl.where(valid, t, 0)).to(tl.float32)
        tl.store(LOSS + row, tl.where(valid, lse - x_t, 0.0))
        tl.store(LSE + row, lse)

    @triton.jit
    def _ce_bwd_kernel(G, X, T, LSE, DX, stride_g, stride_x, stride_dx, V, ignore_index, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        t = tl.load(T + row)
        w = tl.where(t != ignore_index, tl.load(G + row * stride_g).to(tl.float32), 0.0)
        lse = tl.load(LSE + row)
        cols = tl.arange(0, BLOCK)
        for off in range(0, V, BLOCK):
            mask = off + cols < V
            x = tl.load(X + row * stride_x + off + cols, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            d = (p - tl.where(off + cols == t, 1.0, 0.0)) * w
            tl.store(DX + row * stride_dx + off + cols, d.to(DX.dtype.element_ty), mask=mask)

    _FWD = LeanKernel(_ce_fwd_kernel)
    _BWD = LeanKernel(_ce_bwd_kernel)


def _warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def _block_for(v: int, block: int | None) -> int:
    return block if block is not None else min(BLOCK, next_pow2(max(v, 16)))


def _fwd_triton(x: torch.Tensor, t: torch.Tensor, ignore_index: int, block: int | None = None,
                traced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward on (N, V) rows with unit column stride: (per-row loss, lse), both fp32 (N,)."""
    n, v = x.shape
    loss = torch.empty(n, dtype=torch.float32, device=x.device)
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    if n == 0:
        return loss, lse
    blk = _block_for(v, block)
    args = (x, t, loss, lse, x.stride(0), v, int(ignore_index))
    if traced:
        _FWD.launch_traced((n, 1, 1), x.device.index, args, (blk,), _warps(blk))
    else:
        dev = x.get_device()
        _FWD.launch(spec_key(args, dev, (blk,), _warps(blk)), (n, 1, 1), args, dev, (blk,), _warps(blk))
    return loss, lse


def _bwd_triton(g: torch.Tensor, x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, ignore_index: int,
                block: int | None = None, traced: bool = False) -> torch.Tensor:
    """Triton backward: the gradient of the per-row losses (upstream ``g``, (N,), any stride) w.r.t. x, in x's
    dtype."""
    n, v = x.shape
    dx = torch.empty((n, v), dtype=x.dtype, device=x.device)
    if n == 0:
        return dx
    blk = _block_for(v, block)
    args = (g, x, t, lse, dx, g.stride(0), x.stride(0), v, v, int(ignore_index))
    if traced:
        _BWD.launch_traced((n, 1, 1), x.device.index, args, (blk,), _warps(blk))
    else:
        dev = x.get_device()
        _BWD.launch(spec_key(args, dev, (blk,), _warps(blk)), (n, 1, 1), args, dev, (blk,), _warps(blk))
    return dx


# ------------------------------------------------------------------------------------------------------
# PyTorch path: the same contract on every device, fp32 scratch bounded by CHUNK_ELEMENTS.
# ------------------------------------------------------------------------------------------------------
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows_per_chunk(n: int, v: int, chunk: int | None) -> int:
    """At most CHUNK_ELEMENTS values, and at most a quarter of the rows: the scratch stays below the gradient."""
    return chunk if chunk is not None else max(1, min(CHUNK_ELEMENTS // max(v, 1), -(-n // 4)))


def _fwd_torch(x: torch.Tensor, t: torch.Tensor, ignore_index: int, chunk: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch forward, `_fwd_triton`'s contract (fp64 statistics for fp64 logits); ``chunk``: rows per chunk."""
    n, v = x.shape
    cdt = _compute_dtype(x.dtype)
    valid = t != ignore_index
    safe = torch.where(valid, t, torch.zeros_like(t)).unsqueeze(1)
    step = _rows_per_chunk(n, v, chunk)
    lse = torch.cat([torch.logsumexp(x[i:i + step].to(cdt), dim=1) for i in range(0, n, step)]) if n else \
        x.new_empty(0, dtype=cdt)
    # logsumexp is +inf on a row with a +inf logit, whose log-softmax HF finds undefined: NaN, as the kernel's
    lse = lse.masked_fill(lse == float("inf"), float("nan"))
    x_t = x.gather(1, safe).squeeze(1).to(cdt)
    loss = torch.where(valid, lse - x_t, torch.zeros_like(lse))
    return loss, lse


def _bwd_torch(g: torch.Tensor, x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, ignore_index: int,
               chunk: int | None = None) -> torch.Tensor:
    """PyTorch backward, `_bwd_triton`'s contract: one (N, V) result in x's dtype, written chunk by chunk."""
    n, v = x.shape
    w = row_weights(g, t, lse, ignore_index)
    index, hit = target_columns(t, ignore_index, 0, v)
    step = _rows_per_chunk(n, v, chunk)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    bitwise = x.dtype in (torch.float32, torch.float64)  # see _aten_grad_block
    for i in range(0, n, step):  # one fp32 chunk of scratch, rounded into dx before the next one is made
        r = slice(i, i + step)
        dx[r] = (_aten_grad_block(x[r], w[r], index[r], hit[r], lse.dtype) if bitwise
                 else grad_block(x[r], lse[r], w[r], index[r], hit[r]))
    return dx


def _aten_grad_block(x: torch.Tensor, w: torch.Tensor, index: torch.Tensor, value: torch.Tensor,
                     cdt: torch.dtype) -> torch.Tensor:
    """A row block's gradient exactly as HF's ``F.cross_entropy(logits.float(), ...)`` backward makes it:
    ATen's ``log_softmax`` recomputed on the rows (its row kernel treats rows independently, so a chunk gives the
    whole tensor's values), ``nll_loss_backward``'s ``−g`` at the target, ATen's ``_log_softmax_backward_data``,
    then one cast to x's dtype. Bitwise the original's gradient, not just within rounding. Used for fp32 / fp64
    logits, where training follows the original bitwise (the exact norms replay the original too); it recomputes
    the log-softmax, so it costs more than `grad_block` from the forward's lse (2048 × 32000, one thread: 1.13×
    in fp32, 1.26× in bf16), and bf16 logits, whose gradient is rounded to bf16 anyway, keep `grad_block`."""
    out = torch.log_softmax(x.to(cdt), 1)
    g_out = torch.zeros_like(out)
    g_out.scatter_(1, index, (value.to(cdt) * w).expand(index.shape))
    return torch.ops.aten._log_softmax_backward_data(g_out, out, 1, cdt).to(x.dtype)


def row_weights(g: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """(N, 1) upstream gradient per row in the statistics' dtype, 0 where the target is ignored."""
    return torch.where(t != ignore_index, g.to(lse.dtype), torch.zeros_like(lse)).unsqueeze(1)


def target_columns(t: torch.Tensor, ignore_index: int, start: int, stop: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, value) (N, 1) each, for ``scatter_add_`` on a block of columns [start, stop): −1 at each row's
    target column where it lies in the block (and is not ignored), 0 (at column 0) elsewhere."""
    hit = (t != ignore_index) & (t >= start) & (t < stop)
    index = torch.where(hit, t - start, torch.zeros_like(t)).unsqueeze(1)
    return index, torch.where(hit, -1.0, 0.0).unsqueeze(1)


def grad_block(x: torch.Tensor, lse: torch.Tensor, w: torch.Tensor, index: torch.Tensor, value: torch.Tensor
               ) -> torch.Tensor:
    """The gradient of a block of logits (rows × columns), ``(exp(x − lse) − [j = t]) · w`` in the statistics'
    dtype per element, rounded once to x's dtype: the one formula the loss's backward and the head's fused
    backward (`lmbp_convert.ops.logits_head`) both use."""
    p = x.to(lse.dtype, copy=True)
    p.sub_(lse.unsqueeze(1)).exp_()
    p.scatter_add_(1, index, value.to(lse.dtype).expand(index.shape))
    return p.mul_(w).to(x.dtype)


# ------------------------------------------------------------------------------------------------------
# Library ops: the Triton path under torch.compile (inductor emits the launches).
# ------------------------------------------------------------------------------------------------------
def _fwd_fake(x, t, ignore_index):
    n = x.shape[0]
    return x.new_empty((n,), dtype=torch.float32), x.new_empty((n,), dtype=torch.float32)


def _bwd_fake(g, x, t, lse, ignore_index):
    return x.new_empty(x.shape)


@kernel_op("lmbp_convert::cross_entropy_fwd", _fwd_fake)
def _ce_fwd_op(x: torch.Tensor, t: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_triton(x, t, ignore_index, traced=True)


@kernel_op("lmbp_convert::cross_entropy_bwd", _bwd_fake)
def _ce_bwd_op(g: torch.Tensor, x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor,
               ignore_index: int) -> torch.Tensor:
    return _bwd_triton(g, x, t, lse, ignore_index, traced=True)


def _op_setup_context(ctx, inputs, output):
    x, t, ignore_index = inputs
    _, lse = output
    ctx.save_for_backward(x, t, lse)
    ctx.mark_non_differentiable(lse)
    ctx.ignore_index = ignore_index


def _op_backward(ctx, g, _g_lse):
    x, t, lse = ctx.saved_tensors
    return torch.ops.lmbp_convert.cross_entropy_bwd(g, x, t, lse, ctx.ignore_index), None, None


_ce_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)


# ------------------------------------------------------------------------------------------------------
# autograd.Function (eager) and public API
# ------------------------------------------------------------------------------------------------------
_MODIFIED = "one of the variables needed for gradient computation has been modified by an inplace operation"


class KeptLogits(Watched):
    """Whether the logits a backward reads were modified in place since forward.

    The loss keeps the logits' storage, not a copy (the memory it saves), so an edit of ``outputs.logits`` after
    forward would change its gradient. Autograd's version check does not see it under saved-tensor hooks (the
    exact norms' region, ``save_on_cpu``), and without hooks it raises without naming the logits. So forward
    watches the tensor whose version counter they share (`saved_hooks.Watched`: their base, the head's output,
    which ``outputs.logits`` is); `check` compares, before the unpack where no hooks were open (autograd's own
    check would raise first), on the unpacked tensor where hooks were (a copy they made, being another storage,
    is unaffected), and where hooks that keep the logits themselves raise autograd's error at the unpack (this
    package's, `saved_hooks`), as this error, naming the logits."""

    __slots__ = ("shape", "dtype", "hooked")

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__(x)
        self.shape, self.dtype = list(x.shape), x.dtype
        self.hooked = top_hooks is None or top_hooks(False) is not None

    def check(self, x: torch.Tensor | None = None) -> None:
        """Raise `LogitsModifiedError` if the logits were modified in place since forward; ``x``: the tensor
        backward reads (None: before it is unpacked)."""
        now = self.modified(x)
        if now is None:
            return
        raise LogitsModifiedError(
            f"{_MODIFIED}: the logits {self.shape} ({str(self.dtype).replace('torch.', '')}) that the memory-sharing "
            f"loss keeps for backward (their storage, not a copy) are at version {now}; they were saved at "
            f"version {self.version}. Edit a copy (logits.clone()), or convert(..., loss=False) to keep the model's "
            "own loss, which keeps a copy of its own")


def _saved(ctx) -> tuple:
    """The saved logits, targets and lse; `LogitsModifiedError` where the logits were edited since forward."""
    kept = ctx.kept
    if kept is not None and not kept.hooked:
        kept.check()
    try:
        x, t, lse = ctx.saved_tensors
    except RuntimeError:  # hooks that keep the logits themselves check their version: say which tensor it was
        if kept is not None:
            kept.check()
        raise
    if kept is not None:
        kept.check(x)
    return x, t, lse


def _backward_graph(ctx, g: torch.Tensor):
    """create_graph=True: the rows' losses recomputed from the saved logits by ``F.cross_entropy`` in the
    statistics' dtype, differentiated with a graph (no hand-off to the head)."""
    x, t, lse = _saved(ctx)
    ignore_index, ctx.head = ctx.spec[0], None

    def rows(x):
        return torch.nn.functional.cross_entropy(x.to(lse.dtype), t, ignore_index=ignore_index, reduction="none")

    return regrad(rows, (x,), ctx.needs_input_grad[:1], g)[0], None, None


@twice_differentiable(_backward_graph)
def _backward(ctx, g: torch.Tensor):
    x, t, lse = _saved(ctx)
    kept = ctx.kept
    ignore_index, triton_path = ctx.spec
    head, ctx.head = ctx.head, None  # the node and the logits are not held past the first backward
    base = head[1]() if head is not None else None
    if base is not None:
        zero = logits_head.defer(head[0], base, x, t, lse, g, ignore_index, triton_path, kept)
        if zero is not None:  # the head's backward makes the gradient by rows (ops.logits_head)
            return zero, None, None
    dx = (_bwd_triton if triton_path else _bwd_torch)(g, x, t, lse, ignore_index)
    return dx, None, None


class CrossEntropyFunction(torch.autograd.Function):
    """Per-row cross-entropy of (N, V) logits; saves the logits themselves, the targets and the fp32 lse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, t: torch.Tensor, ignore_index: int) -> torch.Tensor:
        triton_path = use_triton(x)
        loss, lse = (_fwd_triton if triton_path else _fwd_torch)(x, t, ignore_index)
        ctx.save_for_backward(x, t, lse)
        ctx.spec = (ignore_index, triton_path)
        # nothing to check where no backward reads the logits (inference tensors have no version counter)
        watch = not torch.compiler.is_compiling() and x.requires_grad and not x.is_inference()
        ctx.kept = KeptLogits(x) if watch else None
        head = logits_head.head_of(x)  # its rows are a LogitsHeadFunction's output: backward may hand off
        ctx.head = None if head is None else (head[0], weakref.ref(head[1]))
        return loss

    backward = staticmethod(_backward)


def _rows(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_dtype(logits, "cross_entropy")
    if logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError(f"cross_entropy: logits must be a floating-point tensor with a class dim, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"cross_entropy: targets must be int64 or int32 class indices, got {targets.dtype}")
    v = logits.shape[-1]
    x = logits.reshape(-1, v)  # a view of the model's own storage when the logits are contiguous in the last dim
    if v > 1 and x.stride(1) != 1:
        x = x.contiguous()
    t = targets.reshape(-1)
    if t.numel() != x.shape[0]:
        raise ValueError(f"cross_entropy: {t.numel()} targets for {x.shape[0]} rows of logits "
                         f"{tuple(logits.shape)}")
    return x, t.to(torch.int64)


def _check_targets(t: torch.Tensor, classes: int, ignore_index: int) -> None:
    """Every target a class or ``ignore_index``, as torch's cross-entropy requires: the kernels read the column of
    each kept row's target, out of bounds for one outside [0, classes) (silently, on a GPU). One reduction over
    the (N,) targets before any launch; eager: torch's ``IndexError`` for the first; under torch.compile (the
    values cannot be read while tracing) an assert in the graph."""
    bad = (t != ignore_index) & ((t < 0) | (t >= classes))
    if torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), "cross_entropy: a target is out of bounds")
    elif bad.any():
        raise IndexError(f"Target {int(t[bad][0])} is out of bounds.")


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-row losses (fp32; fp64 for fp64 logits) of logits (..., V) against class indices of the leading shape,
    flattened to (N,); 0 where the target is ``ignore_index``."""
    x, t = _rows(logits, targets)
    ignore_index = int(ignore_index)
    _check_targets(t, x.shape[1], ignore_index)
    if route("cross_entropy", x, use_triton(x)) is Backend.COMPILED:
        return torch.ops.lmbp_convert.cross_entropy_fwd(x, t, ignore_index)[0]
    return CrossEntropyFunction.apply(x, t, ignore_index)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
                  divisor: torch.Tensor | float | int | None = None) -> torch.Tensor:
    """Cross-entropy of logits (..., V) in their own dtype, fp32 inside; backward makes one gradient in the
    logits' dtype. ``reduction``: "mean" over non-ignored targets (NaN when all are ignored, as in torch), "sum",
    or "none" (per row, flattened). ``divisor``: the sum divided by it (HF's ``num_items_in_batch``); only with
    reduction "sum"."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of {', '.join(_REDUCTIONS)}, got {reduction!r}")
    if divisor is not None and reduction != "sum":
        raise ValueError("cross_entropy: divisor divides the sum; pass reduction='sum' with it")
    rows = cross_entropy_rows(logits, targets, ignore_index)
    if reduction == "none":
        return rows
    total = rows.sum()
    if reduction == "mean":
        return total / (targets != ignore_index).sum().to(total.dtype)
    if divisor is None:
        return total
    if isinstance(divisor, torch.Tensor):
        divisor = divisor.to(total.device)
    return total / divisor
