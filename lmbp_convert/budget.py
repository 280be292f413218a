"""Activation checkpointing on only as many layers as a memory budget needs.

Checkpointing every layer (HF ``gradient_checkpointing_enable``, timm ``set_grad_checkpointing``) recomputes the
whole forward in backward; a converted model often fits its budget with fewer layers recomputed.
:func:`checkpoint_for_budget` runs one probe forward under a :class:`~lmbp_convert.SavedTensorLedger` that also
records which storages each layer saves (``kept``) and which tensor inputs it gets (what a checkpoint of it would
hold, ``checkpointed``), and what is saved outside the layers. For a choice S of layers the prediction is the
bytes of the union of those storage sets (the outside, ``kept`` of the layers not in S, the inputs of those in
S): exact within that forward, shared storages (rotary tables, masks) counted once. In backward, the recompute of
a checkpointed layer holds its ``kept`` again while what the forward saved before it is still held; the peak is
the larger of the two. Layers are chosen greedily (each step the one that lowers the predicted peak most), as
few as meet the budget; ``verify`` measures the changed model on the probe again.

The budget counts activation bytes held for backward on the probe: what the ledger counts (the loss's too when
the model computes it, e.g. ``labels`` in the probe) plus what checkpoints hold as inputs (the ledger misses a
checkpoint's keyword tensor inputs, which it holds by reference). Parameters, gradients, optimizer state and
backward's own temporaries are not in it; ``benchmarks.step_peak`` measures those for a whole step.

A layer is checkpointed through an instance attribute: its ``forward`` becomes a callable that runs the original
``forward`` under ``torch.utils.checkpoint.checkpoint`` while grad is enabled (its own hooks stay outside the
checkpoint, as transformers 5 does). :meth:`ActivationBudget.undo` restores it.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from .errors import BudgetError
from .memory import SavedTensorLedger
from .trace.tracer import call_model


class _CheckpointedForward:
    """A layer's ``forward`` run under ``torch.utils.checkpoint`` while grad is enabled. A plain object holding the
    bound original, so ``copy.deepcopy`` of the model binds the copy to the copied layer."""

    def __init__(self, forward: Callable, use_reentrant: bool) -> None:
        self.forward = forward
        self.use_reentrant = use_reentrant

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        if self.use_reentrant:  # reentrant checkpoints take positional tensors only (grads flow through those)
            return checkpoint(functools.partial(self.forward, **kwargs), *args, use_reentrant=True)
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


def _checkpoint_layer(layer: nn.Module, use_reentrant: bool) -> Callable[[], None]:
    """Checkpoint ``layer``; returns the function that restores it."""
    own = layer.__dict__.get("forward")
    if isinstance(own, _CheckpointedForward):
        raise BudgetError(f"{type(layer).__name__} is already checkpointed by checkpoint_for_budget: call undo() on "
                          "the ActivationBudget that did it first")
    layer.forward = _CheckpointedForward(layer.forward, use_reentrant)

    def restore() -> None:
        if own is None:
            layer.__dict__.pop("forward", None)
        else:
            layer.forward = own

    return restore


def find_layers(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """The model's layer stack: of the ``ModuleList`` / ``Sequential`` containers whose members (at least two) are
    all of one class and have parameters, the one whose members hold the most parameters (decoder layers, not
    the experts inside one)."""
    best: tuple[int, str, list[nn.Module]] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) < 2:
            continue
        members = list(mod)
        if len({type(m) for m in members}) != 1:
            continue
        n = sum(p.numel() for m in members for p in m.parameters())
        if n and (best is None or n > best[0]):
            best = (n, name, members)
    if best is None:
        raise BudgetError(f"{type(model).__name__} has no list of repeated layers (a ModuleList or Sequential of "
                          "one module class with parameters): pass layers=[...]")
    return best[1], best[2]


@dataclass
class LayerBytes:
    """Bytes of one layer on the probe: what it saves for backward run as it is (``kept``, shared storages
    included), and what a checkpoint of it holds (``checkpointed``: its tensor inputs)."""

    name: str
    kept: int
    checkpointed: int


@dataclass
class ActivationBudget:
    """What :func:`checkpoint_for_budget` chose and predicted. ``undo()`` restores every layer it changed."""

    budget_bytes: int
    layers: list[LayerBytes]
    checkpointed: list[str]
    outside_bytes: int  # kept outside the layers (embeddings, head, the loss when the model computes it)
    predicted_bytes: int  # kept for backward after the forward, with the chosen layers checkpointed
    predicted_peak_bytes: int  # the larger of that and the recompute bound
    bytes_without: int  # no layer checkpointed
    bytes_all: int  # every layer checkpointed
    measured_bytes: Optional[int] = None  # the ledger on the probe after the change (verify=True)
    #: every option in the order layers are added: (layers checkpointed, predicted bytes, predicted peak)
    choices: list[tuple[int, int, int]] = field(default_factory=list)
    _restore: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def recompute_fraction(self) -> float:
        """Fraction of the layers whose forward backward runs again."""
        return len(self.checkpointed) / len(self.layers) if self.layers else 0.0

    def undo(self) -> None:
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()
        self.checkpointed = []

    def __str__(self) -> str:
        mib = 2 ** 20
        lines = [f"activation budget {self.budget_bytes / mib:.1f} MiB: {len(self.checkpointed)} of "
                 f"{len(self.layers)} layers checkpointed (recompute {self.recompute_fraction:.0%} of the layers)",
                 f"  predicted: {self.predicted_bytes / mib:.1f} MiB kept for backward, peak "
                 f"{self.predicted_peak_bytes / mib:.1f} MiB with a layer's recompute (none checkpointed: "
                 f"{self.bytes_without / mib:.1f} MiB, all: {self.bytes_all / mib:.1f} MiB)"]
        if self.measured_bytes is not None:
            lines.append(f"  the ledger on the probe: {self.measured_bytes / mib:.1f} MiB saved for backward "
                         "(a checkpoint's keyword tensor inputs are held by reference, which it does not count)")
        return "\n".join(lines)


class _RegionLedger(SavedTensorLedger):
    """A ledger that also records which counted storages each region saves, repeats included: a layer (its
    index), or a gap outside the layers (``("gap", k)``: after k layers ran), and each layer's tensor inputs.
    Storage sets whose unions are exact within this one forward."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.region: Any = ("gap", 0)
        self.saved: dict[Any, set[int]] = {}
        self.inputs: dict[int, set[int]] = {}
        self.size: dict[int, int] = {}
        self.order: list[int] = []  # layers in the order they ran
        self._held: list = []  # the input storages, alive to the end: their addresses stay theirs

    def _pack(self, t: torch.Tensor):
        n = len(self.entries)
        keep = super()._pack(t)
        if t.device.type != "meta":
            ptr = t.untyped_storage().data_ptr()
            if len(self.entries) > n:
                self.size[ptr] = self.entries[-1].nbytes
            if ptr in self.size:
                self.saved.setdefault(self.region, set()).add(ptr)
        return keep

    def enter(self, i: int, args: tuple, kwargs: dict) -> None:
        self.region = i
        self.order.append(i)
        ins = self.inputs.setdefault(i, set())
        for t in (*tree_leaves(args), *tree_leaves(kwargs)):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st.data_ptr() not in self._param_ptrs and st.nbytes():
                    self._held.append(st)
                    ins.add(st.data_ptr())
                    self.size.setdefault(st.data_ptr(), st.nbytes())

    def leave(self) -> None:
        self.region = ("gap", len(self.order))


