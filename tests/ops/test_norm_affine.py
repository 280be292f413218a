"""x̂·γ + β: the forward value and the gradients of x̂, w and β, against plain autograd."""
import pytest
import torch

from lmbp_convert.ops.norm_affine import affine_forward, norm_affine


def _ref(xhat, w, b, one_plus, out):
    gamma = w.float() + 1 if one_plus else w.float()
    y = xhat.float() * gamma + (b.float() if b is not None else 0)
    return y.to(out)


@pytest.mark.parametrize("one_plus", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_gradcheck_fp64(one_plus, bias):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(8, dtype=torch.float64, requires_grad=True) if bias else None
    fn = (lambda x, w, b: norm_affine(x, w, b, one_plus, torch.float64)) if bias else \
        (lambda x, w: norm_affine(x, w, None, one_plus, torch.float64))
    assert torch.autograd.gradcheck(fn, (x, w, b) if bias else (x, w))


@pytest.mark.parametrize("dtype,out", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                       (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_autograd_per_dtype(dtype, out, bias):
    torch.manual_seed(1)
    x = torch.randn(4, 7, 32).to(dtype).requires_grad_()
    w = (torch.rand(32) + 0.5).to(dtype).requires_grad_()
    b = torch.randn(32).to(dtype).requires_grad_() if bias else None
    g = torch.randn(4, 7, 32).to(out)
    y = norm_affine(x, w, b, False, out)
    ref = _ref(x, w, b, False, out)
    assert y.dtype == out and torch.equal(y, ref)
    assert torch.equal(affine_forward(x.detach(), w.detach(), None if b is None else b.detach(), False, out), y)
    inputs = [x, w] + ([b] if bias else [])
    got = torch.autograd.grad(y, inputs, g)
    want = torch.autograd.grad(ref, inputs, g)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for a, e in zip(got, want):
        assert a.dtype == e.dtype
        assert ((a.float() - e.float()).norm() / e.float().norm()) < tol


def test_same_dtype_product_is_the_plain_multiply():
    x = torch.randn(64, 128).bfloat16()
    w = torch.randn(128).bfloat16()
    assert torch.equal(affine_forward(x, w, None, False, torch.bfloat16), w * x)


@pytest.mark.parametrize("dtype,out", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                       (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
@pytest.mark.parametrize("bias,one_plus", [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("cast", (torch.bfloat16, torch.float16, torch.float32))
def test_cast_in_the_same_pass_is_bitwise_the_cast_value(dtype, out, bias, one_plus, cast):
    """A shared-saves rebuild of a consumer's cast copy (``fuses_cast``) equals the value cast afterwards."""
    torch.manual_seed(3)
    x = torch.randn(5, 64).to(dtype)
    w, b = (torch.rand(64) + 0.5).to(dtype), torch.randn(64).to(dtype) if bias else None
    want = affine_forward(x, w, b, one_plus, out).to(cast)
    got = affine_forward(x, w, b, one_plus, out, cast_to=cast)
    assert got.dtype == cast and torch.equal(got, want)
    assert torch.equal(affine_forward(x, w, b, one_plus, out), _ref(x, w, b, one_plus, out))
