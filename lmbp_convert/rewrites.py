"""The built-in rewrite kinds, declared once each (`match.kinds.RewriteKind`): plan item, matcher and its rank, unit
builder, disk rule. Declaration order is the report's and the plan file's section order; ``rank`` is the order the
planner runs the matchers in (what that decides: `lmbp_convert.match.kinds`). A plug-in kind is one more
``register_kind(RewriteKind(...))`` anywhere (``unregister_kind`` takes it back).

This module imports every layer (builders live in ``apply``, disk rules in ``checkpoint``); the registry imports it
on first use.
"""
from __future__ import annotations

from .apply.rewrite import (UnitBuilder, affine_free_norm, consumer_fold, kept_affine_norm, loss_swap,
                            recompute_region)
from .apply.shared_hooks import exact_norm, lora_inputs
from .checkpoint.diskplan import ConsumerFoldOnDisk, FoldOnDisk
from .match.activation import match_activations
from .match.consumers import ConsumerFold, match_consumer_folds
from .match.gated import match_gated_mlps
from .match.kinds import RewriteKind, register_kind
from .match.lora_inputs import LoraInputShare, match_lora_inputs
from .match.loss import LossSwap, match_losses
from .match.moe import RecomputeRegion, match_recompute_regions
from .match.norm import match_norms
from .match.norm_exact import NormExact
from .match.norm_free import match_affine_free_norms
from .match.norm_kept import NormKeep, match_kept_affine_norms
from .match.plan import ActSwap, GatedMLPSwap, NormFold, NormSwap, OutputActSwap

BUILTIN_KINDS = (
    # approx-BP activations; the same matcher yields OutputActSwap for activations found by their output behaviour
    RewriteKind(ActSwap, UnitBuilder.activation, match_activations, rank=70),
    RewriteKind(OutputActSwap, UnitBuilder.output_activation),
    RewriteKind(NormFold, UnitBuilder.norm, match_norms, rank=40, disk=FoldOnDisk()),
    RewriteKind(NormSwap, affine_free_norm, match_affine_free_norms, rank=50),
    # first: a fused MLP claims its activation (and an inner norm's place), which later matchers then leave alone
    RewriteKind(GatedMLPSwap, UnitBuilder.gated_mlp, match_gated_mlps, rank=10),
    # before the plain norm matcher: it claims every norm with a functional consumer, folded or skipped
    RewriteKind(ConsumerFold, consumer_fold, match_consumer_folds, rank=30, disk=ConsumerFoldOnDisk()),
    RewriteKind(LoraInputShare, lora_inputs, match_lora_inputs, rank=80),
    RewriteKind(LossSwap, loss_swap, match_losses, rank=90),
    RewriteKind(RecomputeRegion, recompute_region, match_recompute_regions, rank=20),
    # after the fold matchers: its item supersedes their refusal of the same norm (a fallback)
    RewriteKind(NormKeep, kept_affine_norm, match_kept_affine_norms, rank=60),
    # no matcher: with fold_norms=False the planner turns norm folds into these (match.norm_exact.exact_items)
    RewriteKind(NormExact, exact_norm),
)

for _kind in BUILTIN_KINDS:
    register_kind(_kind)
