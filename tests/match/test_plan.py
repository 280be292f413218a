import json

from lmbp_convert import plan_conversion
from lmbp_convert.match.norm_exact import NormExact
from lmbp_convert.match.plan import Plan
from testsupport.families import hf


def test_plan_round_trips_through_json():
    plan = plan_conversion(hf("bert", head="base"))
    data = json.loads(json.dumps(plan.to_dict()))
    again = Plan.from_dict(data)
    assert again == plan
    assert again.predicted_saved_bytes == plan.predicted_saved_bytes > 0


def test_plan_changes_nothing():
    model = hf("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    types = [type(m) for m in model.modules()]
    plan = plan_conversion(model)
    assert plan.of(NormExact) and plan.gated_mlps
    assert [type(m) for m in model.modules()] == types
    assert all((before[k] == v).all() for k, v in model.state_dict().items())
