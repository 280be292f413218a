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
from .plan import Plan, Skip
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
    return plan
