"""The fold maths (lmbp_convert.fold) on random tensors: fold∘unfold is the identity, the chunked fold is the whole
fold bit for bit, both weight layouts and both norm weight parameterisations agree."""
from enum import Enum

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmbp_convert.fold import (
    Scratch, UnfoldError, accumulation_dtype, apply_affine, effective_scale, fold_affine, fold_bias, fold_lora_a,
    fold_rows, fold_scale, identity_weight_value, matvec, norm_scale, relative_residual, remove_shift,
    shift_behind_scale, shift_of, shift_through_scale, unfold_added_bias, unfold_affine, unfold_bias, unfold_scale,
)


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
    from lmbp_convert.fold import shift_is_expressible

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


# -- every fold / unfold function, on random tensors ---------------------------------------------------------------
class _Param(str, Enum):  # how a caller's enum of the parameterisation looks (a str-valued enum)
    W = "w"
    ONE_PLUS_W = "1+w"


class _Layout(str, Enum):
    OUT_IN = "out_in"
    IN_OUT = "in_out"


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _as_layout(w_out_in: torch.Tensor, layout: str) -> torch.Tensor:
    return w_out_in if layout == "out_in" else w_out_in.t().contiguous()


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("has_beta", [True, False])
def test_fold_then_unfold_is_the_identity(layout, has_bias, has_beta):
    g = _gen(1)
    w = _as_layout(torch.randn(9, 16, generator=g), layout)
    b = torch.randn(9, generator=g) if has_bias else None
    gamma, beta = torch.rand(16, generator=g) + 0.5, torch.randn(16, generator=g)
    w_fold, b_fold = fold_affine(w, b, gamma, beta if has_beta else None, layout)
    w_back, b_back = unfold_affine(w_fold, b_fold, gamma, beta if has_beta else None, layout)
    assert w_back.dtype == torch.float64
    torch.testing.assert_close(w_back.float(), w, rtol=1e-6, atol=1e-6)
    if b is None and not has_beta:
        assert b_fold is None and b_back is None
    elif b is None:  # the fold made a bias of W·β alone: unfolding leaves nothing of it
        torch.testing.assert_close(b_back.float(), torch.zeros(9), rtol=0, atol=1e-5)
    else:
        torch.testing.assert_close(b_back.float(), b, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_fold_scale_then_unfold_scale_is_the_identity(layout):
    g = _gen(2)
    w = _as_layout(torch.randn(5, 11, generator=g, dtype=torch.float64), layout)
    gamma = torch.randn(11, generator=g, dtype=torch.float64)
    torch.testing.assert_close(unfold_scale(fold_scale(w, gamma, layout), gamma, layout), w, rtol=1e-14, atol=0)


def test_both_layouts_agree():
    """Conv1D's [in, out] weight is nn.Linear's transposed: the folds agree (the scaled weight bit for bit)."""
    g = _gen(3)
    w, b = torch.randn(7, 13, generator=g), torch.randn(7, generator=g)
    gamma, beta = torch.rand(13, generator=g) + 0.5, torch.randn(13, generator=g)
    w1, b1 = fold_affine(w, b, gamma, beta, "out_in")
    w2, b2 = fold_affine(w.t().contiguous(), b, gamma, beta, "in_out")
    assert torch.equal(w1, w2.t())
    torch.testing.assert_close(b1, b2)
    torch.testing.assert_close(matvec(w, beta), matvec(w.t().contiguous(), beta, "in_out"))
    torch.testing.assert_close(shift_of(w, beta), shift_of(w.t().contiguous(), beta, _Layout.IN_OUT))
    wu1, bu1 = unfold_affine(w1, b1, gamma, beta, "out_in")
    wu2, bu2 = unfold_affine(w2, b2, gamma, beta, _Layout.IN_OUT)
    assert torch.equal(wu1, wu2.t())
    torch.testing.assert_close(bu1, bu2, rtol=1e-5, atol=1e-5)  # from fp32 biases that differ in the last bit
    torch.testing.assert_close(unfold_bias(b1, w, beta), unfold_bias(b1, w.t(), beta, "in_out"))


@pytest.mark.parametrize("layout", ["out_in", "in_out", _Layout.IN_OUT])
def test_unknown_layout_is_refused_and_enums_are_accepted(layout):
    w = torch.randn(3, 3)
    fold_affine(w, None, torch.ones(3), torch.ones(3), layout)
    with pytest.raises(ValueError, match="layout"):
        fold_affine(w, None, torch.ones(3), None, "in-out")
    with pytest.raises(ValueError, match="layout"):
        unfold_scale(w, torch.ones(3), "transposed")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["out_in", "in_out"])
