"""Memory-sharing norms: values and grads against torch's norms, Triton launchers (interpreter) against the
PyTorch path, exact saved-byte accounting (the point of the op), edge cases and torch.compile."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from tolerances import tol

from lmbp_convert.memory import SavedTensorLedger
from lmbp_convert.ops._common import HAS_TRITON
from lmbp_convert.ops import ms_norm as M
from lmbp_convert.ops.ms_norm import ms_layer_norm, ms_rms_norm

KINDS = ("layer", "rms")
LOW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ALL_DTYPES = LOW_DTYPES + (torch.float64,)


def ms(kind, x, shape, eps=None):
    fn = ms_layer_norm if kind == "layer" else ms_rms_norm
    return fn(x, shape) if eps is None else fn(x, shape, eps=eps)


def ref(kind, x, shape, eps):
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if kind == "layer":
        return F.layer_norm(x, shape, eps=eps)
    return F.rms_norm(x, shape, eps=eps)


def default_eps(kind):
    return 1e-5 if kind == "layer" else 1e-6


needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def force_triton(monkeypatch):
    """Route CPU tensors through the Triton launchers (they run in the interpreter; see conftest)."""
    monkeypatch.setattr(M, "use_triton", lambda x: x.dtype in (torch.float32, torch.float16, torch.bfloat16))


# --------------------------------------------------------------------------------------------------- values
# (input shape, normalized_shape): a non-power-of-2 row, several leading dims, multi-dim normalized shapes.
SHAPES = [((4, 33), 33), ((2, 3, 16), (16,)), ((3, 5, 6, 7), (6, 7)), ((2, 3, 4, 5), (3, 4, 5))]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape,nshape", SHAPES)
def test_forward_matches_torch(kind, dtype, shape, nshape):
    x = (torch.randn(shape) * 3 + 0.5).to(dtype)
    y = ms(kind, x, nshape)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y, ref(kind, x, nshape, default_eps(kind)), **tol(dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_eps_is_used(kind):
    x = torch.randn(3, 8) * 1e-2  # variance ~1e-4: eps = 1e-2 changes the output a lot
    torch.testing.assert_close(ms(kind, x, 8, eps=1e-2), ref(kind, x, 8, 1e-2), **tol(torch.float32))
    assert not torch.allclose(ms(kind, x, 8, eps=1e-2), ms(kind, x, 8))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape,nshape", SHAPES[:3])
def test_backward_matches_autograd(kind, dtype, shape, nshape):
    x = (torch.randn(shape) * 2 - 0.3).to(dtype)
    g = torch.randn(shape).to(dtype)
    x1 = x.clone().requires_grad_()
    ms(kind, x1, nshape).backward(g)
    x2 = x.clone().requires_grad_()
    ref(kind, x2, nshape, default_eps(kind)).backward(g)
    assert x1.grad.dtype == dtype
    torch.testing.assert_close(x1.grad, x2.grad, **tol(dtype, "bwd"))


@pytest.mark.parametrize("kind", KINDS)
def test_non_contiguous_input(kind):
    base = torch.randn(6, 10, 12)
    x = base.transpose(0, 2)[:, ::2]  # (12, 5, 6), nothing contiguous
    assert not x.is_contiguous()
    x1 = x.detach().clone().requires_grad_()  # same values, contiguous
    xs = x.detach().requires_grad_()
    g = torch.randn(12, 5, 6)
    ms(kind, xs, 6).backward(g)
    ref(kind, x1, 6, default_eps(kind)).backward(g)
    torch.testing.assert_close(ms(kind, x, 6), ref(kind, x, 6, default_eps(kind)), **tol(torch.float32))
    torch.testing.assert_close(xs.grad, x1.grad, **tol(torch.float32, "bwd"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("nshape,shape", [((7,), (3, 7)), ((3, 4), (2, 3, 4))])
def test_gradcheck_float64(kind, nshape, shape):
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: ms(kind, t, nshape, eps=1e-3), (x,))
    xt = torch.randn(shape[::-1], dtype=torch.float64).transpose(0, -1).requires_grad_()  # non-contiguous
    assert torch.autograd.gradcheck(lambda t: ms(kind, t, shape[-1], eps=1e-3), (xt,))


@pytest.mark.parametrize("kind", KINDS)
def test_double_backward_is_torchs(kind):
    """create_graph=True: the backward's torch ops differentiate through ŷ and rstd (tests/ops/test_double_backward.py
    has gradgradcheck)."""
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(ms(kind, x, 8).pow(2).sum(), x, create_graph=True)
    (ggx,) = torch.autograd.grad(gx.pow(3).sum(), x)
    xr = x.detach().clone().requires_grad_()
    (gr,) = torch.autograd.grad(ref(kind, xr, 8, default_eps(kind)).pow(2).sum(), xr, create_graph=True)
    torch.testing.assert_close(ggx, torch.autograd.grad(gr.pow(3).sum(), xr)[0])


# --------------------------------------------------------------------------------------- output dtype policy
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("amp", (torch.bfloat16, torch.float16))
def test_autocast_emits_compute_dtype(kind, amp):
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=amp):
        y = ms(kind, x, 16)
        y64 = ms(kind, x.detach().double(), 16)
    assert y.dtype == amp
    assert y64.dtype == torch.float64  # fp64 is never autocast
    torch.testing.assert_close(y, ref(kind, x.detach(), 16, default_eps(kind)).to(amp), **tol(amp))
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32
    xr = x.detach().clone().requires_grad_()
    ref(kind, xr, 16, default_eps(kind)).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, **tol(amp, "bwd"))


# ----------------------------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape,nshape", [((0, 8), 8), ((2, 0, 5), (5,)), ((3, 0), 0), ((4, 2, 0), (2, 0))])
def test_empty(kind, shape, nshape):
    x = torch.randn(shape, requires_grad=True)
    y = ms(kind, x, nshape)
    assert y.shape == x.shape and y.dtype == x.dtype
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, in the interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("triton_path", (False, pytest.param(True, marks=needs_triton)))
def test_nan_inf_propagate_like_torch(kind, triton_path, monkeypatch):
    if triton_path:
        force_triton(monkeypatch)
    x = torch.randn(4, 9)
    x[0, 1] = float("inf")
    x[1, 2] = float("nan")
    x[2, 3] = float("-inf")
    expect = ref(kind, x, 9, default_eps(kind))
    got = ms(kind, x, 9)
    assert torch.equal(torch.isnan(got), torch.isnan(expect))
    assert torch.equal(torch.isinf(got), torch.isinf(expect))
    torch.testing.assert_close(got, expect, equal_nan=True, **tol(torch.float32))
    assert torch.isfinite(got[3]).all()  # other rows are untouched


@pytest.mark.parametrize("dtype", (torch.int64, torch.int32, torch.bool, torch.complex64))
def test_bad_dtype(dtype):
    x = torch.ones(2, 4, dtype=dtype)
    name = str(dtype).replace("torch.", "")
    with pytest.raises(TypeError, match=name):
        ms_layer_norm(x, 4)
    with pytest.raises(TypeError, match=name):
        ms_rms_norm(x, 4)


@pytest.mark.parametrize("nshape", (5, (4, 4), (2, 3, 4, 4), (), (-4,), "x"))
def test_bad_normalized_shape(nshape):
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="normalized_shape"):
        ms_layer_norm(x, nshape)
    with pytest.raises(ValueError, match="normalized_shape"):
        ms_rms_norm(x, nshape)


def test_int_and_tuple_shape_agree():
    x = torch.randn(3, 10)
    assert torch.equal(ms_layer_norm(x, 10), ms_layer_norm(x, (10,)))
    assert torch.equal(ms_rms_norm(x, 10), ms_rms_norm(x, [10]))


# ------------------------------------------------------------------------------ Triton launchers (interpreter)
@needs_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("chunk", (None, 16))  # None: single-block kernel; 16: looped kernel, 3 chunks per row
def test_triton_launchers_match_torch_path(kind, dtype, chunk):
    is_rms = kind == "rms"
    x = (torch.randn(3, 37, 4) * 2 + 1).to(dtype).transpose(1, 2)  # 12 rows of 37, non-contiguous
    for out_dtype in (dtype, torch.bfloat16):  # also the autocast case: fp32 in, bf16 out
        y_t, r_t = M._fwd_triton(x, 37, 1e-5, is_rms, out_dtype, chunk=chunk)
        y_p, r_p = M._fwd_torch(x, 37, 1e-5, is_rms, out_dtype)
        assert y_t.dtype == out_dtype and y_t.shape == x.shape and r_t.dtype == torch.float32
        torch.testing.assert_close(y_t, y_p, **tol(out_dtype))
        torch.testing.assert_close(r_t, r_p, **tol(torch.float32))
        # backward from the same saved tensors; upstream grad non-contiguous too
        g = torch.randn(3, 4, 37).to(out_dtype).transpose(1, 2)
        d_t = M._bwd_triton(g, y_p, r_p, is_rms, dtype, chunk=chunk)
        d_p = M._bwd_torch(g, y_p, r_p, is_rms, dtype)
        assert d_t.dtype == dtype and d_t.shape == x.shape
        torch.testing.assert_close(d_t, d_p, **tol(dtype, "bwd"))


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
def test_triton_long_rows_use_looped_kernel(kind):
    is_rms = kind == "rms"
    for n in (M.MAX_FUSED_BLOCK, M.MAX_FUSED_BLOCK + 3):  # largest single-block row, then the looped kernel
        x = torch.randn(2, n) + 0.25
        y_t, r_t = M._fwd_triton(x, n, 1e-5, is_rms, x.dtype)
        y_p, r_p = M._fwd_torch(x, n, 1e-5, is_rms, x.dtype)
        torch.testing.assert_close(y_t, y_p, **tol(torch.float32))
        g = torch.randn(2, n)
        torch.testing.assert_close(M._bwd_triton(g, y_p, r_p, is_rms, x.dtype),
                                   M._bwd_torch(g, y_p, r_p, is_rms, x.dtype), **tol(torch.float32, "bwd"))


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_autograd_through_triton_path(kind, dtype, monkeypatch):
    x = (torch.randn(2, 3, 24) * 2).to(dtype)
    g = torch.randn(2, 3, 24).to(dtype)
    x_p = x.clone().requires_grad_()
    y_p = ms(kind, x_p, 24)
    y_p.backward(g)
    force_triton(monkeypatch)
    x_t = x.clone().requires_grad_()
    y_t = ms(kind, x_t, 24)
    y_t.backward(g)
    torch.testing.assert_close(y_t, y_p, **tol(dtype))
    torch.testing.assert_close(x_t.grad, x_p.grad, **tol(dtype, "bwd"))


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
def test_triton_path_empty_and_dtype_fallback(kind, monkeypatch):
    force_triton(monkeypatch)
    x = torch.randn(0, 5, requires_grad=True)
    ms(kind, x, 5).sum().backward()
    assert x.grad.shape == (0, 5)
    x64 = torch.randn(2, 5, dtype=torch.float64)  # fp64 stays on the PyTorch path
    torch.testing.assert_close(ms(kind, x64, 5), ref(kind, x64, 5, default_eps(kind)), **tol(torch.float64))


@needs_triton
def test_custom_ops_opcheck():
    x = torch.randn(3, 4, 10).transpose(0, 1)
    for is_rms in (False, True):
        torch.library.opcheck(torch.ops.lmbp_convert.ms_norm_fwd, (x, 10, 1e-5, is_rms, torch.bfloat16))
        y, rstd = M._fwd_torch(x, 10, 1e-5, is_rms, torch.float32)
        g = torch.randn_like(y)
        torch.library.opcheck(torch.ops.lmbp_convert.ms_norm_bwd, (g, y, rstd, is_rms, torch.float32))


# --------------------------------------------------------------------------------------- saved-byte accounting
def _ledger_norm_linear(kind, x, linear, amp=None):
    with SavedTensorLedger(linear) as ledger:
        if amp is None:
            y = ms(kind, x, x.shape[-1])
            out = linear(y)
        else:
            with torch.autocast("cpu", dtype=amp):
                y = ms(kind, x, x.shape[-1])
                out = linear(y)
    out.float().sum().backward()  # the graph is a real, complete training step
    return ledger, y


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_bytes_norm_then_linear_share_one_storage(kind, dtype):
    x = torch.randn(2, 5, 32, dtype=dtype, requires_grad=True)
    lin = nn.Linear(32, 16, dtype=dtype)
    ledger, y = _ledger_norm_linear(kind, x, lin)
    rows = 10
    expected = y.numel() * y.element_size() + rows * 4  # the shared output + fp32 rstd, nothing else
    assert ledger.bytes == expected, ledger.summary()
    assert ledger.count == 2, ledger.summary()
    assert x.grad is not None and lin.weight.grad is not None


@pytest.mark.parametrize("kind", KINDS)
def test_bytes_under_autocast_fp32_input(kind):
    x = torch.randn(2, 5, 32, requires_grad=True)
    lin = nn.Linear(32, 16)  # fp32 weights: autocast casts them; the ledger skips that weight copy
    ledger, y = _ledger_norm_linear(kind, x, lin, amp=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert ledger.bytes == y.numel() * 2 + 10 * 4, ledger.summary()
    assert ledger.skipped_weight_copies >= 1


@pytest.mark.parametrize("kind", KINDS)
def test_bytes_under_autocast_without_the_dtype_trick(kind, monkeypatch):
    """What the dtype trick buys: plain torch norms, or ours emitting fp32, make the Linear save a bf16 copy."""
    x = torch.randn(2, 5, 32, requires_grad=True)
    lin = nn.Linear(32, 16)
    ours, _ = _ledger_norm_linear(kind, x, lin, amp=torch.bfloat16)
    numel = x.numel()

    with SavedTensorLedger(lin) as plain:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lin(ref(kind, x, 32, default_eps(kind)))
    assert plain.bytes > ours.bytes, plain.summary()
    assert plain.bytes >= numel * 2 + numel * 4 - 1, plain.summary()  # its own activation + the Linear's copy

    monkeypatch.setattr(M, "autocast_dtype_for", lambda t: t.dtype)
    no_trick, y = _ledger_norm_linear(kind, x, lin, amp=torch.bfloat16)
    assert y.dtype == torch.float32
    assert no_trick.bytes == numel * 4 + 10 * 4 + numel * 2, no_trick.summary()


# ------------------------------------------------------------------------------------------------ compile
class _Block(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(24, 8)

    def forward(self, x):
        return self.lin(ms(self.kind, x, 24))


def _eager_and_compiled(kind, backend):
    torch.manual_seed(0)
    block = _Block(kind)
    x = torch.randn(3, 5, 24, requires_grad=True)
    block(x).square().sum().backward()
    eager = (block(x).detach(), x.grad.clone(), block.lin.weight.grad.clone())
    x.grad = None
    block.zero_grad()
    out = torch.compile(block, backend=backend, fullgraph=True)(x)
    out.square().sum().backward()
    return eager, (out.detach(), x.grad, block.lin.weight.grad)


def test_compile_cpu_matches_eager():
    torch._dynamo.reset()
    eager, comp = _eager_and_compiled("layer", "inductor")
    for a, b in zip(eager, comp):
        torch.testing.assert_close(b, a, **tol(torch.float32, "bwd"))
    eager, comp = _eager_and_compiled("rms", "aot_eager")
    for a, b in zip(eager, comp):
        torch.testing.assert_close(b, a, **tol(torch.float32, "bwd"))


@needs_triton
def test_compile_triton_path_uses_custom_ops(monkeypatch):
    """Under compile the Triton path is two opaque custom ops (no graph break, no tracing into launchers)."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    force_triton(monkeypatch)
    backend = AotEagerAndRecordGraphs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager, comp = _eager_and_compiled("layer", backend)
    for a, b in zip(eager, comp):
        torch.testing.assert_close(b, a, **tol(torch.float32, "bwd"))
    assert any("lmbp_convert.ms_norm_fwd" in g.code for g in backend.fw_graphs)
    assert any("lmbp_convert.ms_norm_bwd" in g.code for g in backend.bw_graphs)
    torch._dynamo.reset()
