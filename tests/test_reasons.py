"""Reasons as data: codes decide, sentences are only read by people; they round-trip through the JSON plan."""
from __future__ import annotations

import json

import torch
from torch import nn

from lmbp_convert import plan_conversion
from lmbp_convert.match.plan import Plan, Skip
from lmbp_convert.reasons import Reason, ReasonCode, cli_spelling, joined, option, then


def test_joined_keeps_distinct_reasons_in_order_under_the_first_code():
    a = Reason(ReasonCode.QUANTIZED_LINEAR, "a", "x")
    b = Reason(ReasonCode.TIED_WEIGHT, "b", "y")
    got = joined([a, b, a])
    assert (got.code, got.subject, got.text, got.parts) == (ReasonCode.QUANTIZED_LINEAR, "x", "a; b", (a, b))
    assert joined([b]) is b
    assert list(then(b, "b, then a", a).codes()) == [ReasonCode.TIED_WEIGHT, ReasonCode.TIED_WEIGHT,
                                                     ReasonCode.QUANTIZED_LINEAR]


def test_skip_round_trips_with_code_subject_and_parts():
    part = Reason(ReasonCode.BLOCKING_OP, "dropout at d", "d")
    skip = Skip("n", "torch.nn:LayerNorm", then(part, "no Linear (blocked: dropout at d)"))
    data = json.loads(json.dumps(skip.to_dict()))
    assert data["reason"] == skip.reason and data["code"] == "blocking_op" and data["parts"][0]["subject"] == "d"
    assert Skip.from_dict(data) == skip


def test_a_skip_written_without_a_code_reads_back_as_recorded():
    skip = Skip.from_dict({"name": "n", "cls": "c", "reason": "why"})
    assert skip.why == Reason(ReasonCode.RECORDED, "why")


def test_options_are_spelled_as_the_caller_spells_them():
    assert option("untie") == "untie=True"
    with cli_spelling():
        assert option("untie") == "--untie" and option("fold_norms") == "--fold-norms"
    assert option("untie") == "untie=True"


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.drop, self.fc = nn.LayerNorm(8), nn.Dropout(0.1), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(self.drop(self.norm(x)))


def test_a_blocked_norm_names_the_blocking_op_by_code_and_subject():
    plan = plan_conversion(_Net(), probe=torch.randn(2, 3, 8), activations=False, fold_norms=True)
    (skip,) = [s for s in plan.skips if s.name == "norm"]
    assert skip.why.code is ReasonCode.BLOCKING_OP and skip.why.subject == "drop", skip
    assert [p.subject for p in skip.why.parts] == ["drop"]
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).skips == plan.skips
