"""The memory-sharing norm that keeps its affine: values and gradients (x, γ, β) against torch's norms per dtype,
the Triton kernels (interpreter) against the PyTorch path, the small-γ guard, and exact saved bytes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import tol

from lmbp_convert.fold import BETA_RATIO, GAMMA_FLOOR, unreliable_channels
from lmbp_convert.memory import SavedTensorLedger
from lmbp_convert.ops import ms_norm_affine as M
from lmbp_convert.ops._common import HAS_TRITON
from lmbp_convert.ops.ms_norm_affine import ms_norm_affine

KINDS = ("layer", "rms")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def realistic(n, gen, bias=True):
    """γ around 1 with spread and a few negative channels, β of a few tenths: a fine-tuned norm."""
    w = 1 + 0.3 * torch.randn(n, generator=gen)
    w[: max(1, n // 16)] *= -1
    b = 0.3 * torch.randn(n, generator=gen) if bias else None
    return w, b


def hostile(n, gen):
    """γ with exact zeros, near-zeros (both signs) and channels where β ≫ γ."""
    w, b = realistic(n, gen)
    w[1], w[2], w[3], w[4] = 0.0, 1e-6, -3e-4, 2e-3
    b[5], w[5] = 4.0, 0.05
    return w, b


def reference(kind, x, w, b, one_plus, eps):
    """torch's own norm (fp64) on the same inputs: y and the grads of x, w, b for upstream grad g."""
    gamma = w + 1 if one_plus else w
    if kind == "layer":
        return F.layer_norm(x, (x.shape[-1],), gamma, b, eps)
    y = F.rms_norm(x, (x.shape[-1],), gamma, eps)
    return y + b if b is not None else y


def grads(fn, x, w, b, g):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    b = b.detach().requires_grad_() if b is not None else None
    y = fn(x, w, b)
    got = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], g)
    return (y.detach(), *got)


def check_against_torch(kind, dtype, w, b, one_plus=False, keep_idx=None, shape=(3, 7, 48)):
    gen = torch.Generator().manual_seed(1)
    n = shape[-1]
    x = (torch.randn(shape, generator=gen) * 2 + 0.4).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    wd, bd = w.to(dtype), (b.to(dtype) if b is not None else None)
    mine = grads(lambda x_, w_, b_: ms_norm_affine(x_, w_, b_, n, 1e-5, kind == "rms", one_plus, keep_idx),
                 x, wd, bd, g)
    ref = grads(lambda x_, w_, b_: reference(kind, x_, w_, b_, one_plus, 1e-5), x.double(), wd.double(),
                bd.double() if bd is not None else None, g.double())
    assert mine[0].dtype == dtype
    torch.testing.assert_close(mine[0], ref[0].to(dtype), **tol(dtype))
    for got, want in zip(mine[1:], ref[1:]):
        # dγ, dβ sum over rows: scale the budget by the gradient's size, as torch's own low-precision norms need
        scale = float(want.abs().max()) or 1.0
        t = tol(dtype, "bwd")
        torch.testing.assert_close(got.double() / scale, want / scale, atol=t["atol"], rtol=t["rtol"])
    return mine


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_grads_match_torch_on_realistic_gamma(kind, dtype, bias):
    w, b = realistic(48, torch.Generator().manual_seed(0), bias)
    check_against_torch(kind, dtype, w, b)


