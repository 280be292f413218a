"""match/norm_exact.py: under the exact default every norm fold becomes a `NormExact` (consumer folds and
channel-first norms included), and a fold kind with no exact form is a skip, never applied."""
import dataclasses
import sys

import pytest
import torch

from lmbp_convert import convert, plan_conversion
from lmbp_convert.match.consumers import ConsumerFold
from lmbp_convert.match.norm_exact import NormExact, exact_plan
from lmbp_convert.match.plan import Plan
from testsupport.families import randomize_norms

sys.path.insert(0, "tests/match")
from test_consumers import D, ConvMlpBlock, FusedQKV, _timm_layernorm2d  # noqa: E402


def _fold(model, x) -> ConsumerFold:
    (fold,) = plan_conversion(model, probe=x, activations=False, fold_norms=True).of(ConsumerFold)
    return fold


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_consumer_folds_become_exact_norms_and_round_trip():
    torch.manual_seed(0)
    model, x = randomize_norms(ConvMlpBlock(_timm_layernorm2d())), torch.randn(2, D, 6, 6)
    fold = _fold(model, x)
    plan = plan_conversion(model, probe=x, activations=False)
    (item,) = plan.of(NormExact)
    assert (item.name, item.channel_dim, item.readers) == (fold.name, 1, ["conv2d in fc1"])
    assert not plan.of(ConsumerFold) and "channels at dim 1" in item.describe()[0]
    assert Plan.from_dict(plan.to_dict()).of(NormExact) == [item]


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_a_fold_kind_without_an_exact_form_is_a_skip_that_names_the_fold():
    torch.manual_seed(0)
    fold = _fold(randomize_norms(FusedQKV()), torch.randn(2, 6, D))
    other = type("OtherFold", (ConsumerFold,), {})  # a fold kind norm_exact does not know
    item = other(**{f.name: getattr(fold, f.name) for f in dataclasses.fields(ConsumerFold)})
    items, (skip,) = exact_plan([item])
    assert items == [] and skip.name == "norm"
    assert skip.reason == ("no exact memory-sharing form for OtherFold yet: left as it is (fold_norms=True would fold "
                           "it into qkv.weight via linear in <model> (+β into q_bias, k_bias, v_bias))")


@pytest.mark.parametrize("family, expected", [
    ("llama", {"model.layers.0.input_layernorm": True, "model.layers.0.post_attention_layernorm": True,
               "model.norm": False}),  # the head reads a slice of the final norm's output (logits_to_keep)
    ("bert", {"bert.encoder.layer.0.attention.output.LayerNorm": False}),  # a residual add reads it too
])
def test_linear_readers_only_when_every_reader_is_a_linear_reading_y_as_it_is(family, expected):
    """The flag that lets a compiled norm emit the autocast dtype (`MSExactNorm.autocast_readers`): only where the
    fold's analysis saw Linears alone read the output, with no op between."""
    from testsupport.families import FAMILIES

    torch.manual_seed(0)
    model = convert(FAMILIES[family]().eval())
    got = {it.name: it.linear_readers_only for it in model.lmbp_report.plan.items if it.tag == "norm_exact"}
    assert {k: got[k] for k in expected} == expected
    assert all(m.autocast_readers == got[n] for n, m in model.named_modules() if n in got)
