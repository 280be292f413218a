"""Exact norm rewrites: the norms a fold (`NormFold`) or a kept-affine swap (`NormKeep`) would rewrite become
`NormExact` items when ``fold_norms`` is off: the memory-sharing norm keeps γ, β and computes the original output,
and its consumers' saved copies of that output are rebuilt from x̂ (`lmbp_convert.nn.exact_norms`). No weight is
rewritten, so training, the optimiser's parameters and the state dict are the original's.

The planner's analysis still decides *which* norms are worth it (a consumer keeps the output); the exact form is
then a drop-in for that norm whatever its consumers are, so nothing of the fold's conditions (commuting ops,
re-apply sites, β placement) is needed. That includes norms read by functional consumers (`ConsumerFold`: F.linear
on a parameter, nn.MultiheadAttention's in_proj, convolutions) and channel-first norms (``channel_dim``): their
consumers save permuted, cast or copied views of y, which the shared-saves recipes rebuild from x̂ as well
(`lmbp_convert.ops.shared_saves`). Nothing is folded under the default: a fold item with no exact form (none
today; the protocol allows one) is not applied, the norm stays as it is, and the skip says ``fold_norms=True``
would fold it. Norms already folded on disk (the checkpoint CLI) keep their fold: their weights are folded.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..reasons import Reason, ReasonCode
from .consumers import ConsumerFold
from .norm_kept import NormKeep
from .plan import AffineNormItem, NormFold, PlanItem, Skip, renamed

__all__ = ["NormExact", "exact_for_door", "exact_items", "exact_plan"]


@dataclass
class NormExact(AffineNormItem):
    """A norm swapped for `MSExactNorm`: γ, β kept, the output rebuilt from x̂ for the consumers that save it."""

    tag = "norm_exact"
    noun = "norms (exact)"
    noun_one = "norm (exact)"
    heading = "norms → memory-sharing, exact (γ, β kept; consumers' copies of the output rebuilt from x̂)"

    readers: list[str] = field(default_factory=list)  # consumers that keep the output (from the fold's analysis)
    predicted_saved_bytes: int = 0
    out_dtype: str | None = None
    channel_dim: int = -1  # 1: a channel-first norm (NCHW)
    #: with ``fold_norms=True``: why this norm is exact instead of folded (a door could see its output without the
    #: affine, `match.doors`); None: the exact default
    door: Reason | None = None
    #: every reader of y is a Linear that reads it as it is (no op between, no LoRA adapter, no other reader): under
    #: autocast each casts y to the autocast dtype before anything else, so emitting y in that dtype changes no value
    #: they see, and under torch.compile it lets inductor rebuild their copy from x̂ (`MSExactNorm.autocast_readers`)
    linear_readers_only: bool = False

    def describe(self) -> list[str]:
        where = f", channels at dim {self.channel_dim}" if self.channel_dim != -1 else ""
        lines = [f"  {self.name} [{self.norm_type}, {self.param}{where}] → output shared with "
                 f"{', '.join(self.readers) or '-'}"]
        return lines + ([f"      not folded: {self.door}"] if self.door is not None else [])

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["door"] = None if self.door is None else {"reason": self.door.text, **self.door.to_dict()}
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "NormExact":
        d = renamed(cls, data)
        door = d.pop("door", None)
        item = cls(**d)
        item.door = None if door is None else Reason.from_dict(door["reason"], door)
        return item


def _exact(item: PlanItem) -> PlanItem:
    if type(item) in (NormFold, ConsumerFold) and not item.prefolded:
        readers = [t.label for t in item.targets] + [f"{p.op} in {p.scope}" for p in item.param_targets()]
        return NormExact(item.name, item.cls, item.norm_type, item.param, item.eps, list(item.shape), item.has_bias,
                         readers, item.predicted_saved_bytes, item.out_dtype, item.channel_axis(),
                         linear_readers_only=_linear_readers_only(item))
    if type(item) is NormKeep:
        return NormExact(item.name, item.cls, item.norm_type, item.param, item.eps, list(item.shape), item.has_bias,
                         list(item.keepers), item.predicted_saved_bytes, item.out_dtype)
    return item


def _linear_readers_only(item: NormFold) -> bool:
    """The fold's analysis saw every reader of the norm's output: its Linear targets and its re-apply sites."""
    return (type(item) is NormFold and item.out_dtype is None and not item.reapply
            and bool(item.targets) and not item.param_targets()
            and all(not t.via and not t.lora_adapters and not t.through_op for t in item.targets))


def exact_for_door(item: PlanItem, why: Reason) -> PlanItem:
    """``item``'s exact form, carrying ``why`` (fold mode: a door could see the fold's output); an item without an
    exact form stays as it is."""
    exact = _exact(item)
    if isinstance(exact, NormExact):
        exact.door = why
    return exact


def exact_items(items: list[PlanItem]) -> list[PlanItem]:
    """``items`` with every norm fold / kept-affine swap that has an exact form replaced by it (same order)."""
    return [_exact(it) for it in items]


def _fold_into(item: NormFold) -> str:
    return ", ".join([t.label for t in item.targets] + [p.describe() for p in item.param_targets()])


def exact_plan(items: list[PlanItem]) -> tuple[list[PlanItem], list[Skip]]:
    """The exact default's items (`exact_items`) and skips: a norm fold with no exact form is not applied (no
    parameter a user or optimiser sees may change), the norm is left as it is, with the reason."""
    kept, skips = [], []
    for it in exact_items(items):
        if isinstance(it, NormFold) and not it.prefolded:
            why = (f"no exact memory-sharing form for {type(it).__name__} yet: left as it is (fold_norms=True would "
                   f"fold it into {_fold_into(it)})")
            skips.append(Skip(it.name, it.cls, Reason(ReasonCode.NO_EXACT_FORM, why)))
        else:
            kept.append(it)
    return kept, skips
