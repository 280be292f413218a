"""The enumerations are str-valued: members equal, print and serialise as the strings plans always held."""
import json

import pytest

from lmbp_convert.kinds import AffineState, BetaMode, NormKind, Verification, WeightParam


def test_members_equal_print_and_serialise_as_their_values():
    assert NormKind.RMS == "rms" and WeightParam("1+w") is WeightParam.ONE_PLUS_W
    assert f"[{NormKind.LAYER}, {WeightParam.ONE_PLUS_W}]" == "[layer, 1+w]" and str(BetaMode.SHIFT) == "shift"
    assert json.dumps({"v": Verification.CANNOT_VERIFY, "a": [AffineState.REAPPLIED]}) == \
        '{"v": "cannot verify", "a": ["reapplied"]}'
    assert (WeightParam.W.identity, WeightParam.ONE_PLUS_W.identity) == (1.0, 0.0)


def test_unknown_values_are_refused():
    with pytest.raises(ValueError):
        NormKind("layer_norm")
