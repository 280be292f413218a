"""Forward hooks that put a folded-out affine back on the branches that are not folded Linears, and add a
norm's shift to the Linears that have no bias to hold it.

They are callable objects (not closures) so ``copy.deepcopy`` and pickling of a converted model carry them
with references to the copied norm, and they read γ, β from the norm module at call time, so training the
norm's parameters is seen on these branches too.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ReplacedModuleError
from ..fold import apply_affine, norm_scale, shift_behind_scale, shift_of
from ..enums import ConvertedHook
from ..trace.containers import children, has_child, replace_child
from ..trace.tracer import wants_tuple


def _affine_of(norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    params = norm._parameters  # the kept γ, β are the norm's own Parameters (`_MSNorm.reapplying`)
    weight = params.get("weight")
    if weight is None:
        weight = norm.weight
    bias = params["bias"] if "bias" in params else getattr(norm, "bias", None)
    return norm_scale(weight, norm.param), bias


class ReapplyInput(ConvertedHook):
    """Forward pre-hook: re-applies the norm's affine to one input of a module."""

    def __init__(self, norm: nn.Module, position: int | None, keyword: str | None):
        self.norm = norm
        self.position = position
        self.keyword = keyword

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        # runs on every call of the module (a GPU step's host time): the tensor is checked before the affine is read
        if self.keyword is not None:
            x = kwargs.get(self.keyword)
            if not isinstance(x, torch.Tensor):
                return None
            kwargs = dict(kwargs)
            kwargs[self.keyword] = apply_affine(x, *_affine_of(self.norm))
            return args, kwargs
        i = self.position
        if i is None or i >= len(args) or not isinstance(args[i], torch.Tensor):
            return None
        return (*args[:i], apply_affine(args[i], *_affine_of(self.norm)), *args[i + 1:]), kwargs


def _replace(obj: Any, path: list, fn) -> Any:
    if not path:
        return fn(obj) if isinstance(obj, torch.Tensor) else obj
    key, rest = path[0], path[1:]
    if not has_child(obj, key):
        return obj
    value = dict(children(obj))[key]
    return replace_child(obj, key, _replace(value, rest, fn))


class ReapplyOutput(ConvertedHook):
    """Forward hook on the model: re-applies the norm's affine where its output is returned.

    The paths name fields of the output as the trace saw it, in dict form for models that return a
    ``ModelOutput`` (the trace asks for ``return_dict=True``). A call that asks for a tuple (``return_dict=False``
    or a config that says so) is run as a dict call by ``pre``; the affine is put back by field name and the
    caller gets ``output.to_tuple()``, as the model itself would have returned — whatever the container, the
    same fields get the affine.
    """

    def __init__(self, norm: nn.Module, paths: list[list]):
        self.norm = norm
        self.paths = [list(p) for p in paths]
        self._as_tuple: list[bool] = []  # one entry per call in flight: did ``pre`` turn a tuple call into dict?

    def pre(self, module: nn.Module, args: tuple, kwargs: dict):
        flip = wants_tuple(module, kwargs)
        self._as_tuple.append(flip)
        if flip:
            return args, {**kwargs, "return_dict": True}
        return None

    def __call__(self, module: nn.Module, args: tuple, output: Any):
        as_tuple = self._as_tuple.pop() if self._as_tuple else False
        gamma, beta = _affine_of(self.norm)
        for path in self.paths:
            output = _replace(output, path, lambda t: apply_affine(t, gamma, beta))
        if as_tuple and hasattr(output, "to_tuple"):
            output = output.to_tuple()
        return output


class _Handles:
    def __init__(self, *handles: torch.utils.hooks.RemovableHandle):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def register_output_reapply(model: nn.Module, hook: ReapplyOutput) -> _Handles:
    """Register ``hook`` on the model: ``pre`` runs after earlier pre-hooks and the output hook *before* earlier
    output hooks, so several of these nest (the first one registered converts back to a tuple, last)."""
    return _Handles(model.register_forward_pre_hook(hook.pre, with_kwargs=True),
                    model.register_forward_hook(hook, prepend=True))