def _measure(model: nn.Module, layers: Sequence[nn.Module], names: Sequence[str], probe: Any) -> _RegionLedger:
    """One forward on ``probe`` under a region ledger; every layer must run exactly once."""
    handles = []
    with _RegionLedger(model) as led:
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(
                lambda _m, a, kw, i=i: led.enter(i, a, kw), with_kwargs=True))
            handles.append(layer.register_forward_hook(lambda *_a: led.leave()))
        try:
            out = call_model(model, probe)
        finally:
            for h in handles:
                h.remove()
    del out
    for i in range(len(layers)):
        if led.order.count(i) != 1:
            raise BudgetError(f"layer {names[i]} ran {led.order.count(i)} times on the probe, not once: per-layer "
                              "bytes need each layer called once per forward (pass layers=[...] to choose others)")
    return led


@contextlib.contextmanager
def _probe_state(model: nn.Module):
    """Train mode and grad on for the probe forwards; the RNG streams and the mode as they were afterwards."""
    was = model.training
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        model.train()
        try:
            yield
        finally:
            model.train(was)


def _layers_of(model: nn.Module, layers: Optional[Sequence[nn.Module]]) -> tuple[list[nn.Module], list[str]]:
    if layers is None:
        where, found = find_layers(model)
        return found, [f"{where}.{i}" if where else str(i) for i in range(len(found))]
    layers = list(layers)
    by_module = {id(m): n for n, m in model.named_modules()}
    missing = [i for i, m in enumerate(layers) if id(m) not in by_module]
    if missing or not layers:
        raise ValueError(f"layers must be a non-empty list of the model's submodules; not one: positions {missing}")
    return layers, [by_module[id(m)] for m in layers]


