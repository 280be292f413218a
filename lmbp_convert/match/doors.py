"""Folds a door could see (``fold_norms=True``): a fold leaves the norm's output without its affine (x̂) on its
way to the folded consumers, which is right only while the whole model's forward runs. A user also calls modules
on their own — the backbone under a head, an encoder, timm's ``forward_features`` / ``forward_head`` and a head
reset after convert — and those would return x̂, or feed the original values to folded weights. A fold whose x̂
(the tensors of its `Walk`, ``Walk.seen``) could be seen from such a door becomes the exact rewrite (`NormExact`:
same bytes, original values everywhere), and the item says why (`door_reason`). Decided on the traced graph, by
data flow alone:

- **leaves a module**: a tensor of the walk is among the outputs of a module call other than the root's (a
  backbone's ``last_hidden_state``, an encoder's output read by every cross-attention, a post-LN block's output);
- **the root's own frame**: S, the innermost module call holding the norm's call and every reader of the walk, is
  the root's call or one the root makes itself. The root's methods (``forward_features``, ``forward_head``) and the
  modules it calls (a head holding its own norm, which ``forward_head(pre_logits=True)`` runs in a branch the
  trace never took) are doors no trace sees; a fold inside a block one level deeper (a layer's norm into its own
  projections) is not.

The checkpoint CLI folds on disk for 4-bit loading and plans without this check (`fold_past_doors`).
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator

from ..reasons import Reason, ReasonCode
from ..trace.graph import Graph
from .commute import is_metadata
from .context import MatchContext
from .norm_exact import exact_for_door
from .plan import NormFold, PlanItem

__all__ = ["door_reason", "fold_past_doors", "keep_doors_exact"]

_PAST_DOORS: ContextVar[bool] = ContextVar("lmbp_fold_past_doors", default=False)


@contextlib.contextmanager
def fold_past_doors() -> Iterator[None]:
    """Plans made inside fold whatever a door could see (the checkpoint CLI: its folds exist for 4-bit loading,
    and a model loaded from them is folded whatever convert() decides)."""
    token = _PAST_DOORS.set(True)
    try:
        yield
    finally:
        _PAST_DOORS.reset(token)


def _model_frames(g: Graph) -> list[int]:
    """The root's call, then each call that returns everything the one above it returns (a wrapper's forward
    handing on to the model it wraps: PEFT's ``PeftModel`` → ``LoraModel`` → the model): the model's own frames."""
    frames = [s.idx for s in g.scopes if s.parent is None and s.module == ""][:1]
    while frames:
        above = g.scopes[frames[-1]]
        wanted = set(above.outputs)
        inner = [s for s in g.scopes if s.parent == above.idx and wanted and wanted <= set(s.outputs)]
        if len(inner) != 1:
            break
        frames.append(inner[0].idx)
    return frames


def _scope_of_outputs(g: Graph) -> dict[int, list[int]]:
    """Tensor id → the module calls (not the root's) that return it."""
    out: dict[int, list[int]] = {}
    for sc in g.scopes:
        if sc.module:
            for t in sc.outputs:
                out.setdefault(t, []).append(sc.idx)
    return out


def _common(prefix: tuple[int, ...], scopes: tuple[int, ...]) -> tuple[int, ...]:
    n = 0
    while n < min(len(prefix), len(scopes)) and prefix[n] == scopes[n]:
        n += 1
    return prefix[:n]


def door_reason(ctx: MatchContext, item: NormFold, returned: dict[int, list[int]] | None = None,
                frames: list[int] | None = None) -> Reason | None:
    """Why a door could see the fold ``item``'s x̂ (None: none can, it stays a fold). ``returned``, ``frames``: the
    graph's `_scope_of_outputs` and `_model_frames`, found once per plan."""
    walk = ctx.walks.get(item.name)
    g = ctx.g
    frames = _model_frames(g) if frames is None else frames
    if walk is None or not frames:
        return None
    returned = _scope_of_outputs(g) if returned is None else returned
    for tid in sorted(walk.seen):
        leaving = [g.scopes[s].module for s in returned.get(tid, []) if s not in frames]
        if leaving:
            return Reason(ReasonCode.DOOR, f"its output leaves {leaving[-1]} without the affine (a module a user may "
                          "call on its own), so it stays exact: γ, β kept, the output rebuilt from x̂", leaving[-1])
    (node,) = ctx.g.module_nodes(item.name)
    inner = node.scopes
    for tid in walk.seen:
        if tid in g.root_outputs:
            inner = ()
        for c in g.consumers(tid):
            if not is_metadata(c):
                inner = _common(inner, c.scopes)
    s = inner[-1] if inner else frames[0]
    if s in frames or (g.scopes[s].parent in frames and set(g.scopes[s].outputs) & set(g.root_outputs)):
        module = "" if s == frames[0] else g.scopes[s].module
        where = f"{module}, whose output the model returns" if module else "the model's own forward"
        return Reason(ReasonCode.DOOR, f"the fold would run inside {where}: a door (the model's methods, such as "
                      "timm's forward_features / forward_head, or that module called on its own) would see its "
                      "output without the affine, so it stays exact: γ, β kept, the output rebuilt from x̂", module)
    return None


def keep_doors_exact(ctx: MatchContext, items: list[PlanItem]) -> list[PlanItem]:
    """``items`` with every fold a door could see (`door_reason`) replaced by its exact form, which says why."""
    if _PAST_DOORS.get():
        return items
    returned, frames = _scope_of_outputs(ctx.g), _model_frames(ctx.g)
    out = []
    for it in items:
        why = door_reason(ctx, it, returned, frames) if isinstance(it, NormFold) and not it.prefolded else None
        out.append(exact_for_door(it, why) if why is not None else it)
    return out