@pytest.mark.parametrize("block", [1, 4, 7, 64])
def test_chunked_fold_equals_whole_fold_bit_for_bit(dtype, layout, block):
    g = _gen(4)
    w = torch.randn(29, 19, generator=g, dtype=torch.float64).to(dtype)
    d = w.shape[1] if layout == "out_in" else w.shape[0]
    gamma = effective_scale((torch.randn(d, generator=g) * 0.3).to(dtype), "1+w")
    whole = fold_scale(w, gamma, layout)
    for in_place in (False, True):
        scratch = Scratch()
        parts = [fold_rows(w[r0:r0 + block].clone(), gamma, layout, r0, scratch, in_place=in_place).clone()
                 for r0 in range(0, w.shape[0], block)]
        got = torch.cat(parts)
        assert got.dtype == dtype and torch.equal(got, whole), (in_place, block)


def test_chunked_fold_leaves_the_unrounded_product_in_the_scratch():
    w = torch.randn(6, 10).to(torch.bfloat16)
    gamma = torch.rand(10) * 3
    scratch = Scratch()
    out = fold_rows(w, gamma, "out_in", 0, scratch)
    acc = scratch.accumulator(out.shape)
    assert torch.equal(acc, w.float() * gamma) and torch.equal(acc.to(torch.bfloat16), out)


def test_fold_lora_a_keeps_the_adapter_path():
    """B·(A·(γ·x)) = B·((A·diag(γ))·x): the LoRA branch of a folded Linear computes what it did."""
    g = _gen(5)
    x, a, bb = torch.randn(4, 12, generator=g), torch.randn(3, 12, generator=g), torch.randn(8, 3, generator=g)
    gamma = torch.rand(12, generator=g) + 0.5
    a_fold = fold_lora_a(a, gamma)
    assert torch.equal(a_fold, fold_affine(a, None, gamma, None, "out_in")[0])
    torch.testing.assert_close(x @ a_fold.T @ bb.T, (x * gamma) @ a.T @ bb.T)


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_fold_bias_is_the_bias_of_the_fold_and_unfold_bias_its_inverse(layout):
    g = _gen(6)
    w = _as_layout(torch.randn(6, 9, generator=g), layout)
    b, beta = torch.randn(6, generator=g), torch.randn(9, generator=g)
    new, shift = fold_bias(b, w, beta, layout)
    assert new.dtype == shift.dtype == torch.float64
    torch.testing.assert_close(new.float(), fold_affine(w, b, torch.ones(9), beta, layout)[1])
    torch.testing.assert_close(remove_shift(new, shift), b.double(), rtol=0, atol=1e-12)
    assert torch.equal(remove_shift(b, None), b.double())
    torch.testing.assert_close(unfold_bias(new, w, beta, layout), b.double(), rtol=0, atol=1e-12)


