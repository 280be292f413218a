"""Catalogue roles + traced graph → a Plan. No mutation, no kernels: pure decisions with reasons.

The planner runs the registered kinds' matchers (`match.kinds.matchers`, by rank), each a function of the
`MatchContext` that yields plan items and skips. Order matters three times: a later matcher may take a module an
earlier one skipped (its item then replaces the skip: the affine-keeping norm after a refused fold); an item's
``claims()`` hide those modules from the matchers after it (a gated MLP's activation is not swapped on its own),
and items are applied in plan order.
"""
from __future__ import annotations

from typing import Any, Iterable

from torch import nn

from ..enums import ConvertedModule
from ..options import ConvertOptions
from ..trace.graph import Graph
from .context import MatchContext, code_bytes, tensor_bytes
from .doors import keep_doors_exact
from .kinds import Matcher, matchers
from .norm_exact import exact_plan
from .plan import NormFold, Plan, Skip
from .roles import Role

__all__ = ["MatchContext", "Matcher", "code_bytes", "make_plan", "tensor_bytes"]


def make_plan(model: nn.Module, graph: Graph, roles: dict[str, Role], options: ConvertOptions,
              prefolded: Iterable[str] = (), probe: Any = None) -> Plan:
    """Run every matcher over the model; ``prefolded``: norms already folded on disk (swapped only); ``probe``: the
    traced input (for matchers that check behaviour by running the model again)."""
    ctx = MatchContext(model, graph, roles, options, frozenset(prefolded), probe)
    plan = Plan(options=options.summary())
    plan.already_converted = [n for n, m in ctx.modules.items() if isinstance(m, ConvertedModule)]
    for matcher in matchers():  # by rank: see match/kinds.py for what the order decides
        for found in matcher(ctx):
            if isinstance(found, Skip):
                plan.skips.append(found)
            else:  # a later matcher that takes a module supersedes an earlier one's skip of it (a fallback)
                plan.skips = [s for s in plan.skips if s.name != found.name]
                plan.items.append(found)
                ctx.claimed |= found.claims()
    if not options.fold_norms:
        plan.items, skips = exact_plan(plan.items)
        plan.skips += skips
    else:  # a fold whose affine-less output a door could see stays exact (match/doors.py)
        plan.items = keep_doors_exact(ctx, plan.items)
    for it in plan.items:
        if isinstance(it, NormFold):
            it.trainable = _trainable_touched(ctx, it)
    plan.notes += ctx.notes
    return plan


def _trainable_touched(ctx: MatchContext, fold: NormFold) -> list[str]:
    """The parameters requiring grad that the fold changes: the norm's γ, β (they become buffers, or the shift),
    and unless the checkpoint was folded on disk the targets' W, b, their LoRA adapters' A and the parameter rows
    of functional consumers. None of them trains: the fold changes nothing an optimiser sees."""
    def named(owner: str, mod: nn.Module | None, attrs: tuple[str, ...]) -> list[tuple[str, object]]:
        return [(f"{owner}.{a}" if owner else a, getattr(mod, a, None)) for a in attrs] if mod is not None else []

    found = named(fold.name, ctx.modules.get(fold.name), ("weight", "bias"))
    if not fold.prefolded:
        for t in fold.targets:
            lin = ctx.modules.get(t.name)
            if t.base and lin is not None:
                adapters = getattr(lin, t.lora_a_attr, None) if t.lora_a_attr else None
                for adapter in t.lora_adapters:
                    a = adapters[adapter] if adapters is not None and adapter in adapters else None
                    found += named(f"{t.name}.{t.lora_a_attr}.{adapter}", a, ("weight",))
                lin = getattr(lin, t.base, None)
                owner = f"{t.name}.{t.base}"
            else:
                owner = t.name
            found += named(owner, lin, (t.weight,) + (("bias",) if t.weight == "weight" else ()))
        params = dict(ctx.model.named_parameters(remove_duplicate=False))
        for pt in fold.param_targets():
            found += [(pt.weight, params.get(pt.weight))] + [(b.tensor, params.get(b.tensor)) for b in pt.bias]
    return sorted({n for n, p in found if isinstance(p, nn.Parameter) and p.requires_grad})
