"""The hooks of a `RecomputeRegion` item: a module's call is one `lmbp_convert.ops.region_recompute.Region`, and
its activation modules report each (input, output) pair to the region that is open.

Callable objects (not closures), so ``copy.deepcopy`` and pickling of a converted model carry them; the
activation hooks share their module's `RegionHooks` (deepcopy keeps the sharing).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..enums import ConvertedHook
from ..ops.region_recompute import Region


def _first_float(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a
    return None


class RegionHooks(ConvertedHook):
    """Forward pre-hook (opens a region for the call) and forward hook (closes it, also when forward raises)."""

    def __init__(self) -> None:
        self.open: list[Region] = []  # a stack: a module may be re-entered (activation checkpointing)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        region = Region()
        if region.enter(_first_float(args, kwargs)):
            self.open.append(region)
        else:
            self.open.append(None)
        return None

    def close(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.open:
            region = self.open.pop()
            if region is not None:
                region.exit()
        return None

    def __getstate__(self) -> dict:
        return {"open": []}  # an open region belongs to a running forward, never to a copy


class _Close(ConvertedHook):
    def __init__(self, hooks: RegionHooks) -> None:
        self.hooks = hooks

    def __call__(self, module, args, kwargs, output):
        return self.hooks.close(module, args, kwargs, output)


class ActNote(ConvertedHook):
    """Forward hook of an activation module: tells the open region that ``output = act(input)``."""

    def __init__(self, hooks: RegionHooks) -> None:
        self.hooks = hooks

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        region = self.hooks.open[-1] if self.hooks.open else None
        if region is not None and args and isinstance(args[0], torch.Tensor):
            region.note_act(module.forward, args[0], output)
        return None


def register_region(module: nn.Module, acts: list[nn.Module]) -> list[torch.utils.hooks.RemovableHandle]:
    """Hook ``module`` and its activation modules ``acts``; returns the handles (remove them to undo)."""
    hooks = RegionHooks()
    handles = [module.register_forward_pre_hook(hooks, with_kwargs=True),
               module.register_forward_hook(_Close(hooks), with_kwargs=True, always_call=True)]
    handles += [act.register_forward_hook(ActNote(hooks)) for act in acts]
    return handles