class AddShift(ConvertedHook):
    """Forward hook on a Linear: adds W'·β', the norm's shift seen through this Linear's current weight.

    Used when a norm with β feeds a Linear that has no bias: folding β would need a new ``bias`` entry, which a
    plain model does not have (plain save/load would drop it). Instead the shift stays a parameter of the norm
    and the converted forward adds W'·β' after the Linear, which still reads the shared, normalised tensor.
    W'·β' reads only parameters: nothing new is kept for backward.

    With the norm's affine folded away, the norm holds β' = β/γ (its state dict then is a plain norm with γ = 1
    and that shift, so plain save/load gives W'·(x̂ + β') — the same function). A norm whose affine is also
    re-applied elsewhere keeps γ, β themselves; then β' = β/γ is formed here from their current values.
    """

    def __init__(self, norm: nn.Module, layout: str, behind_scale: bool = False):
        self.norm = norm
        self.layout = layout
        self.behind_scale = behind_scale  # the norm holds γ, β (re-applied elsewhere): use β/γ

    def __call__(self, module: nn.Module, args: tuple, output: Any):
        if not isinstance(output, torch.Tensor):
            return None
        if self.behind_scale:
            gamma, beta = _affine_of(self.norm)
            if beta is None:
                return None
            beta = shift_behind_scale(beta, gamma)
        else:
            beta = getattr(self.norm, "bias", None)
            if not isinstance(beta, torch.Tensor):
                return None
        return output + shift_of(module.weight, beta, self.layout).to(output.dtype)


class FollowModule(ConvertedHook):
    """Keeps one fold hook on whatever module sits at ``path`` of the converted root, checked by a forward
    pre-hook on the root and on every module between it and ``path`` at each of their calls.

    A hook lives on a module object, and transformers replaces whole modules after convert(): resizing the
    vocabulary builds a new head and copies the old rows into it, so the folded rows survive but a shift hook on
    the old head would not (GPT-2's untied head: 0.27 off on the old tokens' logits). The hook moves to the new
    module, which is then taken as holding folded weights, as a resized copy does; its new rows w are those of an
    original head w/γ. A new module the hook cannot act on (an `AddShift` target without a weight of the folded
    width: ``nn.Identity``, another width) raises `ReplacedModuleError` rather than return unshifted values.

    The check runs on the way down too, because the module replaced may be called from below the root: PEFT's
    ``merge_and_unload()`` swaps every LoRA layer for its merged base Linear and returns the inner model, whose
    calls never reach the PeftModel's hooks (a fold's re-applied input was lost there: GPT-J 0.85 off)."""

    def __init__(self, root: nn.Module, path: str, hook: ConvertedHook, pre: bool) -> None:
        self.path, self.hook, self.pre = path, hook, pre
        self.module = root.get_submodule(path)
        self.width = _in_width(self.module, hook)
        self._handle = None

    def _register(self, module: nn.Module) -> None:
        if self.pre:
            self._handle = module.register_forward_pre_hook(self.hook, with_kwargs=True, prepend=True)
        else:
            self._handle = module.register_forward_hook(self.hook)
        self.module = module

    def root_pre(self, root: nn.Module, args: tuple, kwargs: dict, path: str | None = None):
        path = self.path if path is None else path
        try:
            current = root.get_submodule(path)
        except AttributeError:
            current = None
        if current is self.module:
            return None
        if current is None or _in_width(current, self.hook) != self.width:
            raise ReplacedModuleError(
                f"{self.path!r} was replaced after convert() by {type(current).__name__}, which cannot take the "
                f"shift convert() folded into the module it replaced (a weight of input width {self.width} is "
                "needed). Replace or resize modules before convert(), or convert with fold_norms=False (exact "
                "norms: no fold to keep).")
        self._handle.remove()
        self._register(current)
        return None

    def attach(self, root: nn.Module) -> _Handles:
        self._register(self.module)
        parts = self.path.split(".")
        follows = []
        for i in range(len(parts)):  # the root, then each module on the way down to (not including) ``path``
            above = root.get_submodule(".".join(parts[:i]))
            check = _FollowFrom(self, ".".join(parts[i:]))
            follows.append(above.register_forward_pre_hook(check, with_kwargs=True, prepend=True))
        return _Handles(*follows, _Later(self))


class _FollowFrom(ConvertedHook):
    """`FollowModule.root_pre` as seen from one module above the hooked one (``path`` relative to it)."""

    def __init__(self, follow: FollowModule, path: str) -> None:
        self.follow, self.path = follow, path

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        return self.follow.root_pre(module, args, kwargs, self.path)


class _Later:
    """Removes the hook from the module it is on when removal runs (it may have moved since registration)."""

    def __init__(self, follow: FollowModule) -> None:
        self.follow = follow

    def remove(self) -> None:
        if self.follow._handle is not None:
            self.follow._handle.remove()


def _in_width(module: nn.Module | None, hook: ConvertedHook) -> int | None:
    """The input width an `AddShift` needs of its module's weight (None for hooks that need no weight)."""
    if not isinstance(hook, AddShift):
        return None
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return -1
    return int(w.shape[-1] if hook.layout == "out_in" else w.shape[0])
