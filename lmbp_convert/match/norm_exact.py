"""Exact norm rewrites: the norms a fold (`NormFold`) or a kept-affine swap (`NormKeep`) would rewrite become
`NormExact` items when ``fold_norms`` is off: the memory-sharing norm keeps γ, β and computes the original output,
and its consumers' saved copies of that output are rebuilt from x̂ (`lmbp_convert.nn.exact_norms`). No weight is
rewritten, so training, the optimiser's parameters and the state dict are the original's.

The planner's analysis still decides *which* norms are worth it (a consumer keeps the output); the exact form is
then a drop-in for that norm whatever its consumers are, so nothing of the fold's conditions (commuting ops,
re-apply sites, β placement) is needed. Left as planned, with the reason in the report: channel-first norms and
norms with functional consumers (`ConsumerFold`: their consumers save permuted or copied views that no recipe
rebuilds yet), and norms already folded on disk (the checkpoint CLI).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..enums import NormType, WeightParam
from .norm_kept import NormKeep
from .plan import NormFold, PlanItem

__all__ = ["NormExact", "exact_items"]


@dataclass
class NormExact(PlanItem):
    """A norm swapped for `MSExactNorm`: γ, β kept, the output rebuilt from x̂ for the consumers that save it."""

    tag = "norm_exact"
    noun = "norms (exact: affine kept, output rebuilt)"
    heading = "norms → memory-sharing, exact (γ, β kept; consumers' copies of the output rebuilt from x̂)"
    counted_when_none = False

    former_fields = {"kind": "norm_type"}

    norm_type: NormType
    param: WeightParam
    eps: float
    shape: list[int]
    has_bias: bool
    readers: list[str] = field(default_factory=list)  # consumers that keep the output (from the fold's analysis)
    predicted_saved_bytes: int = 0
    out_dtype: str | None = None

    def __post_init__(self) -> None:
        self.norm_type, self.param = NormType(self.norm_type), WeightParam(self.param)

    def describe(self) -> list[str]:
        return [f"  {self.name} [{self.norm_type}, {self.param}] → output shared with {', '.join(self.readers) or '-'}"]


def _exact(item: PlanItem) -> PlanItem:
    if type(item) is NormFold and not item.prefolded:
        readers = [t.label for t in item.targets]
        return NormExact(item.name, item.cls, item.norm_type, item.param, item.eps, list(item.shape), item.has_bias,
                         readers, item.predicted_saved_bytes, item.out_dtype)
    if type(item) is NormKeep:
        return NormExact(item.name, item.cls, item.norm_type, item.param, item.eps, list(item.shape), item.has_bias,
                         list(item.keepers), item.predicted_saved_bytes, item.out_dtype)
    return item


def exact_items(items: list[PlanItem]) -> list[PlanItem]:
    """``items`` with every norm fold / kept-affine swap that has an exact form replaced by it (same order)."""
    return [_exact(it) for it in items]
