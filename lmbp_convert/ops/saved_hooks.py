"""What every saved-tensor hooks pair of this package shares: chaining to the enclosing pair, and autograd's
version check on what it keeps.

Saved-tensor hooks do not nest (only the innermost pair runs), so a pair that replaces some saved tensors by
recipes (`lmbp_convert.ops.shared_saves`, `region_recompute`, `gated_recompute`, `replay_norm`) hands every other
tensor to the enclosing pair (a `SavedTensorLedger`, ``save_on_cpu``) itself: `ChainedHooks`.

Autograd checks a saved tensor's version counter at unpack ("modified by an inplace operation") only for tensors
saved *without* hooks: a tensor that passes through any pack hook loses the check. Where this package's hooks are
the outermost (no enclosing pair: what plain autograd would have saved and checked itself), `ChainedHooks` keeps
the tensor with the version it had when saved and checks it at unpack, with autograd's message, so an in-place
edit between forward and backward (a weight under ``no_grad``, an ``optimizer.step()``) raises as it does on the
unconverted model. Under enclosing hooks the check is theirs, as it would be without this package.
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

__all__ = ["ChainedHooks", "Watched", "check_version", "top_hooks"]

# The innermost (pack, unpack) pair; private in torch. Without it (another torch) the pairs here do not open.
top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def check_version(t: torch.Tensor, saved: int, what: str, now: Optional[int] = None) -> None:
    """Raise autograd's own error where ``t`` was modified in place since it was saved at version ``saved``
    (``now``: the version to compare, where it is not ``t``'s own: a tensor watched through another)."""
    now = t._version if now is None else now
    if now != saved:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{t.type()} {list(t.shape)}] is at version {now}; expected version {saved} instead "
            f"(saved through {what}). Hint: do not modify in place, between forward and backward, a tensor that "
            "backward needs (a weight under no_grad, an optimizer step before backward).")


class Watched:
    """A tensor an op reads again in backward to *recompute* from it (a weight, a kept input), where the original
    kept the product and an edit since forward could not reach its gradient: the version it had in forward, held
    weakly (it keeps nothing alive that enclosing hooks free or move). `modified` tells a tensor backward reads
    that is still that storage (a copy enclosing hooks made, ``save_on_cpu`` to another device, is unaffected)."""

    __slots__ = ("ref", "version", "ptr")

    def __init__(self, t: torch.Tensor) -> None:
        base = t if t._base is None else t._base  # the tensor whose version counter its views share
        self.ref, self.version, self.ptr = weakref.ref(base), base._version, t.data_ptr()

    def modified(self, t: Optional[torch.Tensor] = None) -> Optional[int]:
        """The tensor's version now, where it was modified in place since forward and ``t`` (what backward reads;
        None: not yet unpacked) is its storage; else None."""
        base = self.ref()
        if base is None or base._version == self.version or (t is not None and t.data_ptr() != self.ptr):
            return None
        return base._version

    def check(self, t: torch.Tensor, what: str) -> None:
        now = self.modified(t)
        if now is not None:
            check_version(t, self.version, what, now)


class _Held:
    """A saved tensor kept as it is, with the version autograd would have checked."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor, self.version = t, t._version


class ChainedHooks:
    """Saved-tensor hooks that hand what they do not replace to the enclosing pair (``outer``, from `top_hooks`
    when they open; None: no enclosing hooks, and `_ounpack` checks the version as autograd would). ``saved_by``:
    what the error names (the mechanism and rewrite that saved the tensor)."""

    outer = None
    saved_by = "lmbp-convert's saved-tensor hooks"

    def _opack(self, t: Any):
        if self.outer is not None:
            return self.outer[0](t)
        return _Held(t) if isinstance(t, torch.Tensor) else t

    def _ounpack(self, packed) -> Any:
        if self.outer is not None:
            return self.outer[1](packed)
        if isinstance(packed, _Held):
            check_version(packed.tensor, packed.version, self.saved_by)
            return packed.tensor
        return packed
