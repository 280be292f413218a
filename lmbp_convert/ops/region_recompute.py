"""Inside one module call, keep only the gate and up outputs of ``act(g)·u`` products and the module's input:
what autograd saves of ``act(g)``, of the product, or of rows gathered from the input is recomputed in backward.

A mixture-of-experts layer computes every expert's gated MLP in its own code (a loop over experts, a batched or
a grouped matmul over the routed rows); there is no MLP module to replace. Its data flow is the same as a dense
gated MLP's, though: the routed rows ``x = y[idx]`` (y: the layer's input), ``g, u`` from one projection,
``a = act(g)`` by an activation *module*, ``h = a·u`` into the down projection. Autograd keeps ``x``, ``g|u``,
``a`` and ``h``; only ``g|u`` (and y, which the router keeps anyway) are needed. A ``saved_tensors_hooks``
context held for the duration of the call (`Region`) turns every saved tensor that *is* one of

* ``a``, an output of the noted activation (`Region.note_act`): recomputed as ``act.forward(g)``;
* ``h``, a product with such an ``a`` (``MulBackward0`` whose operand is that activation's node): ``a·u`` in
  the forward's operand order;
* ``x``, rows of the region's input gathered by an integer index (``IndexBackward0`` on the input's node):
  ``y[idx]``; likewise a parameter's rows gathered per routed row (``P[ids]`` of a batched matmul): ``P[ids]``;

or a dtype cast (chain) or a view of one — and an autocast cast of one expert's slice of a parameter
(``P[e].to(bf16)`` in a per-expert loop: autocast caches casts of whole parameters only) — into a recipe holding g, u, y and the index as the enclosing hooks
pack them. The recomputation runs the forward's own ops on the same tensors, so it is bitwise the forward's
value. Everything else goes to the enclosing hooks (a `SavedTensorLedger`, ``save_on_cpu``) unchanged.
Under torch.compile (Dynamo does not trace saved-tensor hooks) or where the caller disabled saved-tensor hooks,
nothing is recomputed: correct, with the bytes of eager autograd.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from .gated_recompute import cast_chain
from .saved_hooks import ChainedHooks, top_hooks

__all__ = ["Region"]


class _Recipe:
    __slots__ = ("kind", "parts", "casts", "size", "stride", "offset", "fn")

    def __init__(self, kind: str, parts: tuple, casts: tuple[torch.dtype, ...], t: torch.Tensor,
                 fn: Optional[Callable] = None) -> None:
        self.kind, self.parts, self.casts, self.fn = kind, parts, casts, fn
        self.size, self.stride, self.offset = tuple(t.size()), tuple(t.stride()), t.storage_offset()


class Region(ChainedHooks):
    """The saved-tensor hooks of one module call (see the module doc). ``enter(y)`` at the call's start (y: its
    input, or None), ``note_act(fn, g, a)`` for each activation call inside, ``exit()`` at its end (always)."""

    saved_by = "an MoE layer's recompute region (gated_mlp=False saves as plain autograd)"

    def __init__(self) -> None:
        self.acts: dict[Any, tuple[Callable, torch.Tensor]] = {}  # act output's node → (forward, its input g)
        self.input: Optional[torch.Tensor] = None
        self.outer = None
        self._ctx = None
        self.recomputed = 0  # recipes made (for tests and benchmarks)

    # -- lifetime ------------------------------------------------------------------------------------------
    def enter(self, y: Optional[torch.Tensor]) -> bool:
        if torch.compiler.is_compiling() or top_hooks is None or not torch.is_grad_enabled():
            return False
        self.outer = top_hooks(False)
        self.input = y if isinstance(y, torch.Tensor) and y.grad_fn is not None else None
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        try:
            ctx.__enter__()
        except RuntimeError:  # saved-tensor hooks disabled by the caller: nothing is recomputed
            self.input = self.outer = None
            return False
        self._ctx = ctx
        return True

    @property
    def active(self) -> bool:
        return self._ctx is not None

    def exit(self) -> None:
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)
        self.acts.clear()
        self.input = None

    def note_act(self, fn: Callable[[torch.Tensor], torch.Tensor], g: torch.Tensor, a: torch.Tensor) -> None:
        """``a = fn(g)`` was just computed inside the region (``fn``: the activation's forward, no hooks)."""
        if self.active and isinstance(a, torch.Tensor) and a.grad_fn is not None and isinstance(g, torch.Tensor):
            self.acts[a.grad_fn] = (fn, g)

    # -- hooks -----------------------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        recipe = self._recipe(t)
        return recipe if recipe is not None else (self._opack(t),)

    def _recipe(self, t: torch.Tensor) -> Optional[_Recipe]:
        src = t if t._base is None else t._base
        if not src.is_contiguous() or src.grad_fn is None:
            return None
        walked = cast_chain(src.grad_fn, src.device)
        if walked is None:
            return None
        fn, casts = walked
        made = self._act(fn) or self._product(fn) or self._gather(fn) or (self._select(fn) if casts else None)
        if made is None:
            return None
        kind, parts, forward = made
        self.recomputed += 1
        return _Recipe(kind, parts, tuple(casts), t, forward)

    def _act(self, fn):
        found = self.acts.get(fn)
        if found is None:
            return None
        forward, g = found
        return "act", (self._opack(g),), forward

    def _product(self, fn):
        if type(fn).__name__ != "MulBackward0":
            return None
        ops = [f for f, _ in fn.next_functions]
        if len(ops) != 2:
            return None
        first = ops[0] in self.acts
        if not first and ops[1] not in self.acts:
            return None
        forward, g = self.acts[ops[0] if first else ops[1]]
        try:
            u = fn._saved_other if first else fn._saved_self
        except (AttributeError, RuntimeError):
            return None
        if not isinstance(u, torch.Tensor):
            return None
        return ("mul_first" if first else "mul_second"), (self._opack(g), self._opack(u)), forward

    def _gather(self, fn):
        if type(fn).__name__ != "IndexBackward0":
            return None
        src, y = fn.next_functions[0][0], self.input
        if y is not None and src is y.grad_fn:
            base = y
        elif type(src).__name__ == "AccumulateGrad" and isinstance(getattr(src, "variable", None), nn.Parameter):
            base = src.variable  # the experts' weights gathered per routed row (a batched matmul over P[ids])
        else:
            return None
        try:
            idx = fn._saved_indices
        except (AttributeError, RuntimeError):
            return None
        if not idx or idx[0] is None or any(i is not None for i in idx[1:]):
            return None
        return "gather", (self._opack(base), self._opack(idx[0])), None

    def _select(self, fn):
        """``P[e].to(dtype)``: an expert's weight cast by autocast inside a per-expert loop (autocast caches casts
        of whole parameters only, so every expert's cast slice would be kept)."""
        if type(fn).__name__ != "SelectBackward0":
            return None
        src = fn.next_functions[0][0]
        p = getattr(src, "variable", None) if type(src).__name__ == "AccumulateGrad" else None
        if not isinstance(p, nn.Parameter):
            return None
        try:
            dim, index = int(fn._saved_dim), int(fn._saved_index)
        except (AttributeError, RuntimeError, TypeError):
            return None
        return "select", (self._opack(p), dim, index), None

    def _unpack(self, packed) -> torch.Tensor:
        if not isinstance(packed, _Recipe):
            return self._ounpack(packed[0])
        parts = [self._ounpack(p) for p in packed.parts] if packed.kind != "select" else \
            [self._ounpack(packed.parts[0]), *packed.parts[1:]]
        with torch.no_grad():
            if packed.kind == "act":
                out = packed.fn(parts[0])
            elif packed.kind == "gather":
                out = parts[0][parts[1]]
            elif packed.kind == "select":
                out = parts[0].select(parts[1], parts[2])
            else:
                a = packed.fn(parts[0])
                out = a * parts[1] if packed.kind == "mul_first" else parts[1] * a
            for dtype in packed.casts:
                out = out.to(dtype)
        return out.as_strided(packed.size, packed.stride, packed.offset)