@pytest.mark.parametrize("kind", KINDS)
def test_one_plus_w_parameterisation(kind):
    w, b = realistic(48, torch.Generator().manual_seed(0))
    check_against_torch(kind, torch.float32, w - 1, b, one_plus=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_guard_keeps_the_channels_gamma_cannot_invert(kind, dtype):
    w, b = hostile(48, torch.Generator().manual_seed(0))
    bad = unreliable_channels(w.to(dtype), b.to(dtype), False)
    assert bad[1:6].all() and int(bad.sum()) == 5  # zeros, near-zeros and β ≫ γ; nothing else
    check_against_torch(kind, dtype, w, b)  # keep_idx=None: the op finds them itself


def test_without_the_guard_a_zero_gamma_channel_is_lost():
    """What the guard is for: γ = 0 makes y independent of x̂ on that channel, so it cannot be recovered from y. The
    op then takes x̂ = 0 there (finite: a guard one update late must not put inf/NaN into a training step), and the
    gradients are wrong; the guarded op's are right."""
    w, b = hostile(48, torch.Generator().manual_seed(0))
    x = torch.randn(4, 48, requires_grad=True)
    w.requires_grad_()
    g = torch.randn(4, 48, generator=torch.Generator().manual_seed(1))
    none = torch.empty(0, dtype=torch.long)
    lost = torch.autograd.grad(ms_norm_affine(x, w, b, 48, 1e-5, False, keep_idx=none), (x, w), g)
    guarded = torch.autograd.grad(ms_norm_affine(x, w, b, 48, 1e-5, False), (x, w), g)
    want = torch.autograd.grad(F.layer_norm(x, (48,), w, b, 1e-5), (x, w), g)
    assert all(torch.isfinite(t).all() for t in lost)
    assert float(lost[1][1]) == 0.0 and abs(float(want[1][1])) > 0.1  # dγ of the γ = 0 channel: Σ g·x̂ with x̂ lost
    assert not torch.allclose(lost[0], want[0], rtol=1e-3, atol=1e-3)
    for a, b_ in zip(guarded, want):
        torch.testing.assert_close(a, b_, rtol=1e-4, atol=1e-5)


def test_criterion_constants_match_the_documented_bound():
    w = torch.tensor([GAMMA_FLOOR * 0.99, GAMMA_FLOOR * 1.01, -1.0, 1.0, 0.5])
    b = torch.tensor([0.0, 0.0, BETA_RATIO * 1.01, BETA_RATIO, -BETA_RATIO * 0.5])
    assert unreliable_channels(w, b, False).tolist() == [True, False, True, False, False]
    assert unreliable_channels(w - 1, b, True).tolist() == [True, False, True, False, False]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_error_within_bound_on_hostile_and_realistic_gamma(kind, dtype):
    """The documented bound, on the recovered x̂ itself: |δx̂| ≤ u·(|x̂| + R) + fp32 slack on the channels that
    are inverted; 0 on the kept ones (rebuilt from the input)."""
    gen = torch.Generator().manual_seed(3)
    w, b = hostile(64, gen)
    x = torch.randn(16, 64, generator=gen).to(dtype)
    idx = torch.nonzero(unreliable_channels(w, b, False)).reshape(-1)
    y, rstd, mean = M._fwd_torch(x, w, b, 64, 1e-5, kind == "rms", False, dtype)
    xf = x.double()
    xc = xf if kind == "rms" else xf - xf.mean(-1, keepdim=True)
    xh = xc * torch.rsqrt((xc * xc).mean(-1, keepdim=True) + 1e-5)
    rec = (y.double() - b.double()) / w.double()
    u = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -8
    good = torch.ones(64, dtype=torch.bool)
    good[idx] = False
    err = (rec - xh).abs()[:, good]
    assert (err <= u * (xh.abs()[:, good] + BETA_RATIO) + 1e-6).all()


# ------------------------------------------------------------------------------------------ Triton vs PyTorch
@needs_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["realistic", "hostile", "no_bias"])
def test_triton_kernels_match_pytorch_path(monkeypatch, kind, dtype, case):
    gen = torch.Generator().manual_seed(2)
    w, b = hostile(40, gen) if case == "hostile" else realistic(40, gen, case != "no_bias")
    x = torch.randn(2, 37, 40, generator=gen).to(dtype)  # 74 rows: three backward programs, the last one partial
    g = torch.randn(2, 37, 40, generator=gen).to(dtype)
    idx = torch.nonzero(unreliable_channels(w, b, False)).reshape(-1)

    def run():
        return grads(lambda x_, w_, b_: ms_norm_affine(x_, w_, b_, 40, 1e-5, kind == "rms", False, idx), x, w, b, g)

    torch_out = run()
    monkeypatch.setattr(M, "use_triton", lambda t: True)
    triton_out = run()
    torch.testing.assert_close(triton_out[0], torch_out[0], **tol(dtype))
    for a, r in zip(triton_out[1:], torch_out[1:]):  # sums over rows: the budget of the inputs' dtype, by size
        scale = float(r.abs().max())
        torch.testing.assert_close(a.double() / scale, r.double() / scale, **tol(dtype, "bwd"))


