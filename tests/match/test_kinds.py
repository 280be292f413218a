"""The rewrite-kind registry: one symmetric declaration, matcher order by rank, and what the order decides."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from lmbp_convert import plan_conversion
from lmbp_convert.apply.rewrite import Unit
from lmbp_convert.catalogue import class_key
from lmbp_convert.match.kinds import (LAST, RewriteKind, matchers, register_kind, rewrite_kinds, suspended,
                                      unregister_kind)
from lmbp_convert.match.plan import ActSwap, NormSwap, PlanItem, Skip
from lmbp_convert.reasons import Reason, ReasonCode


@dataclass
class FirstLook(PlanItem):
    tag = "first_looks"
    predicted_saved_bytes: int = 0


@dataclass
class SecondLook(PlanItem):
    tag = "second_looks"
    predicted_saved_bytes: int = 0


def _never(builder, item) -> Unit:
    return Unit(item.name)


def _tanhs(ctx):
    return [(n, m) for n, m in ctx.modules.items() if isinstance(m, nn.Tanh) and n not in ctx.claimed]


def skip_tanh(ctx):
    for n, m in _tanhs(ctx):
        yield Skip(n, class_key(m), Reason(ReasonCode.ACTIVATION, "first matcher says no", n))


def take_tanh(ctx):
    for n, m in _tanhs(ctx):
        yield SecondLook(n, class_key(m))


def take_tanh_first(ctx):
    for n, m in _tanhs(ctx):
        yield FirstLook(n, class_key(m))


def skip_tanh_late(ctx):
    for n, m in ctx.modules.items():
        if isinstance(m, nn.Tanh):
            yield Skip(n, class_key(m), Reason(ReasonCode.ACTIVATION, "late matcher says no", n))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.tanh = nn.Linear(4, 4), nn.Tanh()

    def forward(self, x):
        return self.tanh(self.fc(x))


def _plan():
    return plan_conversion(Net(), probe=torch.randn(2, 4), norms=False, activations=False, gated_mlp=False)


@pytest.fixture
def two_kinds(request):
    first, second = request.param
    register_kind(RewriteKind(FirstLook, _never, first, rank=5))
    register_kind(RewriteKind(SecondLook, _never, second, rank=LAST))
    yield
    unregister_kind(FirstLook)
    unregister_kind(SecondLook)


@pytest.mark.parametrize("two_kinds", [(skip_tanh, take_tanh)], indirect=True)
def test_a_later_matchers_item_supersedes_an_earlier_skip(two_kinds):
    plan = _plan()
    assert [type(it) for it in plan.items] == [SecondLook] and not [s for s in plan.skips if s.name == "tanh"]


@pytest.mark.parametrize("two_kinds", [(take_tanh_first, skip_tanh_late)], indirect=True)
def test_a_later_matchers_skip_never_replaces_an_earlier_item(two_kinds):
    plan = _plan()
    assert [type(it) for it in plan.items] == [FirstLook]
    assert [s.why.text for s in plan.skips if s.name == "tanh"] == ["late matcher says no"]


def test_rank_orders_matchers_and_registration_orders_the_report():
    register_kind(RewriteKind(SecondLook, _never, take_tanh, rank=LAST))
    register_kind(RewriteKind(FirstLook, _never, take_tanh_first, rank=0))
    try:
        assert matchers()[0] is take_tanh_first and matchers()[-1] is take_tanh
        assert [k.item for k in rewrite_kinds()][-2:] == [SecondLook, FirstLook]
        assert [type(it) for it in _plan().items] == [FirstLook]  # rank 0 claims the module first
    finally:
        unregister_kind(FirstLook)
        unregister_kind(SecondLook)


def test_declarations_are_checked_and_undone_symmetrically():
    before = rewrite_kinds()
    kind = register_kind(RewriteKind(FirstLook, _never, take_tanh_first))
    with pytest.raises(ValueError, match="tag 'first_looks' is already used"):
        register_kind(RewriteKind(type("Again", (FirstLook,), {}), _never))
    with pytest.raises(ValueError, match="already registered for another kind"):
        register_kind(RewriteKind(SecondLook, _never, take_tanh_first))
    assert unregister_kind(FirstLook) is kind and rewrite_kinds() == before
    with pytest.raises(KeyError, match="not a registered rewrite kind"):
        unregister_kind(FirstLook)


def test_suspended_kinds_come_back_in_their_places():
    before = rewrite_kinds()
    with suspended(NormSwap, ActSwap):
        assert not {NormSwap, ActSwap} & {k.item for k in rewrite_kinds()}
    assert rewrite_kinds() == before
