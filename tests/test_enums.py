"""The enumerations are str-valued: members equal, print and serialise as the strings plans always held."""
import json

import pytest

from lmbp_convert.enums import (GATED_ACT_KINDS, AffineState, BetaMode, ConvertedHook, ConvertedModule, NormType,
                                Verification, WeightParam)


def test_members_equal_print_and_serialise_as_their_values():
    assert NormType.RMS == "rms" and WeightParam("1+w") is WeightParam.ONE_PLUS_W
    assert f"[{NormType.LAYER}, {WeightParam.ONE_PLUS_W}]" == "[layer, 1+w]" and str(BetaMode.SHIFT) == "shift"
    assert json.dumps({"v": Verification.CANNOT_VERIFY, "a": [AffineState.REAPPLIED]}) == \
        '{"v": "cannot verify", "a": ["reapplied"]}'
    assert (WeightParam.W.identity, WeightParam.ONE_PLUS_W.identity) == (1.0, 0.0)
    assert (WeightParam.W.identity_fill, WeightParam.ONE_PLUS_W.identity_fill) == ("one", "zero")


def test_one_source_for_identity_values_and_gated_activations():
    """fold, the norms' identity buffers and the gated op read the tables here instead of keeping copies."""
    from lmbp_convert.fold import identity_weight_value
    from lmbp_convert.match.gated import FUSED_ACTS
    from lmbp_convert.nn.norms import MSLayerNorm
    from lmbp_convert.ops.activations import ACTIVATIONS
    from lmbp_convert.ops.gated_mlp import ACT_KINDS

    for p in WeightParam:
        assert identity_weight_value(p) == identity_weight_value(p.value) == p.identity
        norm = MSLayerNorm(4, identity_affine=p.identity_fill)
        assert norm.param is p and bool((norm.weight == p.identity).all())
    assert ACT_KINDS is FUSED_ACTS is GATED_ACT_KINDS and set(GATED_ACT_KINDS) <= set(ACTIVATIONS)


def test_our_hooks_and_modules_carry_the_marker_bases():
    from lmbp_convert.apply.hooks import AddShift, ReapplyInput, ReapplyOutput
    from lmbp_convert.apply.load_hooks import FoldOnLoad
    from lmbp_convert.nn.activations import ApproxActivation
    from lmbp_convert.nn.gated_mlp import MSGatedMLP
    from lmbp_convert.nn.norms import MSLayerNorm, MSRMSNorm

    assert all(issubclass(c, ConvertedHook) for c in (AddShift, ReapplyInput, ReapplyOutput, FoldOnLoad))
    assert all(issubclass(c, ConvertedModule) for c in (ApproxActivation, MSGatedMLP, MSLayerNorm, MSRMSNorm))


def test_unknown_values_are_refused():
    with pytest.raises(ValueError):
        NormType("layer_norm")
