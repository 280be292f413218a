"""A norm the checkpoint CLI already folded on disk, read by projections whose weights cannot take a fold.

After ``lmbp-convert`` the norm holds the identity affine, so nothing is folded and nothing re-applied: the
memory-sharing norm gives the same output to every reader. Loaded in 4 bits (QLoRA), its q/k/v or gate/up
consumers are quantized and the regular norm plan refuses them ("its weight cannot be folded"); this plan swaps
the norm anyway wherever projection-like modules (`lmbp_convert.match.projection`) read its output: they, or
the LoRA adapters added over them, keep that output for backward, which the memory-sharing norm then shares
instead of keeping its own input.
"""
from __future__ import annotations

import torch
from torch import nn

from ..catalogue import class_key
from ..enums import BetaMode
from ..reasons import Reason, ReasonCode
from .context import MatchContext
from .norm import _single_call, emitted_dtype, inplace_reason, predicted_norm_bytes
from .norm_walk import Refused, walk_readers
from .plan import NormFold
from .projection import is_projection_node
from .roles import NormRole


def _identity_affine(mod: nn.Module, nr: NormRole, fold_param) -> str | None:
    """Why the norm's affine is not the identity (None: it is); tensors on meta cannot be checked."""
    w, b = getattr(mod, "weight", None), getattr(mod, "bias", None) if nr.has_bias else None
    for name, t, want in (("weight", w, fold_param.identity), ("bias", b, 0.0)):
        if t is None:
            continue
        if t.device.type == "meta":
            return f"its {name} is on the meta device (cannot check that it is the identity)"
        if not torch.all(t.detach() == want):
            return "config says its affine is folded on disk, but its weight is not the identity"
    return None


def plan_prefolded_swap(ctx: MatchContext, name: str, mod: nn.Module, nr: NormRole) -> NormFold:
    """Swap-only plan for a norm folded on disk whose readers are projections, or a refusal."""
    node = _single_call(ctx, name, mod)
    walk = walk_readers(ctx, node.outputs[0], nr)
    if walk.inplace:
        raise Refused(inplace_reason(walk))
    readers = sorted({*walk.targets, *(r.node.target for r in walk.others
                                       if r.node is not None and is_projection_node(ctx, r.node))})
    if not readers:
        raise Refused(Reason(ReasonCode.NO_CONSUMER, "no Linear or projection-like module reads its output"))
    fold = NormFold(name, class_key(mod), nr.norm_type, nr.param, nr.eps, list(nr.shape), nr.has_bias, [], [],
                    [f"output read by {', '.join(readers)} (weights not rewritten: the affine is the identity)"],
                    predicted_norm_bytes(ctx, node, nr), prefolded=True,
                    beta=BetaMode.FOLD if nr.has_bias else BetaMode.NONE, out_dtype=emitted_dtype(ctx, node))
    why = _identity_affine(mod, nr, fold.param)
    if why:
        raise Refused(Reason(ReasonCode.PREFOLDED, why))
    return fold
