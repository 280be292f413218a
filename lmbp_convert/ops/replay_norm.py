"""The exact norm in full precision: keep the norm's input, replay the original module's own ops in backward.

Why: the memory-sharing norm's backward from x̂ and rstd (`lmbp_convert.ops.exact_norm`) is exact up to fp32
rounding, and training amplifies rounding (an fp32 LLaMA fine-tune under AdamW turns ulp-level gradient
differences into |Δ loss| ~1e-4 within a few hundred steps: docs/fidelity.md). Keeping the norm's *input* x
instead costs the same bytes (x and x̂ have one shape and, outside autocast, one dtype; rstd is not kept at all)
and lets backward run the replaced module's own forward again with autograd, so every gradient (the input's, γ's,
β's) is computed by the very ops, in the very order, the unconverted model runs: bitwise its gradients, for any
norm implementation (LayerNorm, a Python RMSNorm, Gemma's 1 + w), with no per-architecture code. The consumers'
copies of y are rebuilt from x by the same forward (`shared_saves.note`), bitwise the forward's y.

The price: the norm's forward runs twice more per step (once to rebuild y for the consumers, once with autograd
in backward), a bandwidth-bound pass next to the Linears that read y.

`OriginalForward` holds a shell of the replaced module: its class and attributes (eps, ...), no Parameters of its
own. Each call passes γ, β explicitly (the converted module's current Parameters, or detached leaves in
backward, so hooks on the Parameters fire once, on the outer accumulation), which keeps the shell valid after
``model.to()``, ``load_state_dict`` or a Parameter replaced by accelerate.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from . import func_transforms
from .saved_hooks import ChainedHooks, check_version, top_hooks
from .shared_saves import can_note, note

__all__ = ["OriginalForward", "replay_norm", "replays"]

_FULL = (torch.float32, torch.float64)


def replays(x: torch.Tensor, *params: Optional[torch.Tensor]) -> bool:
    """Whether a norm call on ``x`` with γ, β ``params`` takes the replay: full precision (x and the parameters
    fp32 / fp64 alike, no autocast: under autocast x would be twice the autocast-dtype x̂ the memory-sharing path
    keeps), eager autograd that needs a gradient here, no torch.func transform, and the shared-saves region open
    with its hooks innermost (`shared_saves.can_note`), which rebuilds the consumers' copies of y. And x must be
    all of its storage: keeping a view (a pooled token ``h[:, 0]``) would keep the whole tensor it views, where
    x̂ is x's size."""
    ps = [p for p in params if p is not None]
    # the storage test last: dynamo cannot trace it and torch.func's wrappers have no storage
    return (x.dtype in _FULL and all(p.dtype == x.dtype for p in ps) and torch.is_grad_enabled()
            and (x.requires_grad or any(p.requires_grad for p in ps))
            and not torch.is_autocast_enabled("cuda" if x.is_cuda else x.device.type)
            and not torch.compiler.is_compiling() and not func_transforms.active() and can_note()
            and x.untyped_storage().nbytes() <= x.numel() * x.element_size())


class OriginalForward:
    """The replaced norm's class ``forward`` on a shell of the module, with γ (``weight``) and β (``bias``) given
    per call. ``of(module, weight, bias)`` is None where the shell could not stand in for the module: it has
    Parameters other than ``weight`` / ``bias``, other Parameter objects than the converted module's, buffers or
    submodules (state a shell would not see moved or loaded)."""

    __slots__ = ("shell",)

    def __init__(self, shell: nn.Module) -> None:
        self.shell = shell

    @classmethod
    def of(cls, module: nn.Module, weight: nn.Parameter, bias: Optional[nn.Parameter]) -> Optional["OriginalForward"]:
        own = {n: p for n, p in module._parameters.items() if p is not None}
        if set(own) - {"weight", "bias"} or own.get("weight") is not weight or own.get("bias") is not bias:
            return None
        if any(b is not None for b in module._buffers.values()) or len(module._modules):
            return None
        shell = copy.copy(module)  # a new object with the module's attributes; its dicts are replaced below
        shell._parameters, shell._buffers, shell._modules = {}, {}, {}
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            if hooks in shell.__dict__:
                setattr(shell, hooks, type(getattr(shell, hooks))())
        return cls(shell)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        shell = self.shell
        shell._parameters = {"weight": weight, "bias": bias}
        try:
            return type(shell).forward(shell, x)  # the class's forward: no instance override, no module hooks
        finally:
            shell._parameters = {}

    def __deepcopy__(self, memo) -> "OriginalForward":
        return OriginalForward(copy.deepcopy(self.shell, memo))


