"""Forward hooks that put a folded-out affine back on the branches that are not folded Linears.

They are callable objects (not closures) so ``copy.deepcopy`` and pickling of a converted model carry them
with references to the copied norm, and they read γ, β from the norm module at call time, so training the
norm's parameters is seen on these branches too.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..fold import apply_affine


def _affine_of(norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = norm.weight
    gamma = 1.0 + w if getattr(norm, "reapply_param", "w") == "1+w" else w
    return gamma, getattr(norm, "bias", None)


class ReapplyInput:
    """Forward pre-hook: re-applies the norm's affine to one input of a module."""

    def __init__(self, norm: nn.Module, position: int | None, keyword: str | None):
        self.norm = norm
        self.position = position
        self.keyword = keyword

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        gamma, beta = _affine_of(self.norm)
        if self.keyword is not None:
            if self.keyword in kwargs and isinstance(kwargs[self.keyword], torch.Tensor):
                kwargs = dict(kwargs)
                kwargs[self.keyword] = apply_affine(kwargs[self.keyword], gamma, beta)
                return args, kwargs
            return None
        if self.position is not None and self.position < len(args) and isinstance(args[self.position], torch.Tensor):
            args = list(args)
            args[self.position] = apply_affine(args[self.position], gamma, beta)
            return tuple(args), kwargs
        return None


def _replace(obj: Any, path: list, fn) -> Any:
    if not path:
        return fn(obj) if isinstance(obj, torch.Tensor) else obj
    key, rest = path[0], path[1:]
    if isinstance(obj, dict):
        if key in obj:
            obj[key] = _replace(obj[key], rest, fn)
        return obj
    if isinstance(obj, (list, tuple)) and isinstance(key, int) and key < len(obj):
        items = list(obj)
        items[key] = _replace(items[key], rest, fn)
        return type(obj)(items) if isinstance(obj, list) else (
            type(obj)(*items) if hasattr(obj, "_fields") else tuple(items))
    return obj


class ReapplyOutput:
    """Forward hook on the model: re-applies the norm's affine where its output is returned."""

    def __init__(self, norm: nn.Module, paths: list[list]):
        self.norm = norm
        self.paths = [list(p) for p in paths]

    def __call__(self, module: nn.Module, args: tuple, output: Any):
        gamma, beta = _affine_of(self.norm)
        for path in self.paths:
            output = _replace(output, path, lambda t: apply_affine(t, gamma, beta))
        return output
