"""Exact, device-independent accounting of the activation memory a forward pass keeps for backward.

Every tensor autograd saves passes through ``saved_tensors_hooks``; counting the unique storages among
them (parameters excluded) gives the bytes held between forward and backward, on any device, CPU included.
Under autocast the low-precision copies of weights that autocast caches are not activations and are skipped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn


@dataclass
class SavedEntry:
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    grad_fn: str


@dataclass
class SavedTensorLedger:
    """Context manager counting unique saved storages.

    >>> with SavedTensorLedger(model) as ledger:
    ...     loss = model(x).sum()
    >>> ledger.bytes
    """

    params: Iterable[torch.Tensor] | nn.Module | None = None
    skip_weight_copies: bool = True
    entries: list[SavedEntry] = field(default_factory=list)
    skipped_weight_copies: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.params, nn.Module):
            params = list(self.params.parameters()) + list(self.params.buffers())
        else:
            params = list(self.params or [])
        # FSDP2 parameters are DTensors without a storage of their own: use their local shards
        params = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in params if p.device.type != "meta"}
        self._params_by_numel: dict[int, list[torch.Tensor]] = {}
        for p in params:
            self._params_by_numel.setdefault(p.numel(), []).append(p)
        self._seen: set[int] = set()
        self._ctx = None

    # -- classification -------------------------------------------------------------------------
    _VIEW_FNS = ("TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "ExpandBackward0",
                 "UnsafeViewBackward0", "AliasBackward0")

    def _through_views(self, fn):
        """The first grad_fn below ``fn``'s chain of single-input views (``fn`` itself if it is no view); None where
        a view has more than one input."""
        while type(fn).__name__ in self._VIEW_FNS:
            nxt = [f for f, _ in fn.next_functions if f is not None]
            if len(nxt) != 1:
                return None
            fn = nxt[0]
        return fn

    def _is_weight_copy(self, t: torch.Tensor) -> bool:
        """A cast copy of a parameter made by autocast, of a view of one (``x @ self.weight.T``, Falcon's Linear),
        or a view of such a copy: not an activation."""
        fn = t.grad_fn
        if fn is not None:
            fn = self._through_views(fn)
            if type(fn).__name__ != "ToCopyBackward0":
                return False
            nxt = [f for f, _ in fn.next_functions if f is not None]
            src = self._through_views(nxt[0]) if len(nxt) == 1 else None
            return isinstance(getattr(src, "variable", None), nn.Parameter)
        if t.requires_grad:
            return False
        for p in self._params_by_numel.get(t.numel(), ()):  # frozen weights: a plain cast copy
            if p.dtype == t.dtype or p.device != t.device:
                continue
            cast = p.detach().to(t.dtype)
            if cast.shape == t.shape and torch.equal(cast, t):
                return True
            if cast.dim() == 2 and cast.t().shape == t.shape and torch.equal(cast.t(), t):
                return True
        return False

    def _pack(self, t: torch.Tensor):
        # Hand back a detached alias, never the tensor itself: an op's own output returned from the pack hook
        # forms a reference cycle with its grad_fn that keeps the whole graph (and model) alive.
        keep = t.detach() if t.grad_fn is not None else t
        # parameters, and views of parameters (weight.t() of weights FSDP2 gathers during forward)
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or t.device.type == "meta":
            return keep
        ptr = t.untyped_storage().data_ptr()
        if ptr in self._param_ptrs or ptr in self._seen:
            return keep
        if self.skip_weight_copies and self._is_weight_copy(t):
            self._seen.add(ptr)
            self.skipped_weight_copies += 1
            return keep
        self._seen.add(ptr)
        self.entries.append(
            SavedEntry(tuple(t.shape), t.dtype, t.untyped_storage().nbytes(), type(t.grad_fn).__name__)
        )
        return keep

    # -- context manager ------------------------------------------------------------------------
    def __enter__(self) -> "SavedTensorLedger":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def count(self) -> int:
        return len(self.entries)

    def summary(self) -> str:
        lines = [f"{self.count} saved storages, {self.bytes} bytes"]
        for e in self.entries:
            lines.append(f"  {e.nbytes:>12}  {str(e.dtype):<15} {e.shape}  ({e.grad_fn})")
        return "\n".join(lines)


def saved_bytes(fn, *args, params=None, **kwargs) -> tuple[int, object]:
    """Run ``fn(*args, **kwargs)`` and return (saved-for-backward bytes, result)."""
    with SavedTensorLedger(params) as ledger:
        out = fn(*args, **kwargs)
    return ledger.bytes, out