# ------------------------------------------------------------------------------------------ saved bytes
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saves_only_its_output_and_rstd(kind, dtype):
    w, b = realistic(48, torch.Generator().manual_seed(0))
    w, b = torch.nn.Parameter(w.to(dtype)), torch.nn.Parameter(b.to(dtype))
    x = torch.randn(6, 48, dtype=dtype, requires_grad=True)
    with SavedTensorLedger([w, b]) as led:
        y = ms_norm_affine(x, w, b, 48, 1e-5, kind == "rms", keep_idx=torch.empty(0, dtype=torch.long))
    assert led.bytes == y.numel() * y.element_size() + 6 * 4, led.summary()
    assert any(e.nbytes == y.numel() * y.element_size() for e in led.entries)


def test_kept_channels_cost_their_columns_and_the_mean():
    w, b = hostile(48, torch.Generator().manual_seed(0))
    w, b = torch.nn.Parameter(w), torch.nn.Parameter(b)
    idx = torch.nonzero(unreliable_channels(w, b, False)).reshape(-1)
    x = torch.randn(6, 48, requires_grad=True)
    with SavedTensorLedger([w, b]) as led:
        y = ms_norm_affine(x, w, b, 48, 1e-5, False, keep_idx=idx)
    k = idx.numel()
    assert led.bytes == y.numel() * 4 + 6 * 4 + (6 * k * 4 + 6 * 4 + k * 8), led.summary()


def test_autocast_emits_the_compute_dtype():
    w, b = realistic(48, torch.Generator().manual_seed(0))
    x = torch.randn(6, 48, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ms_norm_affine(x, w, b, 48, 1e-5, False)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()


def test_shape_checks():
    w = torch.ones(8)
    with pytest.raises(ValueError, match="shape"):
        ms_norm_affine(torch.randn(2, 9), w, None, 8, 1e-5, False)
    with pytest.raises(ValueError, match="shape"):
        ms_norm_affine(torch.randn(2, 8), w, torch.zeros(9), 8, 1e-5, False)


# ------------------------------------------------------------------------------------------ CUDA (skipped on CPU)
cuda = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and Triton")


@cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [768, 4096, 20000])  # 20000: longer than MAX_BLOCK, the PyTorch path on CUDA
def test_cuda_kernels_match_the_pytorch_path(kind, dtype, n):
    gen = torch.Generator().manual_seed(0)
    w, b = hostile(n, gen)
    x = torch.randn(3, 129, n, generator=gen).to(dtype)
    g = torch.randn(3, 129, n, generator=gen).to(dtype)
    idx = torch.nonzero(unreliable_channels(w, b, False)).reshape(-1)

    def run(dev):
        f = lambda x_, w_, b_: ms_norm_affine(x_, w_, b_, n, 1e-5, kind == "rms", False, idx.to(dev))  # noqa: E731
        return [t.cpu() for t in grads(f, x.to(dev), w.to(dev), b.to(dev), g.to(dev))]

    ref, got = run("cpu"), run("cuda")
    torch.testing.assert_close(got[0], ref[0], **tol(dtype))
    for a, r in zip(got[1:], ref[1:]):
        scale = float(r.abs().max())
        torch.testing.assert_close(a.double() / scale, r.double() / scale, **tol(dtype, "bwd"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("explicit", [False, True], ids=["keep_idx_none", "keep_idx_given"])
def test_compiles_with_fullgraph(kind, explicit):
    """torch.compile(fullgraph=True): given indices trace as they are; ``keep_idx=None`` (a channel search of
    data-dependent size) becomes torch's own norm. Values and gradients match eager either way."""
    gen = torch.Generator().manual_seed(4)
    w, b = hostile(48, gen)
    x, g = torch.randn(3, 5, 48, generator=gen), torch.randn(3, 5, 48, generator=gen)
    idx = torch.nonzero(unreliable_channels(w, b, False)).reshape(-1) if explicit else None

    def fn(x_, w_, b_):
        return ms_norm_affine(x_, w_, b_, 48, 1e-5, kind == "rms", False, idx)

    torch._dynamo.reset()
    eager = grads(fn, x, w, b, g)
    compiled = grads(torch.compile(fn, backend="aot_eager", fullgraph=True), x, w, b, g)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
