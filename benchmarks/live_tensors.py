"""Exact peak of live tensor bytes over a stretch of code, on any device (CPU included), split by what they are.

Every tensor storage an ATen op creates passes through a ``TorchDispatchMode`` as an op output; a weak reference
to the storage (torch keeps one Python object per live storage) says when it is freed. Storages that exist
before tracking (parameters, buffers, optimizer state, inputs) are registered up front. Each allocation and
free is an event; the peak is the largest sum of live bytes and the event at which it was first reached. The
split at the peak is read afterwards from the storages live at that event, by what each storage was or became:

    params       parameters and buffers registered up front
    grads        storages that were some parameter's ``.grad`` (post-accumulate-grad hooks on the parameters
                 that require grad: frozen parameters are never hooked)
    optimizer    optimizer state (registered up front, or found in ``optimizer.state`` after ``step``)
    activations  everything else: saved activations, temporaries, the loss's intermediates, inputs

Why not ``torch.distributed._tools.mem_tracker.MemTracker``: it attributes by module and hooks every
parameter's gradient; this counts storages by event, which gives the split at the peak exactly and needs
nothing of the model. What it cannot see: workspace an ATen kernel allocates and frees inside one op (it is no
op output), and allocator rounding (sizes are ``nbytes``; a CUDA run also reports
``torch.cuda.max_memory_allocated``).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CATEGORIES = ("params", "grads", "optimizer", "activations")


@dataclass
class _Entry:
    nbytes: int
    alloc: int
    phase: str
    free: Optional[int] = None
    category: str = "activations"
    ref: Optional[weakref.ref] = None
    key: int = 0
    op: str = ""


@dataclass
class Peak:
    """The peak of live bytes, where it happened, and what was live then (bytes per category)."""

    bytes: int
    phase: str
    split: dict[str, int]
    untracked: int = 0  # bytes of parameters / grads / optimizer state found at the end but never seen
    phase_peaks: dict[str, int] = field(default_factory=dict)
    #: the ``activations`` bytes at the peak by the phase that allocated them (forward: kept for backward;
    #: backward / optimizer: temporaries)
    activations_by_phase: dict[str, int] = field(default_factory=dict)
    #: the largest storages live at the peak: (bytes, category, phase that allocated it, the op that made it)
    largest: list[tuple[int, str, str, str]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"peak": self.bytes, "phase": self.phase, **self.split, "untracked": self.untracked,
                "phase_peaks": dict(self.phase_peaks), "activations_by_phase": dict(self.activations_by_phase),
                "largest": [list(x) for x in self.largest]}


class LiveTensorTracker(TorchDispatchMode):
    """``with LiveTensorTracker() as t: ...`` then ``t.peak()``. Register what exists beforehand with
    :meth:`register` and hook parameters with :meth:`watch_grads`; mark stretches with :meth:`phase`.

    It only observes storages, so the package's native CPU kernels run under it as they do for a user
    (`lmbp_convert.ops.backends.cpu_native.OBSERVES_ALLOCATIONS_ONLY`): what is measured is the path a CPU run takes."""

    lmbp_observes_allocations_only = True

    def __init__(self) -> None:
        super().__init__()
        self._entries: list[_Entry] = []
        self._by_id: dict[int, _Entry] = {}  # id(storage) -> its live entry (removed when freed)
        self._event = 0
        self._live = 0
        self._peak = 0
        self._peak_event = 0
        self._phase = "setup"
        self._phase_peaks: dict[str, int] = {}
        self._hooks: list = []

    # -- bookkeeping ------------------------------------------------------------------------------------------
    def _entry_of(self, storage) -> Optional[_Entry]:
        e = self._by_id.get(id(storage))
        return e if e is not None and e.ref() is storage else None

    def _add(self, storage, category: str = "activations", op: str = "") -> _Entry:
        e = self._entry_of(storage)
        if e is not None:
            if e.nbytes == storage.nbytes():
                return e
            self._freed(e)  # resized in place: the old size is gone, the new one is a new allocation
        self._event += 1
        e = _Entry(storage.nbytes(), self._event, self._phase, category=category, key=id(storage), op=op)
        e.ref = weakref.ref(storage, lambda _r, e=e: self._freed(e))
        self._by_id[id(storage)] = e
        self._entries.append(e)
        self._live += e.nbytes
        if self._live > self._phase_peaks.get(self._phase, -1):
            self._phase_peaks[self._phase] = self._live
        if self._live > self._peak:
            self._peak, self._peak_event = self._live, self._event
        return e

    def _freed(self, e: _Entry) -> None:
        if e.free is not None:
            return
        self._event += 1
        e.free = self._event
        self._live -= e.nbytes
        if self._by_id.get(e.key) is e:
            del self._by_id[e.key]

    def _storages(self, tensors: Iterable) -> Iterable:
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                yield t.untyped_storage()

    # -- public -----------------------------------------------------------------------------------------------
    def register(self, tensors: Iterable, category: str) -> None:
        """Count storages that already exist (parameters, buffers, optimizer state, inputs) as ``category``."""
        if category not in CATEGORIES:
            raise ValueError(f"category must be one of {CATEGORIES}, not {category!r}")
        for st in self._storages(tensors):
            self._add(st, category).category = category

    def label(self, tensors: Iterable, category: str) -> None:
        """Mark the storages of ``tensors`` (live now) as ``category``, e.g. the optimizer state after a step."""
        for st in self._storages(tensors):
            e = self._entry_of(st)
            if e is not None:
                e.category = category

    def watch_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Label every gradient accumulated into ``params`` that require grad (frozen ones are left alone)."""
        for p in params:
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda q: self.label([q.grad], "grads")))

    def phase(self, name: str) -> None:
        """Name what runs from now on (``forward``, ``backward``, ``optimizer``): the peak says where it was."""
        self._phase = name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage(), op=func.__name__)
        return out

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        return super().__exit__(*exc)

    @property
    def live_bytes(self) -> int:
        return self._live

    def peak(self, check: Iterable = (), largest: int = 12) -> Peak:
        """The peak and its split. ``check``: tensors that must have been tracked (parameters, grads, optimizer
        state); the bytes of any that were not are reported as ``untracked`` (0 when the count is complete)."""
        split = dict.fromkeys(CATEGORIES, 0)
        by_phase: dict[str, int] = {}
        phase = "setup"
        live: list[_Entry] = []
        for e in self._entries:
            if e.alloc <= self._peak_event and (e.free is None or e.free > self._peak_event):
                live.append(e)
                split[e.category] += e.nbytes
                if e.category == "activations":
                    by_phase[e.phase] = by_phase.get(e.phase, 0) + e.nbytes
            if e.alloc == self._peak_event:
                phase = e.phase
        seen, untracked = set(), 0
        for st in self._storages(check):
            if id(st) in seen:
                continue
            seen.add(id(st))
            if self._entry_of(st) is None:
                untracked += st.nbytes()
        top = sorted(live, key=lambda e: -e.nbytes)[:largest]
        return Peak(self._peak, phase, split, untracked, dict(self._phase_peaks), by_phase,
                    [(e.nbytes, e.category, e.phase, e.op) for e in top])
