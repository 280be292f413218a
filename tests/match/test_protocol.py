"""The rewrite protocol: plan items serialise by their kind tag, and a kind defined *here* — plan item, matcher,
unit builder, module — flows through planning, convert(), verification and rollback, the report and plan files
without any change to the package (the plug-in claim)."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from lmbp_convert import convert, plan_conversion
from lmbp_convert.apply.rewrite import Unit, UnitBuilder
from lmbp_convert.reasons import Reason, ReasonCode
from lmbp_convert.catalogue import class_key
from lmbp_convert.enums import BetaMode, Layout, NormType, ReapplyKind, WeightParam
from lmbp_convert.match.context import MatchContext
from lmbp_convert.match.kinds import RewriteKind, matchers, register_kind, rewrite_kinds, unregister_kind
from lmbp_convert.match.loss import LossSwap
from lmbp_convert.match.norm_exact import NormExact
from lmbp_convert.match.plan import (ActSwap, GatedMLPSwap, LinearTarget, NormFold, Plan, PlanItem, ReapplySite,
                                     Skip)


# -- a plug-in kind: swap nn.Tanh for a module that records its calls (and, with scale ≠ 1, changes outputs) ----
class RecordingTanh(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale, self.calls = scale, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(x) * self.scale


@dataclass
class TanhSwap(PlanItem):
    tag = "tanh_swaps"
    noun = "tanh swaps"
    noun_one = "tanh swap"
    heading = "tanh → recording"

    scale: float = 1.0
    predicted_saved_bytes: int = 0

    def describe(self) -> list[str]:
        return [f"  {self.name} (scale {self.scale})"]


def match_tanh(ctx: MatchContext):
    for name, mod in ctx.modules.items():
        if isinstance(mod, nn.Tanh) and name not in ctx.claimed and ctx.opt.selected(name):
            yield TanhSwap(name, class_key(mod), scale=ctx.model.tanh_scale, predicted_saved_bytes=7)


def build_tanh(builder: UnitBuilder, item: TanhSwap) -> Unit:
    unit = Unit(f"tanh {item.name}")
    builder.swap_module(unit, item.name, RecordingTanh(item.scale))
    return unit


@pytest.fixture
def tanh_kind():
    """The whole kind in one declaration, and out again in one call: no registry is patched."""
    before = rewrite_kinds()
    register_kind(RewriteKind(TanhSwap, build_tanh, match_tanh))
    yield TanhSwap
    if TanhSwap in [k.item for k in rewrite_kinds()]:
        unregister_kind(TanhSwap)
    assert rewrite_kinds() == before and match_tanh not in matchers()


class TanhNet(nn.Module):
    def __init__(self, tanh_scale: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.act, self.norm = nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16)
        self.fc2, self.tanh, self.head = nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
        self.tanh_scale = tanh_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.tanh(self.fc2(self.norm(self.act(self.fc1(x))))))


def test_plugin_kind_flows_through_convert_report_and_plan_files(tanh_kind):
    model, x = TanhNet(), torch.randn(3, 8)
    ref = model(x)
    convert(model, probe=x)
    rep = model.lmbp_report
    assert isinstance(model.tanh, RecordingTanh) and rep.verified
    assert [type(it) for it in rep.plan.items] == [NormExact, ActSwap, TanhSwap]
    assert rep.swapped == ["act", "norm", "tanh"]  # report order: kinds in registration order
    text = str(rep)
    assert text.splitlines()[1] == rep.counts() == "converted: 1 activation, 1 norm (exact), 1 tanh swap; 0 skipped"
    assert "tanh → recording:\n  tanh (scale 1.0)" in text
    assert rep.plan.predicted_saved_bytes == sum(it.predicted_saved_bytes for it in rep.plan.items)
    assert rep.to_dict()["plan"]["tanh_swaps"] == [{"name": "tanh", "cls": "torch.nn.modules.activation:Tanh",
                                                    "scale": 1.0, "predicted_saved_bytes": 7}]
    calls = model.tanh.calls
    assert torch.allclose(model(x), ref, atol=1e-5) and model.tanh.calls == calls + 1
    again = Plan.from_dict(json.loads(json.dumps(rep.plan.to_dict())))
    assert again == rep.plan and isinstance(again.items[-1], TanhSwap)


def test_plugin_kind_that_changes_outputs_is_rolled_back_alone(tanh_kind):
    model, x = TanhNet(tanh_scale=2.0), torch.randn(3, 8)
    ref = model(x)
    convert(model, probe=x)
    rep = model.lmbp_report
    assert type(model.tanh) is nn.Tanh  # its unit was undone
    assert rep.rolled_back and rep.rolled_back[0][0] == "tanh tanh"
    assert [type(it) for it in rep.plan.items] == [NormExact, ActSwap]  # the others are kept
    assert any(s.name == "tanh" and s.reason.startswith("rolled back") for s in rep.plan.skips)
    assert rep.verified and torch.allclose(model(x), ref, atol=1e-5)


def test_unregistered_kind_in_a_plan_file_is_a_clear_error(tanh_kind):
    plan = Plan(items=[TanhSwap("t", "torch.nn:Tanh", 2.0, 7)])
    data = plan.to_dict()
    unregister_kind(TanhSwap)
    with pytest.raises(ValueError, match="unknown kind 'tanh_swaps'"):
        Plan.from_dict(data)


def test_unit_builder_is_required():
    @dataclass
    class Orphan(PlanItem):
        predicted_saved_bytes: int = 0

    with pytest.raises(TypeError, match="no unit builder for plan item"):
        Orphan("x", "y").build_unit(UnitBuilder(nn.Linear(2, 2)))


# -- serialisation of the built-in kinds ---------------------------------------------------------------------
def _every_kind() -> Plan:
    fold = NormFold("model.norm", "torch.nn:LayerNorm", "layer", "1+w", 1e-5, [16], True,
                    [LinearTarget("lm_head", "out_in", ["__getitem__"], True, "base_layer", ["default"], "lora_A")],
                    [ReapplySite("root_output", "", paths=[["last_hidden_state"]], consumer="model output"),
                     ReapplySite("module_input", "block", 1, None, consumer="add in block")],
                    ["a caveat"], 1234, beta="shift")
    return Plan(items=[GatedMLPSwap("mlp", "x:MLP", "silu", "mlp.act", "gate", "up", None, "down", True, 99), fold,
                       ActSwap("act", "torch.nn:GELU", "gelu", 2, 77)],
                skips=[Skip("n2", "torch.nn:LayerNorm", Reason(ReasonCode.EXCLUDED, "why", "n2"))], already_converted=["old"], probe_tokens=8,
                probe_unit="token", options={"bits": 2})


def test_every_builtin_kind_round_trips_through_json_with_its_types():
    plan = _every_kind()
    data = json.loads(json.dumps(plan.to_dict()))
    assert list(data)[:3] == ["gated_mlps", "norm_folds", "act_swaps"]  # plan order kept
    again = Plan.from_dict(data)
    assert again == plan and [type(i) for i in again.items] == [GatedMLPSwap, NormFold, ActSwap]
    fold = again.items[1]
    assert (fold.norm_type, fold.param, fold.beta) == (NormType.LAYER, WeightParam.ONE_PLUS_W, BetaMode.SHIFT)
    assert fold.norm_type is NormType.LAYER and fold.targets[0].layout is Layout.OUT_IN
    assert [r.kind for r in fold.reapply] == [ReapplyKind.ROOT_OUTPUT, ReapplyKind.MODULE_INPUT]
    assert data["norm_folds"][0]["param"] == "1+w" and data["norm_folds"][0]["beta"] == "shift"


def test_plan_files_in_the_earlier_layout_still_read():
    """Before plan items, a plan was three fixed lists in this order; the layout is unchanged, so they read."""
    old = {"act_swaps": [{"name": "a", "cls": "c", "kind": "gelu", "bits": 2, "predicted_saved_bytes": 3}],
           "norm_folds": [{"name": "n", "cls": "c", "kind": "rms", "param": "w", "eps": 1e-6, "shape": [4],
                           "has_bias": False, "targets": [{"name": "l", "layout": "in_out"}], "reapply": [],
                           "caveats": [], "predicted_saved_bytes": 5, "prefolded": True, "beta": "none"}],
           "gated_mlps": [], "skips": [], "already_converted": [], "probe_tokens": 2, "probe_unit": "sample",
           "options": {}}
    plan = Plan.from_dict(old)
    assert [i.name for i in plan.items] == ["a", "n"] and plan.predicted_saved_bytes == 8
    assert plan.norm_folds[0].targets[0].layout is Layout.IN_OUT and plan.norm_folds[0].prefolded
    assert Plan.from_dict(plan.to_dict()) == plan


def test_kind_views_are_read_only_filters():
    plan = _every_kind()
    assert [a.name for a in plan.act_swaps] == ["act"] and [g.name for g in plan.gated_mlps] == ["mlp"]
    plan.norm_folds.clear()  # a copy: the plan is unchanged
    assert len(plan.items) == 3
    with pytest.raises(AttributeError):
        plan.norm_folds = []


def test_plan_conversion_returns_the_plan_with_its_probe_and_reference_output():
    model, x = TanhNet(), torch.randn(3, 8)
    plan = plan_conversion(model, probe=x)
    assert isinstance(plan, Plan) and plan.probe is x
    assert torch.equal(plan.reference_output, model(x))
    data = plan.to_dict()
    assert "probe" not in data and "reference_output" not in data and "probe=" not in repr(plan)
    assert Plan.from_dict(data) == plan  # run-time data is not compared either


def test_claimed_modules_are_left_to_their_claimant():
    """A gated MLP claims its activation: the activation matcher, which runs after it, skips it."""
    from testsupport.families import hf

    plan = plan_conversion(hf("llama"))
    gated = plan.gated_mlps
    assert gated and not {g.act_module for g in gated} & {a.name for a in plan.act_swaps}
    assert [type(i) for i in plan.items] == sorted((type(i) for i in plan.items),
                                                   key=[GatedMLPSwap, NormExact, ActSwap, LossSwap].index)