def checkpoint_for_budget(model: nn.Module, budget_bytes: int, probe: Any, *,
                          layers: Optional[Sequence[nn.Module]] = None, use_reentrant: bool = False,
                          verify: bool = True) -> ActivationBudget:
    """Checkpoint as few of ``model``'s layers as keep the activation bytes of a forward on ``probe`` (an input
    as ``convert``'s ``probe``: a dict of keyword arguments, a tuple or one tensor, at the shape you train with)
    within ``budget_bytes``: the storages autograd saves (as ``SavedTensorLedger`` counts them) plus those a
    checkpoint holds as its inputs, and the recompute of one layer in backward. ``layers``: the layer modules
    (default: :func:`find_layers`). Raises :class:`~lmbp_convert.errors.BudgetError` (the model unchanged) when
    even checkpointing every layer does not fit. Returns the :class:`ActivationBudget` (``undo()`` reverts)."""
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be a non-negative int, not {budget_bytes!r}")
    layers, names = _layers_of(model, layers)
    done = [n for n, m in zip(names, layers) if isinstance(m.__dict__.get("forward"), _CheckpointedForward)]
    if done:
        raise BudgetError(f"{', '.join(done)} already checkpointed by checkpoint_for_budget: call undo() on the "
                          "ActivationBudget that did it first (the layers would be measured checkpointed)")
    with _probe_state(model):
        led = _measure(model, layers, names, probe)
    n = len(layers)
    run = led.order  # position in the forward -> layer index
    gaps = [led.saved.get(("gap", k), set()) for k in range(n + 1)]  # gaps[k]: saved after k layers ran
    outside = set().union(*gaps)
    kept = [led.saved.get(i, set()) for i in range(n)]
    ins = [led.inputs.get(i, set()) for i in range(n)]

    def nbytes(ptrs: set[int]) -> int:
        return sum(led.size[p] for p in ptrs)

    def predict(chosen: set[int]) -> tuple[int, int]:
        """(bytes kept after the forward, the peak with the recompute of one layer): backward recomputes the
        layer at position k while what the forward saved before it is still held."""
        held = [ins[i] if i in chosen else kept[i] for i in run]
        total = nbytes(outside.union(*held))
        recompute = max((nbytes(set().union(*gaps[:k + 1], *held[:k], kept[i], ins[i]))
                         for k, i in enumerate(run) if i in chosen), default=0)
        return total, max(total, recompute)

    order: list[int] = []  # greedy: each step checkpoints the layer that lowers the prediction most
    while len(order) < n:
        rest = [i for i in range(n) if i not in order]
        order.append(min(rest, key=lambda i: (predict({*order, i})[1], i)))
    choices = [(k, *predict(set(order[:k]))) for k in range(n + 1)]
    without, (_, everything, best_peak) = choices[0][1], choices[-1]
    for k, total, peak in choices:
        if peak <= budget_bytes:
            chosen = set(order[:k])
            break
    else:
        raise BudgetError(f"an activation budget of {budget_bytes} bytes cannot be met on this probe: with every one "
                          f"of the {n} layers checkpointed a forward keeps {everything} bytes and recomputing a "
                          f"layer peaks at {best_peak} bytes ({nbytes(outside)} of them outside the layers)")
    rows = [LayerBytes(names[i], nbytes(kept[i]), nbytes(ins[i])) for i in range(n)]
    plan = ActivationBudget(budget_bytes, rows, [names[i] for i in sorted(chosen)], nbytes(outside), total, peak,
                            without, everything, choices=choices)
    plan._restore = [_checkpoint_layer(layers[i], use_reentrant) for i in sorted(chosen)]
    if verify:
        try:
            with _probe_state(model):
                plan.measured_bytes = _measure(model, layers, names, probe).bytes
        except BaseException:
            plan.undo()
            raise
    return plan


__all__ = ["ActivationBudget", "LayerBytes", "checkpoint_for_budget", "find_layers"]
