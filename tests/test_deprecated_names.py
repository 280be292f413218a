"""Issue 36 item 8: what 0.2.0 renamed or removed keeps working until 0.3.0, each use with a DeprecationWarning that
names the new spelling (lmbp_convert/deprecation.py; CHANGELOG.md lists them)."""
from __future__ import annotations

import importlib
import sys

import pytest

from lmbp_convert import convert
from lmbp_convert.deprecation import REMOVED_IN
from testsupport.families import hf


def _warns(new: str):
    return pytest.warns(DeprecationWarning, match=rf"use {new}".replace(".", r"\.").replace("(", r"\("))


def test_plan_items_keep_their_old_field_names():
    from lmbp_convert.match.norm_exact import NormExact
    from lmbp_convert.match.plan import ActSwap, NormFold, NormSwap, OutputActSwap

    act = ActSwap("mlp.act", "torch.nn:GELU", "gelu", 2)
    with _warns("ActSwap.act"):
        assert act.kind == "gelu"
    with _warns("OutputActSwap.act"):
        assert OutputActSwap("a", "c", "relu_squared").kind == "relu_squared"
    fold = NormFold("ln", "torch.nn:LayerNorm", "layer", "w", 1e-5, [8], True)
    with _warns("NormFold.norm_type"):
        assert fold.kind == "layer"
    with _warns("NormFold.norm_type"):
        fold.kind = "rms"
    assert fold.norm_type == "rms"
    with _warns("NormSwap.norm_type"):
        assert NormSwap("n", "c", "rms", 1e-6, [8]).kind == "rms"
    exact = NormExact("n", "c", "rms", "w", 1e-6, [8], False)
    with _warns("NormExact.norm_type"):
        assert exact.kind == "rms"
    assert "kind" not in act.to_dict() and act.to_dict()["act"] == "gelu"  # plans are written with the new names


def test_old_norm_and_enum_names():
    from lmbp_convert import enums
    from lmbp_convert.match import functional
    from lmbp_convert.match.roles import NormRole
    from lmbp_convert.nn.norms import MSRMSNorm

    norm = MSRMSNorm(8, 1e-6, "one")
    with _warns("MSRMSNorm.norm_type"):
        assert norm.norm_kind == "rms"
    with _warns("MSRMSNorm.norm_type"):
        assert norm.kind == "rms_norm"
    with _warns("NormRole.norm_type"):
        assert NormRole("layer", "w", 1e-5, (8,), True).kind == "layer"
    with _warns("lmbp_convert.enums.NormType"):
        assert enums.NormKind is enums.NormType
    with _warns("lmbp_convert.match.functional.CONSUMERS"):
        assert functional.KINDS is functional.CONSUMERS
    with _warns("lmbp_convert.match.functional.ConsumerRule"):
        assert functional.Kind is functional.ConsumerRule
    with _warns("lmbp_convert.match.functional.register_consumer"):
        assert functional.register_kind is functional.register_consumer
    sys.modules.pop("lmbp_convert.kinds", None)
    with _warns("lmbp_convert.enums"):
        kinds = importlib.import_module("lmbp_convert.kinds")
    assert kinds.NormKind is enums.NormType and kinds.WeightParam is enums.WeightParam
    with pytest.raises(AttributeError):
        enums.NoSuchName  # noqa: B018


def test_return_report_and_last_report_still_work():
    import lmbp_convert

    model = hf("llama")
    with _warns("model.lmbp_report"):
        out = convert(model, return_report=True)
    assert isinstance(out, tuple) and out[0] is model and out[1] is model.lmbp_report
    with _warns("model.lmbp_report"):
        assert lmbp_convert.last_report(model) is model.lmbp_report
    with pytest.raises(TypeError, match="return_report must be True or False"):
        convert(hf("llama"), return_report="yes")


def test_the_removal_version_is_the_next_minor():
    import lmbp_convert

    major, minor, _ = (int(x) for x in lmbp_convert.__version__.split("."))
    assert REMOVED_IN == f"{major}.{minor + 1}.0"
