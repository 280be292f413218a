"""relu_squared: relu(x)² whose backward keeps only its output (2·√y). The forward is the unfused ops' bit for
bit; the gradient too in fp32, fp64 and bf16, and in fp16 except where relu(x)² is below fp16's normal range.
The Triton kernels run on CPU tensors under TRITON_INTERPRET=1 against the PyTorch path."""
from __future__ import annotations

import pytest
import torch

from lmbp_convert.memory import SavedTensorLedger
from lmbp_convert.ops import relu_squared as M
from lmbp_convert.ops._common import HAS_TRITON
from lmbp_convert.ops.relu_squared import relu_squared

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SPECIALS = (float("nan"), float("inf"), float("-inf"), 0.0, -0.0)


def _unfused(x):
    return torch.square(torch.relu(x))  # transformers' ReLUSquaredActivation


def _x(dtype, n=4096, scale=3.0):
    x = (torch.randn(8, n // 8, generator=torch.Generator().manual_seed(0)) * scale).to(dtype)
    x.view(-1)[:len(SPECIALS)] = torch.tensor(SPECIALS, dtype=dtype)
    return x


def _grads(fn, x, g):
    x = x.clone().requires_grad_()
    fn(x).backward(g)
    return x.grad


def _same(a, b):
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.nan_to_num(a, 0.0),
                                                                        torch.nan_to_num(b, 0.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_is_the_unfused_ops_bit_for_bit(dtype):
    x = _x(dtype)
    assert _same(relu_squared(x), _unfused(x))
    assert _same(relu_squared(x.clone().requires_grad_()).detach(), _unfused(x))


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16), ids=str)
def test_gradient_is_the_unfused_one_bit_for_bit(dtype):
    """fp32 / fp64: sqrt(fl(r·r)) = r for binary floating point. bf16: r is a bf16 number and √y rounded to bf16
    recovers it (y's rounding moves √y by at most 2^-9 relative, under half a bf16 ulp but at ties)."""
    x = _x(dtype)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert _same(_grads(relu_squared, x, g), _grads(_unfused, x, g))


def test_fp16_gradient_is_exact_where_relu_squared_is_a_normal_number():
    """In fp16 r² under 2^-14 (r < 2^-7) loses bits (subnormal) or is 0: √y cannot give r back there."""
    x = _x(torch.float16)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    ours, ref = _grads(relu_squared, x, g), _grads(_unfused, x, g)
    normal = ~(torch.isfinite(x) & (x > 0) & (x < 2 ** -7))
    assert _same(ours[normal], ref[normal])
    off = (ours != ref) & ~normal
    assert 0 < int(off.sum()) <= int((~normal).sum())  # the few elements near 0 (measured: 0.1 % of N(0, 3²))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_inputs_get_zero_and_specials_behave_as_unfused(dtype):
    x = torch.tensor([-3.0, -0.0, 0.0, 2.0, float("nan"), float("inf"), float("-inf")], dtype=dtype)
    g = torch.ones_like(x)
    ours, ref = _grads(relu_squared, x, g), _grads(_unfused, x, g)
    assert _same(ours, ref) and ours[:3].eq(0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_saves_exactly_its_output_and_nothing_else(dtype):
    """One saved tensor: the output's storage. A Linear after it keeps that storage too: 0 extra bytes."""
    x = _x(dtype, n=64).requires_grad_()
    lin = torch.nn.Linear(8, 4).to(dtype)
    with SavedTensorLedger(lin) as alone:
        y = relu_squared(x)
    assert alone.bytes == y.numel() * y.element_size() and len(alone.entries) == 1
    with SavedTensorLedger(lin) as both:
        lin(relu_squared(x))
    assert both.bytes == alone.bytes
    with SavedTensorLedger(lin) as unfused:
        lin(_unfused(x))
    assert unfused.bytes == 2 * alone.bytes  # relu(x) and the output


def test_double_backward_matches_the_unfused_ops():
    x = torch.tensor([-1.5, 0.0, 0.5, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    for fn in (relu_squared, _unfused):
        (gx,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
        (ggx,) = torch.autograd.grad(gx.sum(), x)
        if fn is relu_squared:
            ours = (gx.detach(), ggx)
        else:
            assert torch.equal(ours[0], gx.detach()) and torch.equal(ours[1], ggx), (ours, gx, ggx)
    assert torch.isfinite(ours[1]).all()


def test_torch_func_grad_and_vmap():
    x = torch.randn(3, 5, dtype=torch.float64)
    want = torch.func.vmap(torch.func.grad(lambda r: _unfused(r).sum()))(x)
    assert torch.equal(torch.func.vmap(torch.func.grad(lambda r: relu_squared(r).sum()))(x), want)


def test_no_grad_and_bad_arguments():
    x = torch.randn(4, 4)
    assert relu_squared(x).grad_fn is None
    with pytest.raises(ValueError, match="backend"):
        relu_squared(x, backend="cuda")
    with pytest.raises(TypeError, match="unsupported dtype"):
        relu_squared(torch.ones(3, dtype=torch.int64))


def _ulps(a, b):
    """Distance in units of the last place of a's dtype (finite values)."""
    a32, b32 = a.float(), b.float()
    spacing = torch.finfo(a.dtype).eps * torch.maximum(a32.abs(), b32.abs()).clamp_min(torch.finfo(a.dtype).tiny)
    return ((a32 - b32).abs() / spacing).max().item()


@needs_triton
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
def test_triton_kernels_match_the_torch_path(dtype):
    """fp32: bit for bit. bf16 / fp16: the interpreter's fp32 → 16-bit cast truncates where GPUs round to nearest
    even, so forward and gradient may be a unit or two in the last place off here (tests/ops/test_cuda.py-style
    runs on a GPU compare bit for bit)."""
    x = _x(dtype)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    y_t, y_p = relu_squared(x, backend="triton"), relu_squared(x, backend="torch")
    gt = _grads(lambda r: relu_squared(r, backend="triton"), x, g)
    gp = _grads(lambda r: relu_squared(r, backend="torch"), x, g)
    assert torch.equal(torch.isnan(y_t), torch.isnan(y_p)) and torch.equal(torch.isnan(gt), torch.isnan(gp))
    fin = torch.isfinite(y_p) & torch.isfinite(gp)
    if dtype == torch.float32:
        assert torch.equal(y_t[fin], y_p[fin]) and torch.equal(gt[fin], gp[fin])
    else:
        assert _ulps(y_t[fin], y_p[fin]) <= 1 and _ulps(gt[fin], gp[fin]) <= 2


@needs_triton
def test_triton_path_reads_non_contiguous_inputs():
    x = _x(torch.float32).t()
    g = torch.randn(x.shape[1], x.shape[0]).t()
    assert _same(relu_squared(x, backend="triton"), _unfused(x))
    gt = _grads(lambda r: relu_squared(r, backend="triton"), x, g)
    assert _same(gt, _grads(_unfused, x, g))


def test_module_doc_states_the_dtypes():
    assert "bf16" in M.__doc__ and "fp16" in M.__doc__


def test_compiles_in_one_graph():
    x = torch.randn(4, 64, requires_grad=True)
    f = torch.compile(lambda t: relu_squared(t).sum(), backend="aot_eager", fullgraph=True)
    f(x).backward()
    assert torch.equal(x.grad, _grads(_unfused, x.detach(), torch.ones(4, 64)))