class _Slot:
    """A saved tensor of the norm's own ops other than x and γ, β: recomputed, not kept."""

    __slots__ = ("run", "index")

    def __init__(self, run: "_Run", index: int) -> None:
        self.run, self.index = run, index


class _Run(ChainedHooks):
    """One call of the norm: its saved-tensor hooks in forward, and the recomputation in backward.

    Forward runs the original ops with autograd, so the graph is the unconverted model's (the same nodes, hence
    the same order in which gradients are summed where x has several readers); every tensor those nodes save,
    except x and the Parameters (handed to the enclosing hooks as they are), becomes a `_Slot`. The first slot
    unpacked (or the consumers' rebuild of y, which comes first) runs the forward once more on the same inputs and
    records its saves in the same order: the same values, bitwise. γ, β are re-read at recompute (a sharding
    wrapper re-gathers them), with the versions they had in forward checked as autograd checks what it saves."""

    saved_by = "an exact norm's replay (norms=False saves as plain autograd)"

    def __init__(self, fn: OriginalForward, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> None:
        self.fn, self.outer = fn, top_hooks(False)
        self.x_packed, self.x_version, self.x_grad = self._opack(x), x._version, x.requires_grad
        self.params = (w, b)
        self.param_versions = tuple(None if p is None else p._version for p in (w, b))
        self.kept = {t.untyped_storage().data_ptr() for t in (x, w, b) if t is not None}
        self.slots = 0
        self.values: Optional[list] = None

    def _kept(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.kept

    def pack(self, t: torch.Tensor):
        if self._kept(t):
            return (self._opack(t),)
        self.slots += 1
        return _Slot(self, self.slots - 1)

    def unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, _Slot):
            return packed.run.value(packed.index)
        return self._ounpack(packed[0])

    def value(self, index: int) -> torch.Tensor:
        if self.values is None:
            self.recompute()
        return self.values[index]

    def inputs(self) -> tuple:
        """x, γ, β as the forward read them; autograd's error where one was modified in place since."""
        x = self._ounpack(self.x_packed)
        check_version(x, self.x_version, self.saved_by + ": the norm's input")
        for p, version in zip(self.params, self.param_versions):
            if p is not None:
                check_version(p, version, self.saved_by + ": the norm's weight or bias")
        return (x, *self.params)

    def recompute(self) -> torch.Tensor:
        """y, by the forward's ops on the same inputs; records the saves the slots stand for."""
        x, w, b = self.inputs()
        values: list = []
        leaves = (x.detach().requires_grad_(self.x_grad), _leaf(w), _leaf(b))
        # the inputs' storages now: a sharding wrapper (FSDP2) may have freed and re-gathered γ, β since forward
        kept = {t.untyped_storage().data_ptr() for t in leaves if t is not None}

        def record(t: torch.Tensor):
            # detached: the backward formulas read only the values, and a recorded tensor with its history (an
            # output its own node saves, rsqrt's) keeps the recomputed graph alive from C++, where the garbage
            # collector cannot reach it: a leak of every step's recomputation
            if t.untyped_storage().data_ptr() not in kept:
                values.append(t.detach())
            return None

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(record, lambda _: None):
            y = self.fn(*leaves)
        if len(values) != self.slots:
            raise RuntimeError(f"an exact norm's recomputation saved {len(values)} tensors where its forward saved "
                               f"{self.slots}: the replaced module's forward is not deterministic")
        self.values = values
        return y.detach()


def _leaf(p: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if p is None else p.detach().requires_grad_(p.requires_grad)


def _rebuild(run: _Run) -> torch.Tensor:
    return run.recompute() if run.values is None else run.fn(*run.inputs())


def replay_norm(fn: OriginalForward, x: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``fn(x, weight, bias)`` with the original's autograd graph, keeping x (and γ, β) only: its own saves are
    recomputed in backward, and its consumers' copies of y are rebuilt from x (the model-wide shared-saves region
    must be open: `shared_saves.can_note`). None where saved-tensor hooks are disabled (call ``fn`` plainly)."""
    run = _Run(fn, x, weight, bias)
    try:
        ctx = torch.autograd.graph.saved_tensors_hooks(run.pack, run.unpack)
        ctx.__enter__()
    except RuntimeError:  # saved-tensor hooks disabled by the caller
        return None
    try:
        y = fn(x, weight, bias)
    finally:
        ctx.__exit__(None, None, None)
    note(y, _rebuild, run)
    return y
