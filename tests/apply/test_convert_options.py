"""The options contract: convert(model, options=None, *, probe=None, **overrides), checked before anything."""
from __future__ import annotations

import warnings

import pytest
import torch

from lmbp_convert import ConvertOptions, NothingToConvertError, convert, plan_conversion
from lmbp_convert.trace.probe import make_probe
from model_state import assert_same, snapshot
from testsupport.families import FAMILIES


def test_keywords_next_to_options_are_merged():
    model = FAMILIES["bert"]()
    rep = convert(model, ConvertOptions(norms=False), bits=4).lmbp_report
    assert rep.plan.act_swaps and all(a.bits == 4 for a in rep.plan.act_swaps)
    assert not rep.plan.norm_folds


def test_keyword_contradicting_an_explicit_option_is_a_type_error():
    model = FAMILIES["bert"]()
    before = snapshot(model)
    with pytest.raises(TypeError, match="bits=4 conflicts"):
        convert(model, ConvertOptions(bits=3), bits=4)
    with pytest.raises(TypeError, match="unknown conversion option.*bitz"):
        convert(model, bitz=4)
    with pytest.raises(TypeError, match="unknown conversion option"):
        convert(model, ConvertOptions(), bitz=4)
    assert_same(model, before, "refused keywords")
    convert(model, ConvertOptions(bits=3, exclude="classifier"), bits=3, exclude=["classifier"], norms=False)  # same values
    assert model.lmbp_report.plan.act_swaps[0].bits == 3


def test_probe_is_an_argument_not_an_option():
    model = FAMILIES["llama"]()
    probe = make_probe(model)[0]
    with pytest.raises(TypeError, match="probe"):
        ConvertOptions(probe=probe)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rep = convert(model, probe=probe).lmbp_report
    assert rep.verified and rep.plan.probe_unit == "sample"


@pytest.mark.parametrize("kwargs, match", [
    ({"rtol": -1e-3}, "rtol"), ({"rtol": float("nan")}, "rtol"), ({"rtol": True}, "rtol"),
    ({"verify": "no"}, "verify"), ({"bits": True}, "bits"), ({"bits": 2.0}, "bits"), ({"bits": 0}, "bits"),
    ({"norms": 1}, "norms"), ({"untie": "yes"}, "untie"), ({"include": []}, "include"),
    ({"exclude": [3]}, "exclude"), ({"include": 5}, "include"),
])
def test_bad_values_are_value_errors_before_anything(kwargs, match):
    model = FAMILIES["llama"]()
    before = snapshot(model)
    with pytest.raises(ValueError, match=match):
        convert(model, **kwargs)
    with pytest.raises(ValueError, match=match):
        ConvertOptions(**kwargs)
    assert_same(model, before, str(kwargs))


def test_options_changed_after_construction_are_checked_too():
    opts = ConvertOptions(norms=False)
    opts.bits = 7
    with pytest.raises(ValueError, match="bits"):
        convert(FAMILIES["bert"](), opts)
    opts.bits, opts.exclude = 3, "bert.encoder.layer.0.intermediate.intermediate_act_fn"  # patterns recompiled
    rep = convert(FAMILIES["bert"](), opts).lmbp_report
    assert [a.name for a in rep.plan.act_swaps] == ["bert.encoder.layer.1.intermediate.intermediate_act_fn"]


def test_include_that_matches_nothing_names_the_pattern():
    model = FAMILIES["llama"]()
    before = snapshot(model)
    with pytest.raises(NothingToConvertError, match=r"include=\['model.layres.0.mlp'\] matches no module .*"
                                                    r"closest names: model.layers.0.mlp"):
        convert(model, include=["model.layres.0.mlp"])
    assert_same(model, before, "include")
    with pytest.warns(UserWarning, match="include pattern.*typo"):  # one of several: warned, the rest converted
        rep = convert(model, include=["model.norm", "typo"]).lmbp_report
    assert rep.swapped == ["model.norm"]


def test_exclude_that_matches_nothing_warns():
    model = FAMILIES["llama"]()
    with pytest.warns(UserWarning, match=r"exclude pattern\(s\) \['model\.layer\.0'\] match no module"
                                         r".*closest names: model.layers.0"):
        rep = convert(model, exclude=["model.layer.0", "lm_head"]).lmbp_report
    # lm_head excluded: nothing to fold into (the norm may keep its affine instead, which leaves lm_head untouched)
    assert "model.norm" not in {f.name for f in rep.plan.norm_folds}
    assert all("lm_head" not in t.name for f in rep.plan.norm_folds for t in f.targets)
    with warnings.catch_warnings():  # planning alone stays silent: the CLI reports patterns its own way
        warnings.simplefilter("error")
        plan_conversion(FAMILIES["llama"](), exclude=["model.layer.0"])


def test_the_report_is_model_lmbp_report_and_the_only_way():
    """One way to the report (issue 22, item 7): the documented way warns about nothing; 0.1.0's
    `return_report=True` and `last_report()` are deprecated (issue 36 item 8: they work until 0.3.0, each with a
    DeprecationWarning naming `model.lmbp_report`; tests/test_deprecated_names.py)."""
    from torch import nn

    import lmbp_convert
    from lmbp_convert.apply import convert as convert_module

    m = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4), nn.GELU())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the documented way warns about nothing
        assert convert(m, probe=torch.randn(2, 8)) is m and m.lmbp_report.verified
    with pytest.warns(DeprecationWarning, match=r"return_report=True\) is deprecated .*use model\.lmbp_report"):
        assert convert(m, probe=torch.randn(2, 8), return_report=True) == (m, m.lmbp_report)
    with pytest.warns(DeprecationWarning, match=r"last_report\(model\) is deprecated"):
        assert lmbp_convert.last_report(m) is convert_module.last_report(m) is m.lmbp_report
