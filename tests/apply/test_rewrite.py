"""Unit mechanics of `lmbp_convert.apply.rewrite`: undo runs newest step first (steps that change the same
attribute twice only come back in that order), and a fold into a Linear with a ``bias=None`` slot gives it a
bias that undo takes away again, slot and all."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lmbp_convert.apply.convert import Check, _isolate_failures, _restore
from lmbp_convert.apply.rewrite import Unit, UnitBuilder
from lmbp_convert.enums import BetaMode, Layout, NormType, WeightParam
from lmbp_convert.match.plan import LinearTarget, NormFold


def _twice(unit: Unit, lin: nn.Linear) -> tuple[nn.Parameter, nn.Parameter]:
    """Two steps that replace the same Parameter in turn: only newest-first undo restores the first one."""
    p1, p2 = (nn.Parameter(torch.full_like(lin.weight, v)) for v in (1.0, 2.0))
    UnitBuilder.set_attr(unit, lin, "weight", p1)
    UnitBuilder.set_attr(unit, lin, "weight", p2)
    return p1, p2


def test_unit_undo_runs_newest_step_first():
    lin = nn.Linear(3, 2)
    original = lin.weight
    unit = Unit("twice")
    _, p2 = _twice(unit, lin)
    unit.apply()
    assert lin.weight is p2
    unit.undo()
    assert lin.weight is original and list(lin._parameters) == ["weight", "bias"]


def test_failed_apply_undoes_newest_step_first():
    lin = nn.Linear(3, 2)
    original = lin.weight
    unit = Unit("twice, then fails")
    _twice(unit, lin)

    def fail() -> None:
        raise KeyboardInterrupt

    unit.steps.append((fail, lambda: None))
    with pytest.raises(KeyboardInterrupt):
        unit.apply()
    assert lin.weight is original and not unit.applied


def test_restore_undoes_newest_unit_first():
    """convert()'s restore after an interrupt: two units that replace the same Parameter in turn."""
    model = nn.Sequential(nn.Linear(3, 2))
    lin, original = model[0], model[0].weight
    first, second = Unit("first"), Unit("second")
    UnitBuilder.set_attr(first, lin, "weight", nn.Parameter(torch.ones_like(original)))
    UnitBuilder.set_attr(second, lin, "weight", nn.Parameter(torch.zeros_like(original)))
    first.apply()
    second.apply()
    _restore(model, [(first, None), (second, None)], False, None, KeyboardInterrupt())
    assert lin.weight is original


def test_isolating_failures_undoes_newest_unit_first():
    """Verification's isolation pass undoes every unit before re-applying them one by one: with two units that
    replace the same Parameter in turn (outputs unchanged), a later full restore must still reach the original."""
    model = nn.Sequential(nn.Linear(3, 2))
    lin, original = model[0], model[0].weight
    units = []
    for label in ("first", "second"):
        unit = Unit(label)
        UnitBuilder.set_attr(unit, lin, "weight", nn.Parameter(original.detach().clone()))
        unit.apply()
        units.append((unit, None))
    x = torch.randn(4, 3)
    with torch.no_grad():
        check = Check(x, model(x), "test input")
    assert _isolate_failures(model, [check], units, 1e-6, None).error == 0.0
    _restore(model, units, False, None, KeyboardInterrupt())
    assert lin.weight is original


def test_fold_into_a_bias_less_linear_adds_a_bias_and_undo_removes_it():
    """A fold whose β goes into the Linears' biases (`BetaMode.FOLD`) given a target without one: b' = W·β becomes
    a new bias Parameter; undo leaves the ``bias=None`` slot as it was (state dict and parameter order too)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 5, bias=False))
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
        model[0].bias.normal_(0.0, 0.3)
    x = torch.randn(4, 8)
    want, keys, slots = model(x), list(model.state_dict()), dict(model[1]._parameters)
    item = NormFold("0", "torch.nn.modules.normalization:LayerNorm", NormType.LAYER, WeightParam.W, 1e-5, [8], True,
                    targets=[LinearTarget("1", Layout.OUT_IN)], beta=BetaMode.FOLD)
    unit = item.build_unit(UnitBuilder(model))
    unit.apply()
    assert isinstance(model[1].bias, nn.Parameter) and model[1].bias.requires_grad
    torch.testing.assert_close(model(x), want, rtol=1e-6, atol=1e-6)
    unit.undo()
    assert model[1].bias is None and dict(model[1]._parameters) == slots and list(model.state_dict()) == keys
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)
