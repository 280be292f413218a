"""Catalogue roles + traced graph → a Plan. No mutation, no kernels: pure decisions with reasons.

The planner runs a list of matchers (`MATCHERS`), each a function of the `MatchContext` that yields plan items
and skips. Order matters three times: a later matcher may take a module an earlier one skipped (its item then
replaces the skip: the affine-keeping norm after a refused fold); an item's ``claims()`` hide those modules from the matchers after it (a gated
MLP's activation is not swapped on its own), and items are applied in plan order.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from torch import nn

from ..kinds import ConvertedModule
from ..options import ConvertOptions
from ..trace.graph import Graph
from .activation import match_activations
from .consumers import match_consumer_folds
from .context import MatchContext, code_bytes, tensor_bytes
from .gated import match_gated_mlps
from .lora_inputs import match_lora_inputs
from .loss import match_losses
from .moe import match_recompute_regions
from .norm import match_norms
from .norm_free import match_affine_free_norms
from .norm_exact import exact_plan
from .norm_kept import match_kept_affine_norms
from .plan import Plan, PlanItem, Skip
from .roles import Role

__all__ = ["MATCHERS", "MatchContext", "Matcher", "code_bytes", "make_plan", "register_matcher", "tensor_bytes"]

Matcher = Callable[[MatchContext], Iterable["PlanItem | Skip"]]

#: the matchers the planner runs, in order
MATCHERS: list[Matcher] = [match_gated_mlps, match_recompute_regions, match_consumer_folds, match_norms,
                           match_affine_free_norms, match_kept_affine_norms, match_activations, match_lora_inputs,
                           match_losses]


def register_matcher(matcher: Matcher) -> Matcher:
    """Decorator: run ``matcher`` after the built-in ones (remove it from `MATCHERS` to stop)."""
    if matcher not in MATCHERS:
        MATCHERS.append(matcher)
    return matcher


def make_plan(model: nn.Module, graph: Graph, roles: dict[str, Role], options: ConvertOptions,
              prefolded: Iterable[str] = (), probe: Any = None) -> Plan:
    """Run every matcher over the model; ``prefolded``: norms already folded on disk (swapped only); ``probe``: the
    traced input (for matchers that check behaviour by running the model again)."""
    ctx = MatchContext(model, graph, roles, options, frozenset(prefolded), probe)
    plan = Plan(options=options.summary())
    plan.already_converted = [n for n, m in ctx.modules.items() if isinstance(m, ConvertedModule)]
    for matcher in list(MATCHERS):
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
    return plan