def test_unfold_scale_with_a_zero_scale():
    w = torch.randn(4, 5, dtype=torch.float64)
    gamma = torch.tensor([1.0, 0.0, 2.0, 0.5, 3.0], dtype=torch.float64)
    folded = fold_scale(w, gamma)
    back = unfold_scale(folded, gamma)  # the channel is read by nothing: it unfolds to 0
    assert torch.equal(back[:, 1], torch.zeros(4)) and torch.allclose(back[:, [0, 2, 3, 4]], w[:, [0, 2, 3, 4]])
    folded[0, 1] = 1.0  # trained after the fold: a plain model with γ = 0 cannot read the channel
    with pytest.raises(UnfoldError, match="γ is exactly 0"):
        unfold_scale(folded, gamma)
    with pytest.raises(UnfoldError):
        unfold_affine(folded.t().contiguous(), None, gamma, None, "in_out")


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_unfold_added_bias_moves_the_bias_into_the_norm_shift(layout):
    """A width-reducing bias-less Linear (4C → 2C) got the bias W'·β from a fold: it goes back into the norm's
    shift β*, and a sibling Linear with a bias keeps the function through b − W'·β*."""
    g = _gen(7)
    d = 12
    gamma, beta = torch.rand(d, generator=g, dtype=torch.float64) + 0.5, torch.randn(d, generator=g,
                                                                                     dtype=torch.float64)
    w_red = _as_layout(torch.randn(d // 2, d, generator=g, dtype=torch.float64), layout)
    w_sib = _as_layout(torch.randn(5, d, generator=g, dtype=torch.float64), layout)
    b_sib = torch.randn(5, generator=g, dtype=torch.float64)
    w_red_f, b_red_f = fold_affine(w_red, None, gamma, beta, layout)
    w_sib_f, b_sib_f = fold_affine(w_sib, b_sib, gamma, beta, layout)
    old_shift = torch.zeros(d, dtype=torch.float64)
    shift, (b_sib_new,), _, _ = move = unfold_added_bias(old_shift, [(w_red_f, b_red_f, layout)],
                                                         [(w_sib_f, b_sib_f, layout)])
    assert move.relative_residual < 1e-10
    x = torch.randn(3, d, generator=g, dtype=torch.float64)

    def lin(x, w, b):
        y = x @ (w.T if layout == "out_in" else w)
        return y if b is None else y + b

    torch.testing.assert_close(lin(x + shift, w_red_f, None), lin(x, w_red_f, b_red_f))
    torch.testing.assert_close(lin(x + shift, w_sib_f, b_sib_new), lin(x, w_sib_f, b_sib_f))
    assert unfold_added_bias(old_shift, [(w_red_f, b_red_f, layout)], [(w_sib_f, None, layout)]).biases == [None]


def test_unfold_added_bias_reports_an_inexpressible_bias():
    """A widening bias-less Linear whose bias was trained freely: no shift reproduces it."""
    g = _gen(8)
    w = torch.randn(10, 4, generator=g, dtype=torch.float64)
    b = torch.randn(10, generator=g, dtype=torch.float64)
    move = unfold_added_bias(torch.zeros(4, dtype=torch.float64), [(w, b, "out_in")], [])
    assert move.relative_residual > 0.1 and torch.equal(move.added, b)
    torch.testing.assert_close(move.residual, w @ (move.shift) - b)
    assert relative_residual(torch.zeros(3), torch.zeros(3)) == 0.0


def test_w_and_one_plus_w_parameterisations_agree():
    """The same scale stored as w = γ and as w = γ − 1 (Gemma) folds to the same weights; identities scale by 1."""
    g = _gen(9)
    gamma = torch.rand(8, generator=g) + 0.5
    w_lin, b_lin, beta = torch.randn(3, 8, generator=g), torch.randn(3, generator=g), torch.randn(8, generator=g)
    for param in ("w", _Param.W):
        torch.testing.assert_close(effective_scale(gamma, param), gamma, rtol=0, atol=0)
    for param in ("1+w", _Param.ONE_PLUS_W):
        torch.testing.assert_close(effective_scale(gamma - 1, param), gamma, rtol=0, atol=1e-7)
    a = fold_affine(w_lin, b_lin, effective_scale(gamma, "w"), beta)
    b = fold_affine(w_lin, b_lin, effective_scale(gamma - 1, _Param.ONE_PLUS_W), beta)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for param in ("w", "1+w", _Param.W, _Param.ONE_PLUS_W):
        ident = torch.full((8,), identity_weight_value(param))
        assert torch.equal(effective_scale(ident, param), torch.ones(8))
        assert torch.equal(norm_scale(ident, param), torch.ones(8))
    with pytest.raises(ValueError, match="parameterisation"):
        identity_weight_value("w+1")


def test_norm_scale_is_differentiable_in_the_weights_dtype():
    w = (torch.randn(6) * 0.1).to(torch.bfloat16).requires_grad_()
    s = norm_scale(w, "1+w")
    assert s.dtype == torch.bfloat16 and s.requires_grad
    s.sum().backward()
    assert torch.equal(w.grad, torch.ones(6, dtype=torch.bfloat16))
    assert norm_scale(w, "w") is w
    assert effective_scale(w, "1+w").dtype == torch.float32 and not effective_scale(w, "1+w").requires_grad
    assert accumulation_dtype(torch.bfloat16) == torch.float32 and accumulation_dtype(torch.float64) == torch.float64


def test_shift_behind_scale_is_the_live_shift_through_scale():
    g = _gen(10)
    gamma = (torch.rand(7, generator=g) + 0.5).requires_grad_()
    beta = torch.randn(7, generator=g).requires_grad_()
    live = shift_behind_scale(beta, gamma)
    torch.testing.assert_close(live.detach(), shift_through_scale(beta, gamma))
    live.sum().backward()
    torch.testing.assert_close(beta.grad, 1 / gamma.detach())
    zero = shift_behind_scale(torch.zeros(2), torch.zeros(2))  # γ = 0 channels: no division by zero
    assert torch.equal(zero, torch.zeros(2))


# -- functional consumers: rows of a weight, assembled bias parts, convolutions -------------------------------
def test_fold_weight_rows_folds_only_those_rows_and_unfolds_back():
    from lmbp_convert.fold import fold_weight_rows, rows_shift, unfold_weight_rows

    gen = torch.Generator().manual_seed(0)
    w, g, b = torch.randn(12, 4, generator=gen), torch.rand(4, generator=gen) + 0.5, torch.randn(4, generator=gen)
    x = torch.randn(5, 4, generator=gen)
    f = fold_weight_rows(w, g, (4, 8))
    assert torch.equal(f[:4], w[:4]) and torch.equal(f[8:], w[8:])
    torch.testing.assert_close(x @ f[4:8].t() + rows_shift(w, b, (4, 8)), (g * x + b) @ w[4:8].t())
    torch.testing.assert_close(unfold_weight_rows(f, g, (4, 8)).float(), w)


def test_add_shift_rounds_once_to_the_part_dtype():
    from lmbp_convert.fold import add_shift

    part = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    shift = torch.tensor([1e-3, 1e-3], dtype=torch.float32)
    assert add_shift(part, shift).dtype == torch.bfloat16
    assert torch.equal(add_shift(part, shift), (part.float() + shift).to(torch.bfloat16))


@pytest.mark.parametrize("stride", [1, 2])
def test_fold_conv_input_is_exact_without_padding(stride):
    from lmbp_convert.fold import fold_conv_input, unfold_conv_input

    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(6, 4, 2, 2, generator=gen, dtype=torch.float64), torch.randn(6, generator=gen, dtype=torch.float64)
    g, beta = torch.rand(4, generator=gen, dtype=torch.float64) + 0.5, torch.randn(4, generator=gen, dtype=torch.float64)
    xh = torch.randn(2, 4, 6, 6, generator=gen, dtype=torch.float64)
    wf, bf = fold_conv_input(w, b, g, beta)
    want = F.conv2d(xh * g[:, None, None] + beta[:, None, None], w, b, stride=stride)
    torch.testing.assert_close(F.conv2d(xh, wf, bf, stride=stride), want)
    torch.testing.assert_close(unfold_conv_input(wf, g), w)
    with pytest.raises(ValueError, match="channels"):
        fold_conv_input(w, b, g[:3], beta)


# -- stacked weights: MoE experts held as one [E, out, in] / [E, in, out] parameter --------------------------------
def test_stacked_expert_weights_fold_expert_by_expert_bit_for_bit():
    from lmbp_convert.fold import Scratch, fold_affine, fold_rows, fold_scale, unfold_scale

    gen = torch.Generator().manual_seed(0)
    gamma = torch.rand(6, generator=gen) + 0.5
    w = torch.randn(3, 5, 6, generator=gen).bfloat16()  # [experts, out, in]
    folded = fold_scale(w, gamma, "out_in")
    assert all(torch.equal(folded[e], fold_scale(w[e], gamma, "out_in")) for e in range(3))
    wt = w.transpose(1, 2).contiguous()  # [experts, in, out]
    assert torch.equal(fold_scale(wt, gamma, "in_out"), folded.transpose(1, 2))
    beta = torch.randn(6, generator=gen)
    _, b = fold_affine(w.float(), torch.zeros(3, 5), gamma, beta, "out_in")
    assert torch.allclose(b, torch.stack([w[e].float() @ beta for e in range(3)]), atol=1e-5)
    back = unfold_scale(folded, gamma, "out_in")
    assert torch.allclose(back, w.double(), rtol=1e-2)
    for layout, x in (("out_in", w), ("in_out", wt)):  # the on-disk fold, a block of experts at a time
        blocks = [fold_rows(x[e0:e0 + 2], gamma, layout, e0, Scratch()).clone() for e0 in (0, 2)]
        assert torch.equal(torch.cat(blocks), fold_scale(x, gamma, layout))
    with pytest.raises(ValueError, match="takes 5 inputs"):
        fold_scale(w, torch.ones(6), "in_out")
