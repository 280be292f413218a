"""One saved-tensor hooks region over a whole model call: a tensor that autograd saves but that can be rebuilt
bitwise from tensors kept anyway is replaced by a recipe.

Memory sharing (MS-BP) in the paper's sense, for the copies nobody asked for:

* PEFT's LoRA casts an adapter's input to the adapter dtype (fp32 by default) and ``lora_A`` saves that copy; the
  bf16 input is kept anyway (a memory-sharing norm's output) or is half the size. A saved tensor that is a chain
  of dtype casts, views, splits and copies (`_READ`) of a *noted* tensor becomes a recipe: the noted tensor plus
  the same ops (an MoE router's ``y.view(-1, d)``, a classifier's ``y[:, 0]``, TRL's shifted ``h[:, :-1]``, cast
  under autocast).
* A producer that can rebuild its output from kept tensors notes how (`note`): the exact norm's ``y = γ·x̂ + β``
  from x̂, which its own backward keeps (`lmbp_convert.nn.exact_norms`); a dropout's output from its input and a
  packed-bit mask (`lmbp_convert.ops.dropout_bits`). Sources of a recipe are themselves packed through the region,
  so ``lora_A(dropout(y.float()))`` keeps x̂ and a bit mask.

Rebuilding runs the producer's own ops on the same tensors, so the value is bitwise the forward's (a producer whose
rebuild declares ``fuses_cast`` writes a recipe's leading dtype cast in the same pass, bitwise the same). One rebuild
serves every recipe made of the same noted tensor and casts (q, k, v and their adapters all read one ``y``): the
first unpack computes it, the others reuse it while any of them is alive. Notes are keyed by the tensor's autograd
node and output index (the halves of ``h.chunk(2, -1)`` are two notes). Each recipe records its sources' version
counters, and every tensor the region keeps as it is its own (`saved_hooks.ChainedHooks`), and raises autograd's
error if one was modified in place before backward: autograd itself does not check what passes through hooks.

The region is opened by hooks on the converted model (`lmbp_convert.apply.shared_hooks`) for the outermost call
and closed when it returns. It chains to the enclosing hooks (a `SavedTensorLedger`, ``save_on_cpu``): a tensor
it does not replace, and every source of a recipe, goes to them. Inside activation checkpointing, whose hooks
are innermost, nothing is replaced (checkpointing discards those tensors anyway). Under torch.compile (Dynamo
does not trace saved-tensor hooks) or where saved-tensor hooks are disabled, nothing opens: correct, with eager
autograd's bytes.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Optional

import torch

from .gated_recompute import _Hooks as _GatedHooks
from .saved_hooks import ChainedHooks, check_version, top_hooks

__all__ = ["SharedSaves", "active", "can_note", "note", "note_identity"]

_FRIENDLY = (_GatedHooks,)  # recompute hooks whose recipes stay valid after their call returns
_STATE = threading.local()  # the open regions of this thread (saved-tensor hooks are thread-local too)


def active() -> Optional["SharedSaves"]:
    """The innermost open region of this thread, or None."""
    stack = getattr(_STATE, "stack", None)
    return stack[-1] if stack else None


def can_note() -> bool:
    """A `note` made here would take: a region is open and its hooks (or friendly ones) are the innermost. False
    inside activation checkpointing (its forward and its recompute), under torch.compile, or with no region."""
    if torch.compiler.is_compiling():
        return False
    region = active()
    return region is not None and region.inner_hooks() is not False


def note(out: torch.Tensor, rebuild: Callable[..., torch.Tensor], *sources: Any, weak: tuple[int, ...] = ()) -> None:
    """``out == rebuild(*sources)`` bitwise (tensors among ``sources`` are packed through the region when a recipe
    needs them; other values are passed as they are). ``weak``: positions of sources the note must not keep alive
    (a transient copy: the recipe is made only while it lives); the others are tensors kept anyway (x̂, which the
    norm's backward saves). No-op outside a region, inside other hooks (checkpointing), or without a graph."""
    if torch.compiler.is_compiling():
        return
    region = active()
    if region is not None and isinstance(out, torch.Tensor) and out.grad_fn is not None:
        inner = region.inner_hooks()
        if inner is not False:
            held = tuple(region.hold_transient(s, inner) if i in weak and isinstance(s, torch.Tensor) else s
                         for i, s in enumerate(sources))
            region.notes.setdefault(_key(out), _Note(rebuild, held, identity=False, hooks=inner))


def note_identity(t: torch.Tensor) -> None:
    """``t`` itself may stand in for its up-cast copies (a LoRA layer's input: the adapters save ``t.float()``).
    Held weakly: a note never keeps a tensor alive (the recipe does, once a copy of it is saved)."""
    if torch.compiler.is_compiling():
        return
    region = active()
    if region is not None and isinstance(t, torch.Tensor) and t.grad_fn is not None and t.is_floating_point() \
            and region.inner_hooks() is None:
        region.notes.setdefault(_key(t), _Note(None, (_Weak(t),), identity=True))


def _key(t: torch.Tensor) -> tuple:
    """A note's key: the tensor's autograd node and which of its outputs the tensor is (``h.chunk(2, -1)``'s two
    halves share one node)."""
    return t.grad_fn, t.output_nr


class _Weak:
    """A source held by a weak reference (resolved when a recipe is made)."""

    __slots__ = ("ref",)

    def __init__(self, t: torch.Tensor) -> None:
        self.ref = weakref.ref(t)


class _Prepacked:
    """A transient source packed when it was noted, by the hooks innermost then (a gated MLP's recompute hooks)."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed: Any, unpack: Callable) -> None:
        self.packed, self.unpack = packed, unpack


def _signed(v) -> int:
    """An int a node saved: autograd reads a negative one back as its unsigned 64-bit pattern (``h[:, :-1]``)."""
    v = int(v)
    return v - (1 << 64) if v >= 1 << 63 else v


def _ints(vs) -> tuple[int, ...]:
    return tuple(_signed(v) for v in vs)


def _split_at(sizes, nr: int) -> tuple[int, int]:
    """(start, length) of output ``nr`` of a split into pieces of ``sizes``."""
    return sum(sizes[:nr]), sizes[nr]


def _even_split(fn, nr: int) -> tuple:
    dim, size = _signed(fn._saved_dim), _signed(fn._saved_split_size)
    total = _ints(fn._saved_self_sym_sizes)[dim]
    return ("narrow", dim, nr * size, min(size, total - nr * size))


def _reshape(fn, nr, meta) -> tuple:
    return ("reshape", tuple(meta.shape))


#: each data-movement node a saved tensor may sit behind → the forward op of its output ``nr``, as `_replay`
#: runs it (the node's own saved arguments; the output's metadata for shapes and dtypes). Views, casts, layouts
#: and copies only: the rebuilt values are the forward's, element for element.
_READ: dict[str, Callable[[Any, int, Any], tuple]] = {
    "ToCopyBackward0": lambda fn, nr, meta: ("to", meta.dtype),
    "SelectBackward0": lambda fn, nr, meta: ("select", _signed(fn._saved_dim), _signed(fn._saved_index)),
    "SliceBackward0": lambda fn, nr, meta: ("slice", _signed(fn._saved_dim), _signed(fn._saved_start),
                                            _signed(fn._saved_end), _signed(fn._saved_step)),
    "PermuteBackward0": lambda fn, nr, meta: ("permute", _ints(fn._saved_dims)),
    "TransposeBackward0": lambda fn, nr, meta: ("transpose", _signed(fn._saved_dim0), _signed(fn._saved_dim1)),
    "TBackward0": lambda fn, nr, meta: ("transpose", 0, 1) if len(meta.shape) == 2 else _reshape(fn, nr, meta),
    "CloneBackward0": lambda fn, nr, meta: ("clone",),
    "UnfoldBackward0": lambda fn, nr, meta: ("unfold", _signed(fn._saved_dimension), _signed(fn._saved_size),
                                             _signed(fn._saved_step)),
    "ExpandBackward0": lambda fn, nr, meta: ("expand", tuple(meta.shape)),
    "DiagonalBackward0": lambda fn, nr, meta: ("diagonal", _signed(fn._saved_offset), _signed(fn._saved_dim1),
                                               _signed(fn._saved_dim2)),
    "AsStridedBackward0": lambda fn, nr, meta: ("as_strided", _ints(fn._saved_size), _ints(fn._saved_stride),
                                                _signed(fn._saved_storage_offset)),
    "SplitBackward0": lambda fn, nr, meta: _even_split(fn, nr),
    "SplitWithSizesBackward0": lambda fn, nr, meta: ("narrow", _signed(fn._saved_dim),
                                                     *_split_at(_ints(fn._saved_split_sizes), nr)),
    "UnbindBackward0": lambda fn, nr, meta: ("select", _signed(fn._saved_dim), nr),
    "ViewAsRealBackward0": lambda fn, nr, meta: ("view_as_real",),
    "ViewAsComplexBackward0": lambda fn, nr, meta: ("view_as_complex",),
    # same elements in the same order
    **dict.fromkeys(("ViewBackward0", "UnsafeViewBackward0", "AliasBackward0", "ReshapeAliasBackward0",
                     "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "UnsqueezeBackward0"), _reshape),
}


def _dense(t: torch.Tensor) -> bool:
    """``t`` covers its storage span exactly, in some order of its dims (contiguous, channels-last, a permuted
    copy), at offset 0: a rebuilt tensor of that size and strides holds the same elements at the same places."""
    if t.storage_offset() != 0:
        return False
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _replay(out: torch.Tensor, op: tuple) -> torch.Tensor:
    kind, args = op[0], op[1:]
    if kind == "slice":
        return torch.ops.aten.slice.Tensor(out, *args)
    if kind in ("view_as_real", "view_as_complex"):
        return getattr(torch, kind)(out)
    return getattr(out, kind)(*args)  # to, select, narrow, permute, transpose, clone, reshape, unfold, expand, ...


def _chain(fn, nr: int, device: torch.device, noted: Callable[[tuple], bool] = lambda key: False
           ) -> Optional[tuple[tuple, tuple[tuple, ...]]]:
    """Follow the data-movement nodes of `_READ` back from output ``nr`` of autograd node ``fn``: (the first
    (node, output) that is none of them, the ops in forward order as `_replay` runs them), or None where a cast
    also moves devices, a node lacks the metadata (another torch), or an ``as_strided`` reads anything but the
    start (its offset indexes the storage of its input). It stops early at a ``noted`` output (a LoRA layer's
    input is itself a reshape of the attention output)."""
    ops = []
    while fn is not None and not noted((fn, nr)):
        read = _READ.get(type(fn).__name__)
        if read is None:
            break
        try:
            meta = fn._input_metadata[nr]  # the metadata of the gradient a node receives: its output's
            op = read(fn, nr, meta)
        except (AttributeError, IndexError, TypeError, RuntimeError):
            return None
        if op[0] == "to" and meta.device != device:
            return None
        ops.append(op)
        nxt = [(f, n) for f, n in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return None
        fn, nr = nxt[0]
    ops.reverse()
    if any(op[0] == "as_strided" for op in ops[1:]):
        return None
    return (fn, nr), tuple(ops)


class _Note:
    __slots__ = ("rebuild", "sources", "identity", "hooks")

    def __init__(self, rebuild: Optional[Callable], sources: tuple, identity: bool, hooks=None) -> None:
        self.rebuild, self.sources, self.identity = rebuild, sources, identity
        #: the (pack, unpack) pair that was innermost when the producer ran, where it is not this region's (a
        #: gated MLP's recompute hooks): the sources are packed through it, so its recipes apply to them too
        self.hooks = hooks


class _Rebuild:
    """A noted tensor and its casts and reshapes, rebuilt once (on the first unpack) for every recipe that shares
    it (the forward's own ops in its order, so the value and its layout are the forward's)."""

    __slots__ = ("rebuild", "parts", "versions", "ops", "value", "region", "stride")

    def __init__(self, region: "SharedSaves", rebuild: Optional[Callable], parts: list, versions: list,
                 ops: tuple[tuple[str, Any], ...], stride: tuple[int, ...]) -> None:
        self.region, self.rebuild, self.parts, self.versions, self.ops = region, rebuild, parts, versions, ops
        self.stride = stride  # the forward's layout of the saved tensor's base, which the recipes' strides index
        self.value: Optional[torch.Tensor] = None

    def get(self) -> torch.Tensor:
        if self.value is None:
            args = [p[1](p[0]) if isinstance(p, tuple) else self.region._unpack_part(p) for p in self.parts]
            for a, v in zip(args, self.versions):
                if v is not None:
                    check_version(a, v, self.region.saved_by + ": a tensor a saved tensor is rebuilt from")
            with torch.no_grad():
                ops = self.ops
                if self.rebuild is None:
                    out = args[0]
                elif ops and ops[0][0] == "to" and getattr(self.rebuild, "fuses_cast", False):
                    out, ops = self.rebuild(*args, cast_to=ops[0][1]), ops[1:]  # the cast in the same pass
                else:
                    out = self.rebuild(*args)
                for op in ops:
                    out = _replay(out, op)
                if out.stride() != self.stride:  # same values, the forward's layout (a clone's memory format)
                    out = torch.empty_strided(out.shape, self.stride, dtype=out.dtype,
                                              device=out.device).copy_(out)
            self.value = out
        return self.value


class _Recipe:
    __slots__ = ("shared", "size", "stride", "offset")

    def __init__(self, shared: _Rebuild, t: torch.Tensor) -> None:
        self.shared = shared
        self.size, self.stride, self.offset = tuple(t.size()), tuple(t.stride()), t.storage_offset()


class _Plain:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class SharedSaves(ChainedHooks):
    """The region's state for one call: the notes made during it and the recipes built from them."""

    saved_by = "lmbp-convert's shared-saves region (exact norms, LoRA inputs: norms=False, lora_inputs=False save " \
               "as plain autograd)"

    def __init__(self) -> None:
        self.notes: dict[tuple, _Note] = {}  # noted output's (autograd node, output index) → how to rebuild it
        self._made: dict[tuple, _Rebuild] = {}
        self.outer = None
        self._ctx = None
        self.recipes = 0  # recipes made (tests, benchmarks)

    def enter(self) -> bool:
        if torch.compiler.is_compiling() or top_hooks is None or not torch.is_grad_enabled():
            return False
        self.outer = top_hooks(False)
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        try:
            ctx.__enter__()
        except RuntimeError:  # saved-tensor hooks disabled by the caller: nothing is replaced
            self.outer = None
            return False
        self._ctx = ctx
        stack = getattr(_STATE, "stack", None)
        if stack is None:
            stack = _STATE.stack = []
        stack.append(self)
        return True

    def exit(self) -> None:
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)
            stack = getattr(_STATE, "stack", [])
            if stack and stack[-1] is self:
                stack.pop()
        self.notes.clear()
        self._made.clear()

    def inner_hooks(self):
        """The innermost saved-tensor hooks, as a note records them: None where they are this region's; the pair
        where they are a recompute region of this package's inside it (a gated MLP's down projection); False
        where they are anyone else's (activation checkpointing, ``save_on_cpu`` inside the call): no note then,
        since a recipe made later must not pack through hooks that have closed."""
        top = top_hooks(False)
        if top is None or top[0] == self._pack:
            return None
        owner = getattr(top[0], "__self__", None)
        # friendly hooks directly inside this region only: inside checkpointing they pass to its hooks, which
        # count every pack (a note packing through them would change that count between forward and recompute)
        friendly = isinstance(owner, _FRIENDLY) and owner.outer is not None and owner.outer[0] == self._pack
        return top if friendly else False

    def hold_transient(self, t: torch.Tensor, inner) -> Any:
        """How a note holds a source that may be freed before a recipe needs it (a cast copy the caller rebinds):
        packed now by friendly inner hooks, or as its own recipe if it has one, else weakly."""
        if inner is not None:
            return _Prepacked(inner[0](t), inner[1])
        recipe = self._recipe(t)
        return recipe if recipe is not None else _Weak(t)

    # -- packing ---------------------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        recipe = self._recipe(t)
        return recipe if recipe is not None else _Plain(self._opack(t))

    def _pack_part(self, t: Any):
        if not isinstance(t, torch.Tensor):
            return t
        recipe = self._recipe(t)
        return recipe if recipe is not None else _Plain(self._opack(t))

    def _unpack_part(self, packed) -> Any:
        if isinstance(packed, _Recipe):
            return self._unpack(packed)
        return self._ounpack(packed.value) if isinstance(packed, _Plain) else packed

    def _unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, _Plain):
            return self._ounpack(packed.value)
        return packed.shared.get().as_strided(packed.size, packed.stride, packed.offset)

    def _recipe(self, t: torch.Tensor) -> Optional[_Recipe]:
        if not self.notes:
            return None
        src = t if t._base is None else t._base
        if src.grad_fn is None or not _dense(src):
            return None
        walked = _chain(src.grad_fn, src.output_nr, src.device, self.notes.__contains__)
        if walked is None:
            return None
        node, ops = walked
        found = self.notes.get(node)
        if found is None:
            return None
        if any(isinstance(src, _Weak) and src.ref() is None for src in found.sources):
            return None  # a transient source already freed: nothing to rebuild from
        sources = tuple(src.ref() if isinstance(src, _Weak) else src for src in found.sources)
        casts = [op[1] for op in ops if op[0] == "to"]
        if found.identity:
            base = sources[0]
            # a copy that is a view of the noted tensor itself, or a narrower dtype, is not worth a recipe
            if not casts or any(torch.empty((), dtype=d).element_size() < base.element_size() for d in casts):
                return None
        key = (node, ops, src.stride())
        shared = self._made.get(key)
        if shared is None:
            if found.hooks is None:
                parts = [self._pack_part(s) for s in sources]
            else:
                pack, unpack = found.hooks
                parts = [(pack(s), unpack) if isinstance(s, torch.Tensor) else s for s in sources]
            parts = [(p.packed, p.unpack) if isinstance(p, _Prepacked) else p for p in parts]
            versions = [s._version if isinstance(s, torch.Tensor) else None for s in sources]
            shared = self._made[key] = _Rebuild(self, found.rebuild, parts, versions, ops, src.stride())
        self.recipes += 1
        return _Recipe(shared, t)

