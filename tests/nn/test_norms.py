"""MSLayerNorm / MSRMSNorm modules: argument handling, identity buffers that keep state_dict keys, repr."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lmbp_convert.nn.norms import MSLayerNorm, MSRMSNorm
from lmbp_convert.ops.ms_norm import ms_layer_norm, ms_rms_norm


@pytest.mark.parametrize("cls,fn,eps", [(MSLayerNorm, ms_layer_norm, 1e-5), (MSRMSNorm, ms_rms_norm, 1e-6)])
def test_forward_is_the_op_and_has_no_parameters(cls, fn, eps):
    m = cls(12)
    assert m.normalized_shape == (12,) and m.eps == eps
    assert list(m.parameters()) == [] and list(m.buffers()) == [] and m.state_dict() == {}
    x = torch.randn(2, 3, 12, requires_grad=True)
    y = m(x)
    assert torch.equal(y, fn(x, 12, eps))
    y.sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("cls", (MSLayerNorm, MSRMSNorm))
def test_multi_dim_shape_and_custom_eps(cls):
    m = cls([3, 4], eps=1e-3)
    x = torch.randn(5, 3, 4)
    assert m.normalized_shape == (3, 4)
    expect = (ms_layer_norm if cls is MSLayerNorm else ms_rms_norm)(x, (3, 4), 1e-3)
    assert torch.equal(m(x), expect)


@pytest.mark.parametrize("cls,orig,has_bias", [(MSLayerNorm, nn.LayerNorm, True), (MSRMSNorm, nn.RMSNorm, False)])
@pytest.mark.parametrize("fill", ("one", "zero"))
def test_identity_affine_buffers(cls, orig, has_bias, fill):
    m = cls((4, 6), identity_affine=fill, dtype=torch.bfloat16, device="cpu")
    assert list(m.parameters()) == []
    keys = {"weight", "bias"} if has_bias else {"weight"}
    assert set(m.state_dict()) == keys  # persistent: the original keys survive conversion
    assert m.weight.shape == (4, 6) and m.weight.dtype == torch.bfloat16
    assert torch.equal(m.weight, torch.full((4, 6), 1.0 if fill == "one" else 0.0, dtype=torch.bfloat16))
    if has_bias:
        assert m.bias.dtype == torch.bfloat16 and not m.bias.any()
    # the converted module loads a state_dict with the original module's keys, strictly
    m.load_state_dict(orig((4, 6)).state_dict())
    # forward ignores the buffers: same output as without them, even with non-identity values loaded
    m.weight.fill_(3.0)
    x = torch.randn(2, 4, 6)
    assert torch.equal(m(x), cls((4, 6))(x))


def test_identity_buffers_follow_module_casts():
    m = MSLayerNorm(8, identity_affine="one").to(torch.float16)
    assert m.weight.dtype == torch.float16 and m.bias.dtype == torch.float16
    assert m(torch.randn(3, 8, dtype=torch.float16)).dtype == torch.float16


@pytest.mark.parametrize("cls", (MSLayerNorm, MSRMSNorm))
def test_bad_arguments(cls):
    with pytest.raises(ValueError, match="identity_affine"):
        cls(8, identity_affine="ones")
    with pytest.raises(ValueError, match="normalized_shape"):
        cls(())
    with pytest.raises(ValueError, match="normalized_shape"):
        cls(8)(torch.randn(2, 7))


def test_extra_repr():
    r = repr(MSLayerNorm(16))
    assert r == "MSLayerNorm(norm_type=layer, normalized_shape=(16,), eps=1e-05)"
    r = repr(MSRMSNorm((2, 8), eps=1e-5, identity_affine="zero"))
    assert r == "MSRMSNorm(norm_type=rms, normalized_shape=(2, 8), eps=1e-05, identity_affine='zero')"


@pytest.mark.parametrize("cls", (MSLayerNorm, MSRMSNorm))
def test_autocast_output_dtype(cls):
    m = cls(16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(torch.randn(2, 16))
    assert y.dtype == torch.bfloat16


@pytest.mark.parametrize("cls", (MSLayerNorm, MSRMSNorm))
def test_declared_affine_state(cls):
    """Where the affine lives is a field (folded / re-applied), not an attribute read with a default."""
    from lmbp_convert.enums import AffineState, ConvertedModule, WeightParam

    folded = cls(8, identity_affine="zero")
    assert isinstance(folded, ConvertedModule)
    assert (folded.affine, folded.param) == (AffineState.FOLDED, WeightParam.ONE_PLUS_W)
    w, b = nn.Parameter(torch.rand(8)), nn.Parameter(torch.rand(8))
    kept = cls.reapplying(8, 1e-5, w, b, "1+w")
    assert (kept.affine, kept.param) == (AffineState.REAPPLIED, WeightParam.ONE_PLUS_W)
    assert kept.weight is w and kept.bias is b and set(kept.state_dict()) == {"weight", "bias"}
    assert "affine=reapplied, param=1+w" in repr(kept)
    x = torch.randn(2, 8)
    assert torch.equal(kept(x), cls(8, eps=1e-5)(x))  # forward never reads the kept affine


def test_norms_round_trip_through_pickle_with_their_declared_state():
    """What this package pickles today loads back as it was (the shim for modules pickled before the state was
    declared is gone: no such module exists outside this repository)."""
    import pickle

    from lmbp_convert.enums import AffineState, WeightParam

    kept = MSRMSNorm.reapplying(8, 1e-5, nn.Parameter(torch.rand(8)), None, "1+w")
    back = pickle.loads(pickle.dumps(kept))
    assert (back.affine, back.param) == (AffineState.REAPPLIED, WeightParam.ONE_PLUS_W)
    assert torch.equal(back.weight, kept.weight)
    folded = pickle.loads(pickle.dumps(MSLayerNorm(8, identity_affine="zero")))
    assert (folded.affine, folded.param) == (AffineState.FOLDED, WeightParam.ONE_PLUS_W)
