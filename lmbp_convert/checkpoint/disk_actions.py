"""What a disk plan writes, tensor by tensor: the output shards, their tensors and how each is made (`Action`).

Plain data shared by the planner (`diskplan`) and the kinds' disk rules (`disk_rules`), which fill it, and the
writer (`api`), which executes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..enums import Layout, StrChoice, WeightParam

__all__ = ["ActionKind", "Action", "OutTensor", "OutShard", "STORED"]

#: prefix of an action's name for a checkpoint tensor that a load-time converter turns into part of a model tensor
STORED = "<stored>:"


class ActionKind(StrChoice):
    IDENTITY = "identity"  # a folded norm's weight: the identity of its parameterisation
    ZERO = "zero"  # a folded norm's bias
    FOLD_W = "fold_w"  # a Linear's weight: W·diag(γ)
    FOLD_B = "fold_b"  # a Linear's bias: b + W·β


@dataclass
class Action:
    """How an output tensor is computed from the source (keys are source checkpoint keys)."""

    kind: ActionKind
    norm: str
    param: WeightParam = WeightParam.W  # the norm's parameterisation
    layout: Layout = Layout.OUT_IN
    gamma: str | None = None
    beta: str | None = None
    weight: str | None = None  # the Linear's original weight (fold_b needs it: b' = b + W·β)


@dataclass
class OutTensor:
    key: str  # name in DST
    source: str  # source key its data comes from
    action: Action | None = None


@dataclass
class OutShard:
    name: str
    source: str
    tensors: list[OutTensor] = field(default_factory=list)
