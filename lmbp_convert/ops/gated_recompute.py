"""``consume(act(g)·u)`` for any consumer, keeping only g and u: h is recomputed when backward asks for it.

`gated_mlp` fuses the down projection, so it must be handed that projection as tensors (weight, bias, LoRA
A/B). This op takes the down projection as an opaque callable instead (nn.Linear, PEFT LoRA / DoRA,
a quantized Linear, a user module) and runs it unchanged. Inside the call a ``saved_tensors_hooks`` context
replaces every tensor the consumer saves that *is* h — the same storage and dtype, i.e. h or a view of it
(``F.linear`` on 3-D input saves a 2-D view) — or (a view of) a chain of dtype casts of h (autocast, PEFT's
cast to the adapter dtype, both) by a recipe: g and u (which the `GatedActFunction` producing h saves
anyway), the casts and the layout. Unpacking reruns the forward's own kernel on g and u, so the recomputed h
is bitwise the forward's h, and replays the casts. Everything else the consumer saves goes to the enclosing
hooks (a `SavedTensorLedger`, activation checkpointing, ``save_on_cpu``) or is kept as is.

What is not h cannot be shared: a consumer that saves a new tensor computed from h (LoRA dropout's
``dropout(h)``, a ``contiguous()`` copy) keeps it as eager autograd would. A consumer saving h twice gets two
recipes (h is recomputed twice); under enclosing hooks each recipe packs g and u through them once more
(``save_on_cpu`` then copies g and u again, where plain autograd would copy h once). When h needs no gradient
(g and u are then not saved), or where the caller disabled saved-tensor hooks, the consumer is called plainly.

Under torch.compile, where Dynamo cannot trace saved_tensors_hooks, h is produced inside a non-reentrant
checkpoint region instead: AOTAutograd's partitioner then recomputes it in backward from g and u, which it
saves anyway (the same traced ops, in the backward graph).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch
from torch.utils.checkpoint import checkpoint

from .gated_act import GatedActFunction, _check_gu, _fwd_torch, _fwd_triton, gated_act
from .saved_hooks import ChainedHooks, top_hooks

__all__ = ["gated_act_recomputed"]

T = TypeVar("T")

_top_hooks = top_hooks  # module-level, so a test can switch the hooks path off here


class _Recipe:
    """How to rebuild a saved tensor: recompute h from (packed) g and u, replay the dtype casts, then
    ``as_strided`` to the saved layout."""

    __slots__ = ("g", "u", "casts", "size", "stride", "offset")

    def __init__(self, g, u, casts: tuple[torch.dtype, ...], t: torch.Tensor) -> None:
        self.g, self.u, self.casts = g, u, casts
        self.size, self.stride, self.offset = tuple(t.size()), tuple(t.stride()), t.storage_offset()


def cast_chain(fn, device: torch.device) -> Optional[tuple[Any, tuple[torch.dtype, ...]]]:
    """Follow the dtype casts (``ToCopyBackward0`` nodes) back from autograd node ``fn``: (the first node that is not
    a cast, the cast dtypes in forward order), or None where a cast also moves devices or a node lacks the
    metadata (another torch)."""
    casts = []
    while fn is not None and type(fn).__name__ == "ToCopyBackward0":
        try:  # the metadata of the gradient a node receives is that of the forward op's output
            meta = fn._input_metadata[0]
        except (AttributeError, IndexError):
            return None
        if meta.device != device:
            return None
        casts.append(meta.dtype)
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return None
        fn = nxt[0]
    return fn, tuple(reversed(casts))


def _cast_chain(src: torch.Tensor, node, device: torch.device) -> Optional[tuple[torch.dtype, ...]]:
    """The dtypes of the casts ``h.to(d1).to(d2)...`` that produced ``src`` from the output of ``node``, or
    None when src is not such a chain (another op, a device move, a torch without node metadata)."""
    walked = cast_chain(src.grad_fn, device)
    if walked is None or walked[0] is not node or not walked[1]:
        return None
    return walked[1]


class _Hooks(ChainedHooks):
    """The pack/unpack pair for one call. Holds g and u only while the consumer runs (`release`); the recipes
    hold them as the enclosing hooks packed them (the tensors themselves without such hooks: the storages the
    gated node saves anyway), never h."""

    saved_by = "the gated MLP's recompute hooks (gated_mlp=False saves as plain autograd)"

    def __init__(self, g: torch.Tensor, u: torch.Tensor, h: torch.Tensor) -> None:
        node = h.grad_fn
        self.g, self.u, self.node = g, u, node
        self.act, self.triton_path = node.act, node.triton_path
        self.h_ptr = h.untyped_storage().data_ptr()
        self.h_dtype, self.h_shape, self.h_stride = h.dtype, tuple(h.shape), tuple(h.stride())
        self.h_device = h.device
        self.outer = _top_hooks(False)

    def release(self) -> None:
        self.g = self.u = self.node = None

    def _casts_from_h(self, t: torch.Tensor) -> Optional[tuple[torch.dtype, ...]]:
        """() when t is h or a view of h; the cast dtypes when t is (a view of) a chain of casts of h; else None."""
        if t.untyped_storage().data_ptr() == self.h_ptr:
            return () if t.dtype == self.h_dtype else None
        src = t if t._base is None else t._base
        if tuple(src.shape) != self.h_shape or tuple(src.stride()) != self.h_stride or src.storage_offset() != 0:
            return None
        return _cast_chain(src, self.node, self.h_device)

    def pack(self, t: torch.Tensor):
        casts = self._casts_from_h(t)
        if casts is None:
            return (self._opack(t),)
        return _Recipe(self._opack(self.g), self._opack(self.u), casts, t)

    def unpack(self, packed) -> torch.Tensor:
        if not isinstance(packed, _Recipe):
            return self._ounpack(packed[0])
        g, u = self._ounpack(packed.g), self._ounpack(packed.u)
        # exactly `GatedActFunction.forward`: same inputs, same kernel, same dtype, hence bitwise the same h
        h = (_fwd_triton if self.triton_path else _fwd_torch)(g, u, self.act, torch.promote_types(g.dtype, u.dtype))
        for dtype in packed.casts:
            h = h.to(dtype)
        return h.as_strided(packed.size, packed.stride, packed.offset)


def gated_act_recomputed(g: torch.Tensor, u: torch.Tensor, act: str,
                         consume: Callable[[torch.Tensor], T]) -> T:
    """``consume(act(g)·u)``; whatever ``consume`` saves of h for backward is recomputed from g and u.

    ``consume`` is run once, unchanged (hooks, adapters, quantized weights and all). Bytes saved: g and u
    (as `gated_act`) plus what ``consume`` saves that is not h or a cast of h.
    """
    _check_gu(g, u, act, "gated_act_recomputed")
    if torch.compiler.is_compiling():
        # Dynamo does not trace saved_tensors_hooks (a graph break per MLP). A checkpoint region around the
        # producer tags h "must recompute": the partitioner saves g and u and recomputes h in backward.
        return consume(checkpoint(gated_act, g, u, act, use_reentrant=False))
    h = gated_act(g, u, act)
    if not isinstance(h.grad_fn, GatedActFunction._backward_cls) or h.numel() == 0 or _top_hooks is None:
        return consume(h)  # no graph (nothing will be saved), nothing to save, or no way to chain hooks
    hooks = _Hooks(g, u, h)
    context = torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack)
    try:
        context.__enter__()
    except RuntimeError:  # saved-tensor hooks disabled by the caller (disable_saved_tensors_hooks): keep h
        hooks.release()
        return consume(h)
    try:
        return consume(h)
    finally:
        context.__exit__(None, None, None)
        hooks.release()
