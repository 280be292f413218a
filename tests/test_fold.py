import pytest
import torch
from torch import nn

from lmbp_convert.fold import apply_affine, effective_scale, fold_affine, identity_weight_value


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("has_beta", [True, False])
def test_fold_matches_affine_then_linear(layout, has_bias, has_beta):
    d, o = 12, 7
    x = torch.randn(5, d, dtype=torch.float64)
    gamma, beta = torch.rand(d, dtype=torch.float64) + 0.5, torch.randn(d, dtype=torch.float64)
    w = torch.randn(o, d, dtype=torch.float64)
    b = torch.randn(o, dtype=torch.float64) if has_bias else None
    ref = torch.nn.functional.linear(apply_affine(x, gamma, beta if has_beta else None), w, b)
    w_in = w if layout == "out_in" else w.t().contiguous()
    w2, b2 = fold_affine(w_in, b, gamma, beta if has_beta else None, layout)
    w2 = w2 if layout == "out_in" else w2.t()
    out = torch.nn.functional.linear(x, w2, b2)
    assert torch.allclose(out, ref, atol=1e-12)
    assert (b2 is None) == (not has_bias and not has_beta)


def test_fold_keeps_dtype_and_computes_in_fp32():
    w = torch.randn(4, 8).to(torch.bfloat16)
    gamma = torch.rand(8) + 0.5
    w2, b2 = fold_affine(w, None, gamma, torch.randn(8))
    assert w2.dtype == torch.bfloat16 and b2.dtype == torch.bfloat16
    assert torch.equal(w2, (w.float() * gamma).to(torch.bfloat16))


def test_gemma_parameterisation_and_identity():
    w = torch.randn(6)
    assert torch.allclose(effective_scale(w, "1+w"), 1 + w)
    assert torch.equal(effective_scale(w, "w"), w)
    assert identity_weight_value("w") == 1.0 and identity_weight_value("1+w") == 0.0
    with pytest.raises(ValueError):
        effective_scale(w, "2w")


def test_fold_rejects_mismatched_channels():
    with pytest.raises(ValueError, match="channels"):
        fold_affine(torch.randn(3, 5), None, torch.ones(4), None)


def test_conv1d_layout_matches_hf_conv1d():
    from transformers.pytorch_utils import Conv1D

    conv = Conv1D(6, 10).double()
    nn.init.normal_(conv.weight)
    nn.init.normal_(conv.bias)
    x = torch.randn(3, 10, dtype=torch.float64)
    gamma, beta = torch.rand(10, dtype=torch.float64) + 0.5, torch.randn(10, dtype=torch.float64)
    ref = conv(apply_affine(x, gamma, beta))
    w2, b2 = fold_affine(conv.weight, conv.bias, gamma, beta, "in_out")
    with torch.no_grad():
        conv.weight.copy_(w2)
        conv.bias.copy_(b2)
    assert torch.allclose(conv(x), ref, atol=1e-12)


def test_shift_behind_the_scale_gives_the_same_affine():
    from lmbp_convert.fold import shift_is_expressible, shift_of, shift_through_scale

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 8, generator=gen), torch.randn(3, 8, generator=gen)
    gamma, beta = torch.rand(8, generator=gen) + 0.5, torch.randn(8, generator=gen)
    shift = shift_through_scale(beta, gamma)
    # W·(γ·x + β) = (W·diag(γ))·x + (W·diag(γ))·(β/γ)
    w_fold = w * gamma
    torch.testing.assert_close(x @ w_fold.T + shift_of(w_fold, shift), (x * gamma + beta) @ w.T)
    torch.testing.assert_close(shift_of(w.T.contiguous(), beta, "in_out"), w @ beta)  # HF Conv1D layout
    assert shift_is_expressible(beta, gamma)
    gamma[2] = 0.0
    assert not shift_is_expressible(beta, gamma)
    beta[2] = 0.0
    assert shift_is_expressible(beta, gamma) and shift_through_scale(beta, gamma)[2] == 0
