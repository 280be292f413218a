"""Double backward of the memory-sharing ops (issue 33, item 5): under ``create_graph=True`` each op's backward
takes its differentiable form (`ops._common.twice_differentiable`), so a gradient penalty, a Hessian-vector
product or ``gradgradcheck`` goes through it.

- exact ops (gated act, gated MLP with bias and LoRA, the norms with and without γ, β, the CPU exact-norm node,
  squared ReLU, cross-entropy): ``gradgradcheck`` in fp64, and on the Triton path (CPU tensors under
  ``TRITON_INTERPRET=1``) the second-order gradients equal torch's own ops';
- approx-BP: the double backward is the derivative of ``grad_out · slope(codes)`` (zero in x).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradgradcheck

from lmbp_convert.ops import approx_act as aa
from lmbp_convert.ops import cross_entropy as ce
from lmbp_convert.ops import gated_act as ga
from lmbp_convert.ops import gated_mlp as gm
from lmbp_convert.ops import ms_norm as msn
from lmbp_convert.ops import ms_norm_affine as msa
from lmbp_convert.ops._common import HAS_TRITON
from lmbp_convert.ops.activations import ACTIVATIONS
from lmbp_convert.ops.exact_norm import exact_norm_cpu
from lmbp_convert.ops.relu_squared import relu_squared

triton_only = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
F64 = torch.float64


def _leaf(*shape, dtype=F64, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype).requires_grad_()


def _second_order(fn, inputs, seed=1):
    """(first-order gradients, second-order gradients of Σ c·first) w.r.t. ``inputs``, for fixed random cotangents:
    the first backward with create_graph=True, the second through it."""
    out = fn(*inputs)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
    first = torch.autograd.grad(out, inputs, w, create_graph=True, allow_unused=True)
    cs = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype) for t in inputs]
    s = sum((f.to(torch.float64) * c).sum() for f, c in zip(first, cs) if f is not None)
    second = torch.autograd.grad(s, inputs, allow_unused=True)
    zero = [torch.zeros_like(t) for t in inputs]
    return ([z if f is None else f.detach() for f, z in zip(first, zero)],
            [z if g is None else g for g, z in zip(second, zero)])


def _assert_all_close(got, ref, rtol=1e-4, atol=1e-5):
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------------------------- gated ops
@pytest.mark.parametrize("act", ga.ACT_KINDS)
def test_gated_act_gradgradcheck(act):
    g, u = _leaf(3, 7, scale=2.0), _leaf(3, 7)
    assert gradgradcheck(lambda g, u: ga.gated_act(g, u, act), (g, u))


def _lora(r=2, f=5, n=4, bias=True, scale=0.5, dtype=F64):
    return gm.LoraAdapter(_leaf(r, f, dtype=dtype), _leaf(n, r, dtype=dtype), _leaf(n, dtype=dtype) if bias else None,
                          scale)


@pytest.mark.parametrize("act", ga.ACT_KINDS)
def test_gated_mlp_gradgradcheck_with_bias_and_lora(act):
    g, u, w, b = _leaf(2, 3, 5, scale=2.0), _leaf(2, 3, 5), _leaf(4, 5), _leaf(4)
    ad = _lora()

    def fn(g, u, w, b, a, bw, bb):
        return gm.gated_mlp(g, u, w, b, act, [gm.LoraAdapter(a, bw, bb, ad.scale)])

    assert gradgradcheck(fn, (g, u, w, b, ad.a_weight, ad.b_weight, ad.b_bias))


def test_gated_mlp_gradgradcheck_frozen_gate_up():
    """g and u need no gradient: the op saves no down weight; the weight, bias and adapter gradients are still
    differentiable (through the upstream gradient)."""
    g, u = torch.randn(3, 5, dtype=F64), torch.randn(3, 5, dtype=F64)
    w, b, ad = _leaf(4, 5), _leaf(4), _lora(bias=False)

    def fn(w, b, a, bw):
        return gm.gated_mlp(g, u, w, b, "silu", [gm.LoraAdapter(a, bw, None, ad.scale)])

    assert gradgradcheck(fn, (w, b, ad.a_weight, ad.b_weight))


def _gated_reference(g, u, w, b, act, lora):
    h = ACTIVATIONS[act].torch_fwd(g) * u
    out = F.linear(h, w, b)
    for ad in lora:
        out = out + F.linear(F.linear(h, ad.a_weight), ad.b_weight, ad.b_bias) * ad.scale
    return out


@triton_only
@pytest.mark.parametrize("act", ga.ACT_KINDS)
def test_gated_mlp_second_order_on_the_triton_path(act, monkeypatch):
    """Triton dispatch forced (CPU tensors, interpreter): the kernels run forward, the double backward is the
    plain ops' one."""
    g, u = _leaf(3, 24, dtype=torch.float32, scale=2.0), _leaf(3, 24, dtype=torch.float32)
    w, b = _leaf(8, 24, dtype=torch.float32), _leaf(8, dtype=torch.float32)
    ad = _lora(2, 24, 8, dtype=torch.float32)
    inputs = (g, u, w, b, ad.a_weight, ad.b_weight, ad.b_bias)

    def fused(g, u, w, b, a, bw, bb):
        return gm.gated_mlp(g, u, w, b, act, [gm.LoraAdapter(a, bw, bb, ad.scale)])

    def plain(g, u, w, b, a, bw, bb):
        return _gated_reference(g, u, w, b, act, [gm.LoraAdapter(a, bw, bb, ad.scale)])

    ref = _second_order(plain, inputs)
    monkeypatch.setattr(gm, "use_triton", lambda t: True)
    calls = []
    real = ga._fwd_triton
    monkeypatch.setattr(ga, "_fwd_triton", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    got = _second_order(fused, inputs)
    assert calls  # the forward ran the kernel
    _assert_all_close(got[0], ref[0])
    _assert_all_close(got[1], ref[1])


@triton_only
def test_gated_act_second_order_on_the_triton_path(monkeypatch):
    g, u = _leaf(3, 40, dtype=torch.float32, scale=2.0), _leaf(3, 40, dtype=torch.float32)
    ref = _second_order(lambda g, u: F.silu(g) * u, (g, u))
    monkeypatch.setattr(ga, "use_triton", lambda t: True)
    got = _second_order(lambda g, u: ga.gated_act(g, u, "silu"), (g, u))
    _assert_all_close(got[0], ref[0])
    _assert_all_close(got[1], ref[1])


def test_gated_mlp_autocast_second_order_matches_plain_ops():
    """Under autocast the double backward recomputes with the forward's casts (bf16 Linears, fp32 h)."""
    g, u = _leaf(3, 16, dtype=torch.float32, scale=2.0), _leaf(3, 16, dtype=torch.float32)
    w, b = _leaf(8, 16, dtype=torch.float32), _leaf(8, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _second_order(lambda g, u, w, b: _gated_reference(g, u, w, b, "gelu", []), (g, u, w, b))
        got = _second_order(lambda g, u, w, b: gm.gated_mlp(g, u, w, b, "gelu"), (g, u, w, b))
    for a, r in zip(got[0] + got[1], ref[0] + ref[1]):
        assert a.dtype == r.dtype
        torch.testing.assert_close(a, r, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------------------------------ norms
@pytest.mark.parametrize("rms", (False, True))
def test_ms_norm_gradgradcheck(rms):
    x = _leaf(2, 3, 6, scale=2.0)
    fn = msn.ms_rms_norm if rms else msn.ms_layer_norm
    assert gradgradcheck(lambda x: fn(x, 6), (x,))
    assert gradgradcheck(lambda x: fn(x, (3, 6)), (x,))


@triton_only
@pytest.mark.parametrize("rms", (False, True))
def test_ms_norm_second_order_on_the_triton_path(rms, monkeypatch):
    x = _leaf(4, 32, dtype=torch.float32, scale=2.0)
    plain = (lambda x: F.rms_norm(x, (32,), eps=1e-5)) if rms else (lambda x: F.layer_norm(x, (32,), eps=1e-5))
    ref = _second_order(plain, (x,))
    monkeypatch.setattr(msn, "use_triton", lambda t: t.dtype in (torch.float32, torch.float16, torch.bfloat16))
    fn = msn.ms_rms_norm if rms else msn.ms_layer_norm
    got = _second_order(lambda x: fn(x, 32, 1e-5), (x,))
    _assert_all_close(got[0], ref[0])
    _assert_all_close(got[1], ref[1])


@pytest.mark.parametrize("rms", (False, True))
@pytest.mark.parametrize("one_plus", (False, True))
def test_ms_norm_affine_gradgradcheck(rms, one_plus):
    x, w, b = _leaf(3, 6, scale=2.0), (torch.rand(6, dtype=F64) + 0.5).requires_grad_(), _leaf(6)
    none = torch.empty(0, dtype=torch.long)
    assert gradgradcheck(lambda x, w, b: msa.ms_norm_affine(x, w, b, 6, 1e-5, rms, one_plus, keep_idx=none),
                         (x, w, b))


@triton_only
@pytest.mark.parametrize("rms", (False, True))
def test_ms_norm_affine_second_order_on_the_triton_path(rms, monkeypatch):
    x = _leaf(4, 32, dtype=torch.float32, scale=2.0)
    w = (torch.rand(32) + 0.5).requires_grad_()
    b = _leaf(32, dtype=torch.float32)

    def plain(x, w, b):
        return F.rms_norm(x, (32,), w, 1e-5) + b if rms else F.layer_norm(x, (32,), w, b, 1e-5)

    ref = _second_order(plain, (x, w, b))
    monkeypatch.setattr(msa, "use_triton", lambda t: True)
    none = torch.empty(0, dtype=torch.long)
    got = _second_order(lambda x, w, b: msa.ms_norm_affine(x, w, b, 32, 1e-5, rms, keep_idx=none), (x, w, b))
    _assert_all_close(got[0], ref[0])
    _assert_all_close(got[1], ref[1])


@pytest.mark.parametrize("rms", (False, True))
def test_ms_norm_affine_gradgradcheck_with_kept_columns(rms):
    """Channels whose γ cannot be inverted (γ = 0, |β| ≫ |γ|) keep their input columns and the row means: outputs
    of the node too, so the double backward differentiates through them."""
    x = _leaf(3, 6, scale=2.0)
    w = torch.tensor([1.0, 0.0, 1.5, 0.7, 1e-3, 0.9], dtype=F64, requires_grad=True)
    b = torch.tensor([0.1, 0.3, -0.2, 0.0, 2.0, 0.4], dtype=F64, requires_grad=True)
    keep = torch.nonzero(msa.unreliable_channels(w, b, False)).reshape(-1)
    assert keep.tolist() == [1, 4]
    assert gradgradcheck(lambda x, w, b: msa.ms_norm_affine(x, w, b, 6, 1e-5, rms, keep_idx=keep), (x, w, b))


def _exact_norm_plain(x, w, b, rms, one_plus, n):
    gamma = w + 1 if one_plus else w
    shape = tuple(w.shape)
    if rms:
        y = F.rms_norm(x, shape, gamma, 1e-5)
        return y if b is None else y + b
    return F.layer_norm(x, shape, gamma, b, 1e-5)


@pytest.mark.parametrize("rms", (False, True))
@pytest.mark.parametrize("one_plus", (False, True))
@pytest.mark.parametrize("shape", ((16,), (2, 8)))
def test_exact_norm_cpu_node_second_order(rms, one_plus, shape):
    """The CPU exact norm's one node (fp32): the double backward equals torch's own norm's."""
    x = _leaf(3, 4, *shape, dtype=torch.float32, scale=2.0)
    w = (torch.rand(shape) + 0.5).requires_grad_()
    b = _leaf(*shape, dtype=torch.float32)
    n = w.numel()

    def node(x, w, b):
        got = exact_norm_cpu(x, n, 1e-5, rms, w, b, one_plus, torch.float32, torch.float32)
        assert got is not None
        return got[0]

    ref = _second_order(lambda x, w, b: _exact_norm_plain(x, w, b, rms, one_plus, n), (x, w, b))
    got = _second_order(node, (x, w, b))
    _assert_all_close(got[0], ref[0])
    _assert_all_close(got[1], ref[1])


def test_exact_norm_cpu_node_bf16_second_order_close():
    x = _leaf(4, 32, dtype=torch.float32, scale=2.0)
    w, b = (torch.rand(32) + 0.5).requires_grad_(), _leaf(32, dtype=torch.float32)
    ref = _second_order(lambda x, w, b: F.layer_norm(x, (32,), w, b, 1e-5), (x, w, b))
    xb, wb, bb = (t.detach().bfloat16().requires_grad_() for t in (x, w, b))
    got = _second_order(lambda x, w, b: exact_norm_cpu(x, 32, 1e-5, False, w, b, False, torch.bfloat16,
                                                       torch.bfloat16)[0], (xb, wb, bb))
    for a, r in zip(got[0] + got[1], ref[0] + ref[1]):
        torch.testing.assert_close(a.float(), r, rtol=0.1, atol=0.1)


@pytest.mark.parametrize("kind", ("rms", "layer"))
def test_exact_norm_module_gradgradcheck_without_a_region(kind):
    """`MSExactNorm` in fp64 outside a shared-saves region: ms_norm then the affine op, twice differentiable
    (γ = 1 + w: a LayerNorm with γ = w would run as F.layer_norm there)."""
    from lmbp_convert.nn.exact_norms import MSExactNorm

    w = torch.nn.Parameter((torch.rand(6, dtype=F64) - 0.5))
    b = torch.nn.Parameter(torch.randn(6, dtype=F64))
    norm = MSExactNorm(kind, (6,), 1e-5, w, b, param="1+w")
    x = _leaf(3, 6, scale=2.0)
    assert gradgradcheck(lambda x, w, b: torch.func.functional_call(norm, {"weight": w, "bias": b}, (x,)),
                         (x, w, b))


# ------------------------------------------------------------------------------------- activations and loss
def test_relu_squared_gradgradcheck():
    x = _leaf(4, 9)
    assert gradgradcheck(relu_squared, (x,))


@pytest.mark.parametrize("backend", ("torch", pytest.param("triton", marks=triton_only)))
@pytest.mark.parametrize("kind", ("gelu", "silu"))
def test_approx_act_double_backward_is_the_derivative_of_the_slope_product(kind, backend):
    """dx = grad_out · slope(codes): its derivative w.r.t. grad_out is slope(codes), w.r.t. x zero (the codes are
    a step function of x: the method's own approximation)."""
    x = (torch.randn(5, 40) * 3).requires_grad_()
    gout = torch.randn(5, 40, requires_grad=True)
    (dx,) = torch.autograd.grad(aa.approx_act(x, kind, 2, backend=backend), x, gout, create_graph=True)
    _, packed = aa._fwd_torch(x.detach(), kind, 2)
    slope = torch.tensor(aa.get_constants(kind, 2).slopes)[aa.unpack_codes(packed, x.numel(), 2).long()]
    torch.testing.assert_close(dx, gout.detach() * slope.view(x.shape))
    v = torch.randn(5, 40)
    d_gout, d_x = torch.autograd.grad(dx, (gout, x), v, allow_unused=True, materialize_grads=True)
    torch.testing.assert_close(d_gout, v * slope.view(x.shape))
    assert torch.count_nonzero(d_x) == 0


def test_cross_entropy_gradgradcheck():
    x = _leaf(5, 7)
    t = torch.tensor([0, 3, -100, 6, 2])
    assert gradgradcheck(lambda x: ce.cross_entropy(x, t), (x,))
    assert gradgradcheck(lambda x: ce.cross_entropy_rows(x, t), (x,))


def test_cross_entropy_penalty_with_a_constant_upstream_gradient():
    """The loss's gradient of a mean (an upstream gradient that needs no graph) still depends on the logits: a
    gradient penalty through it equals torch's (once_differentiable dropped that graph silently)."""
    torch.manual_seed(0)
    t = torch.randint(0, 5, (16,))
    w0 = torch.randn(5, 8)

    def penalty_grad(loss_fn):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
        w = w0.clone().requires_grad_()
        (gx,) = torch.autograd.grad(loss_fn(x @ w.t(), t), x, create_graph=True)
        return torch.autograd.grad(gx.pow(2).sum(), w)[0]

    torch.testing.assert_close(penalty_grad(ce.cross_entropy), penalty_grad(F.cross_entropy), rtol=1e-5,
                               atol=1e-6)


def test_logits_head_and_cross_entropy_gradgradcheck():
    from lmbp_convert.ops.logits_head import logits_head

    h, w = _leaf(4, 6), _leaf(7, 6)
    t = torch.tensor([0, 3, 6, 2])
    assert gradgradcheck(lambda h, w: ce.cross_entropy(logits_head(h, w, None), t), (h, w))


def test_a_hand_off_belongs_to_its_backward_pass():
    """rstd's gradient is handed to the norm's node within one backward pass: a pass that captures the norm's output
    (the node does not run) leaves nothing that a later pass would add twice."""
    x = _leaf(3, 8, scale=2.0)
    y = msn.ms_layer_norm(x, 8)
    (gx,) = torch.autograd.grad(y.pow(3).sum(), x, create_graph=True)
    torch.autograd.grad(gx.pow(2).sum(), y, retain_graph=True)  # stops at y: the node never runs in this pass
    (got,) = torch.autograd.grad(gx.pow(2).sum(), x)
    xr = x.detach().clone().requires_grad_()
    (gr,) = torch.autograd.grad(F.layer_norm(xr, (8,), eps=1e-5).pow(3).sum(), xr, create_graph=True)
    torch.testing.assert_close(got, torch.autograd.grad(gr.pow(2).sum(), xr)[0])


def test_no_second_derivative_error_names_the_rewrite_and_the_option():
    from lmbp_convert import LmbpError, NoSecondDerivativeError

    err = NoSecondDerivativeError("memory-sharing norm on the C++ host path", "norms", "why")
    assert isinstance(err, LmbpError) and isinstance(err, RuntimeError)
    assert "memory-sharing norm on the C++ host path" in str(err) and "norms=False" in str(err)
    assert (err.rewrite, err.option) == ("memory-sharing norm on the C++ host path", "norms")
