"""Norms folded into functional consumers: a norm's output read by an op that applies a model *parameter* as its
weight, not by an nn.Linear module, where the fold goes into rows of that parameter and pieces of its bias —
``F.linear(x, self.qkv.weight, cat(q_bias, k_bias, v_bias))`` (timm EVA / BEiT attention),
``F.multi_head_attention_forward`` with ``in_proj_weight`` (nn.MultiheadAttention, nn.Transformer*),
``F.conv1d/2d/3d`` on channel-first views of the norm's output (PVT-v2's spatial reduction). Which ops those are
and what each takes is the consumer table's business (`match.functional`); this module is the plan item and its
matcher.

The norm becomes a `ConsumerFold`: a `NormFold` (its Linear targets and re-apply sites as usual) plus
`ParamTarget`s, the rows of a parameter the affine folds into (fold maths: ``fold.fold_weight_rows``,
``fold.rows_shift``, ``fold.add_shift``, ``fold.fold_conv_input``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from ..catalogue import class_key
from ..reasons import Reason, ReasonCode, joined
from .context import MatchContext
from .norm import _adopt_prefolded, plan_norm
from .norm_walk import Refused, Walk
from .plan import NormFold, ParamTarget, Skip
from .roles import ModuleRole

__all__ = ["ConsumerFold", "match_consumer_folds"]


@dataclass
class ConsumerFold(NormFold):
    """A norm fold some of whose consumers are functional ops on parameters (`ParamTarget`), besides any Linear
    targets and re-apply sites of an ordinary `NormFold`."""

    tag = "consumer_folds"
    noun = "norms (folded into functional consumers)"
    noun_one = "norm (folded into functional consumers)"
    heading = "norms → memory-sharing (affine folded into parameters used by functional ops)"

    params: list[ParamTarget] = field(default_factory=list)
    channel_dim: int = -1  # 1: a channel-first norm (NCHW), swapped for its channel-first memory-sharing form

    def param_targets(self) -> list[ParamTarget]:
        return self.params

    def channel_axis(self) -> int:
        return self.channel_dim

    def _bracket(self) -> str:
        return super()._bracket() + (f", channels at dim {self.channel_dim}" if self.channel_dim != -1 else "")

    def _head(self) -> str:
        return super()._head() + ((" and" if self.targets else " →") if self.params else "")

    def describe(self) -> list[str]:
        lines = super().describe()
        notes = [f"      note: part of β went into {b}, a buffer the state dict does not hold (kept by this model; a "
                 "plain export refuses it)" for b in self.buffer_notes()] if self.has_bias else []
        return lines[:1] + [f"      into {p.describe()}" for p in self.params] + lines[1:] + notes

    def buffer_notes(self) -> list[str]:
        return [b.tensor for p in self.params for b in p.bias if not b.parameter and not b.persistent]

    @classmethod
    def from_dict(cls, data: dict) -> "ConsumerFold":
        d = dict(data)
        params = [ParamTarget(**p) for p in d.pop("params", [])]
        item = NormFold.from_dict.__func__(cls, d)
        item.params = params
        return item


# -- matcher ---------------------------------------------------------------------------------------------------
def match_consumer_folds(ctx: MatchContext) -> Iterator[ConsumerFold | Skip]:
    """Norms with at least one functional consumer that takes parameter rows. A norm without any is left to
    `match.norm.match_norms`; one whose functional consumer cannot take the fold is skipped here with that reason
    (and claimed, so the norm matcher does not report it a second time)."""
    if not ctx.opt.norms:
        return
    for name, role in ctx.roles.items():
        mod = ctx.modules.get(name)
        if (mod is None or name in ctx.claimed or not ctx.opt.selected(name) or role.why
                or role.plays is not ModuleRole.NORM or not role.norm.affine):
            continue
        nr = role.norm
        walk = Walk()
        try:
            fold = plan_norm(ctx, name, mod, nr, walk)
        except Refused as why:
            if walk.params or walk.problems or nr.channel_dim != -1:
                ctx.claimed.add(name)
                could = [Reason(ReasonCode.FUNCTIONAL_CONSUMER, "the fold could go into "
                                f"{', '.join(t.describe() for t in walk.params)}, but not into every consumer")
                         ] if walk.params else []
                yield Skip(name, class_key(mod), joined(walk.problems + [why.reason] + could))
            continue
        if walk.problems:
            ctx.claimed.add(name)
            yield Skip(name, class_key(mod), joined(walk.problems))
            continue
        if not walk.params and nr.channel_dim == -1:
            continue  # an ordinary norm fold: match_norms plans it
        fold = _adopt_prefolded(ctx, fold)
        yield ConsumerFold(**dict(fold.__dict__), params=[] if fold.prefolded else walk.params,
                           channel_dim=nr.channel_dim)
