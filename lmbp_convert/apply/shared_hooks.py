"""The model-wide shared-saves region (`lmbp_convert.ops.shared_saves`) as hooks on the converted model, and the
builders of the rewrites that rely on it (`NormExact`, `LoraInputShare`).

The root module's forward pre-hook opens the region for the outermost call of this thread and its forward hook
(``always_call``) closes it, so a call of the whole model shares every noted tensor with the consumers that save
copies of it; a submodule called on its own runs without it (correct, eager autograd's bytes). Every unit that
needs the region is a user of the model's one `RegionHooks` object (found among the root's hooks): the first
registers the root's pre/post pair, the last one rolled back removes it, so any number of units costs one pair.
Callable objects, so deepcopy and pickling carry them (a copy starts closed).
"""
from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from ..enums import ConvertedHook, NormType, WeightParam
from ..match.lora_inputs import LoraInputShare
from ..match.norm_exact import NormExact
from ..ops.shared_saves import SharedSaves, note_identity
from .rewrite import Unit, UnitBuilder

__all__ = ["RegionHooks", "NoteInput", "add_region"]


class RegionHooks(ConvertedHook):
    """Forward pre-hook of the root: opens the region for the outermost call (per thread)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.handles: list = []
        self.users = 0

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():
            return None
        loc = self._local
        depth = getattr(loc, "depth", 0)
        if depth == 0:
            region = SharedSaves()
            loc.region = region if region.enter() else None
        loc.depth = depth + 1
        return None

    def close(self) -> None:
        if torch.compiler.is_compiling():
            return
        loc = self._local
        depth = getattr(loc, "depth", 0)
        if depth <= 0:
            return
        loc.depth = depth - 1
        if depth == 1 and getattr(loc, "region", None) is not None:
            loc.region.exit()
            loc.region = None

    def __getstate__(self) -> dict:
        return {"users": self.users}

    def __setstate__(self, state: dict) -> None:
        self._local = threading.local()
        self.handles, self.users = [], state.get("users", 0)


class _Close(ConvertedHook):
    def __init__(self, hooks: RegionHooks) -> None:
        self.hooks = hooks

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.hooks.close()
        return None


class NoteInput(ConvertedHook):
    """Forward pre-hook of a LoRA layer: its input may stand in for the adapters' cast copies of it. It only notes
    (``only_notes``): a fused op that computes the layer's output itself (the gated MLP's down) may skip it."""

    only_notes = True

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("x", kwargs.get("input"))
        if isinstance(x, torch.Tensor):
            note_identity(x)
        return None


def _region_hooks(model: nn.Module) -> RegionHooks | None:
    for h in model._forward_pre_hooks.values():
        if isinstance(h, RegionHooks):
            return h
    return None


class _RegionUse:
    """One unit's use of the model's region: the first use registers the root's pre/post pair, the last one
    removed takes it away (one pair per model, however many units need it)."""

    def __init__(self, model: nn.Module) -> None:
        hooks = _region_hooks(model)
        if hooks is None:
            hooks = RegionHooks()
            hooks.handles = [model.register_forward_pre_hook(hooks, with_kwargs=True, prepend=True),
                             model.register_forward_hook(_Close(hooks), with_kwargs=True, always_call=True)]
            hooks.users = 0
        hooks.users += 1
        self.hooks = hooks

    def remove(self) -> None:
        hooks, self.hooks = self.hooks, None
        if hooks is not None:
            hooks.users -= 1
            if hooks.users == 0:
                for h in hooks.handles:
                    h.remove()


def add_region(builder: UnitBuilder, unit: Unit) -> None:
    """Make the unit open the model's region around every call of the root (see the module doc)."""
    model = builder.model
    builder.add_hook(unit, lambda: _RegionUse(model))


def lora_inputs(builder: UnitBuilder, item: LoraInputShare) -> Unit:
    from ..nn.dropout import BitDropout

    unit = Unit(f"LoRA inputs {item.name}")
    layer = builder.modules[item.name]
    for adapter in item.dropouts:
        old = getattr(layer, item.dropout_attr)[adapter]
        builder.swap_module(unit, f"{item.name}.{item.dropout_attr}.{adapter}", BitDropout(old.p))
    builder.add_hook(unit, lambda: layer.register_forward_pre_hook(NoteInput(), with_kwargs=True))
    add_region(builder, unit)
    return unit


def exact_norm(builder: UnitBuilder, item: NormExact) -> Unit:
    from ..nn.exact_norms import MSExactNorm

    unit = Unit(f"norm {item.name} (exact)")
    old = builder.modules[item.name]
    out = getattr(torch, item.out_dtype.rsplit(".", 1)[-1]) if item.out_dtype else None
    new = MSExactNorm(NormType(item.norm_type), tuple(item.shape), item.eps, old.weight,
                      old.bias if item.has_bias else None, WeightParam(item.param), out_dtype=out,
                      channel_dim=item.channel_dim, autocast_readers=item.linear_readers_only, replaced=old)
    builder.swap_module(unit, item.name, new)
    add_region(builder, unit)
    return unit
