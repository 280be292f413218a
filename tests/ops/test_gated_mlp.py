"""gated_mlp / gated_act: exactness against eager PyTorch, Triton launchers (interpreter) against the PyTorch
path, dtype policy under autocast, and what is saved for backward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmbp_convert.memory import SavedTensorLedger
from lmbp_convert.ops import gated_mlp as gm
from lmbp_convert.ops.gated_mlp import ACT_KINDS, LoraAdapter, gated_act, gated_mlp

TORCH_ACT = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


def _eager(g, u, w, b, act, lora=()):
    """What the eager module computes: PEFT's lora.Linear forward, step by step."""
    h = TORCH_ACT[act](g) * u
    out = F.linear(h, w, b)
    rd = out.dtype
    for ad in lora:
        hx = h.to(ad.a_weight.dtype) if ad.cast_input else h
        out = out + F.linear(F.linear(hx, ad.a_weight), ad.b_weight, ad.b_bias) * ad.scale
    return out.to(rd)


def _leaf(*shape, dtype=torch.float32, scale=1.0, grad=True):
    return (torch.randn(*shape, dtype=dtype) * scale).requires_grad_(grad)


def _grads(out, inputs, w):
    inputs = [t for t in inputs if t is not None and t.requires_grad]
    return torch.autograd.grad((out.float() * w).sum(), inputs)


# ------------------------------------------------------------------------------------------------------
# PyTorch path: activation derivatives, gradcheck, exactness against eager
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("act", ACT_KINDS)
def test_gradcheck_with_lora_and_bias(act):
    d = torch.float64
    g, u = _leaf(3, 5, 7, dtype=d), _leaf(3, 5, 7, dtype=d)
    w, b = _leaf(4, 7, dtype=d), _leaf(4, dtype=d)
    lora = [LoraAdapter(_leaf(2, 7, dtype=d), _leaf(4, 2, dtype=d), _leaf(4, dtype=d), 0.75),
            LoraAdapter(_leaf(3, 7, dtype=d), _leaf(4, 3, dtype=d), None, 2.0)]

    def fn(g, u, w, b, a0, b0, bb0, a1, b1):
        ads = [LoraAdapter(a0, b0, bb0, 0.75), LoraAdapter(a1, b1, None, 2.0)]
        return gated_mlp(g, u, w, b, act, ads)

    args = (g, u, w, b, lora[0].a_weight, lora[0].b_weight, lora[0].b_bias, lora[1].a_weight, lora[1].b_weight)
    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("act", ACT_KINDS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_matches_eager_all_grads(act, with_bias):
    g, u = _leaf(2, 6, 24, scale=2.0), _leaf(2, 6, 24)
    w = _leaf(10, 24, scale=0.2)
    b = _leaf(10) if with_bias else None
    lora = [LoraAdapter(_leaf(3, 24), _leaf(10, 3), _leaf(10), 0.5)]
    ws = torch.randn(2, 6, 10)
    inputs = [g, u, w, b, lora[0].a_weight, lora[0].b_weight, lora[0].b_bias]
    ref = _eager(g, u, w, b, act, lora)
    out = gated_mlp(g, u, w, b, act, lora)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for a, r in zip(_grads(out, inputs, ws), _grads(ref, inputs, ws)):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trainable", ["none", "weight", "g", "u", "lora_a", "lora_b"])
def test_only_needed_grads(trainable):
    """Frozen inputs get no gradient; the ones that need one are still exact."""
    g, u = _leaf(5, 12, grad=trainable == "g"), _leaf(5, 12, grad=trainable == "u")
    w, b = _leaf(6, 12, grad=trainable == "weight"), _leaf(6, grad=False)
    ad = LoraAdapter(_leaf(2, 12, grad=trainable == "lora_a"), _leaf(6, 2, grad=trainable == "lora_b"), None, 1.5)
    out = gated_mlp(g, u, w, b, "silu", [ad])
    ref = _eager(g, u, w, b, "silu", [ad])
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    if trainable == "none":
        assert not out.requires_grad
        return
    inputs = [g, u, w, ad.a_weight, ad.b_weight]
    ws = torch.randn(5, 6)
    (ga,), (gr,) = _grads(out, inputs, ws), _grads(ref, inputs, ws)
    torch.testing.assert_close(ga, gr, rtol=1e-5, atol=1e-5)


def test_strided_views_of_a_fused_projection():
    y = _leaf(4, 9, 2 * 20)
    g, u = y.chunk(2, dim=-1)
    assert not g.is_contiguous()
    w = _leaf(8, 20)
    ws = torch.randn(4, 9, 8)
    out, ref = gated_mlp(g, u, w, None, "gelu"), _eager(g, u, w, None, "gelu")
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for a, r in zip(_grads(out, [y, w], ws), _grads(ref, [y, w], ws)):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


def _err(a, truth):
    return (a.double() - truth).abs().max().item()


@pytest.mark.parametrize("act", ACT_KINDS)
def test_bf16_no_worse_than_eager(act):
    """bf16 end to end: outputs/grads are within eager bf16's own error of the fp64 truth."""
    g64, u64 = torch.randn(16, 64, dtype=torch.float64) * 2, torch.randn(16, 64, dtype=torch.float64)
    w64, b64 = torch.randn(32, 64, dtype=torch.float64) * 0.1, torch.randn(32, dtype=torch.float64)
    ws = torch.randn(16, 32)

    def run(fn, dtype):
        ins = [t.to(dtype).requires_grad_() for t in (g64, u64, w64, b64)]
        out = fn(*ins, act)
        return [out, *_grads(out, ins, ws)]

    truth = [t.double() for t in run(_eager, torch.float64)]
    eager = run(_eager, torch.bfloat16)
    ours = run(gated_mlp, torch.bfloat16)
    for o, e, t in zip(ours, eager, truth):
        assert o.dtype == e.dtype == torch.bfloat16
        assert _err(o, t) <= 1.5 * _err(e, t) + 1e-2 * t.abs().max().item()


def test_bf16_base_with_fp32_adapters_follows_peft_dtype_chain():
    """PEFT keeps adapters in fp32 on a bf16 model: h is upcast for A, the sum promotes, the output is bf16."""
    base = [torch.randn(8, 32, dtype=torch.float64), torch.randn(8, 32, dtype=torch.float64),
            torch.randn(16, 32, dtype=torch.float64) * 0.2]
    lora = [torch.randn(4, 32, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64) * 0.1]
    ws = torch.randn(8, 16)

    def run(fn, base_dtype, lora_dtype):
        g, u, w = [t.to(base_dtype).requires_grad_() for t in base]
        a, b = [t.to(lora_dtype).requires_grad_() for t in lora]
        out = fn(g, u, w, None, "silu", [LoraAdapter(a, b, None, 2.0)])
        return [out, *_grads(out, [g, u, w, a, b], ws)]

    truth = run(_eager, torch.float64, torch.float64)
    eager = run(_eager, torch.bfloat16, torch.float32)
    ours = run(gated_mlp, torch.bfloat16, torch.float32)
    for o, e, t in zip(ours, eager, truth):
        assert o.dtype == e.dtype and o.shape == e.shape
        assert _err(o, t) <= 1.5 * _err(e, t) + 1e-2 * t.abs().max().item()


def test_bf16_autocast_linear_part_is_exactly_f_linear():
    """Under CPU bf16 autocast the down matmuls are F.linear's: given the same h, outputs and the grads of
    W, b, A, B, B-bias are bitwise those of eager autocast; all grads come back in the inputs' dtypes."""
    g, u = _leaf(8, 32, dtype=torch.bfloat16), _leaf(8, 32, dtype=torch.bfloat16)
    w, b = _leaf(16, 32, scale=0.2), _leaf(16)
    ad = LoraAdapter(_leaf(4, 32), _leaf(16, 4), _leaf(16), 0.5)
    params = [w, b, ad.a_weight, ad.b_weight, ad.b_bias]
    ws = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gated_mlp(g, u, w, b, "gelu_tanh", [ad])
        h = gated_act(g.detach(), u.detach(), "gelu_tanh")  # the same h, through the eager Linear path
        ref = F.linear(h, w, b) + F.linear(F.linear(h.float(), ad.a_weight), ad.b_weight, ad.b_bias) * 0.5
    assert out.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(out, ref)
    ga = _grads(out, [g, u] + params, ws)
    gr = _grads(ref, params, ws)
    assert ga[0].dtype == ga[1].dtype == torch.bfloat16
    for a, r in zip(ga[2:], gr):
        assert a.dtype == r.dtype == torch.float32
        torch.testing.assert_close(a, r, rtol=0, atol=0)


def test_bf16_autocast_no_worse_than_eager():
    base = [torch.randn(8, 32, dtype=torch.float64) * 2, torch.randn(8, 32, dtype=torch.float64),
            torch.randn(16, 32, dtype=torch.float64) * 0.2, torch.randn(16, dtype=torch.float64),
            torch.randn(4, 32, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64) * 0.1]
    ws = torch.randn(8, 16)

    def run(fn, act_dtype, autocast):
        g, u = [t.to(act_dtype).requires_grad_() for t in base[:2]]
        w, b, a, bb = [t.to(act_dtype if not autocast else torch.float32).requires_grad_() for t in base[2:]]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn(g, u, w, b, "gelu_tanh", [LoraAdapter(a, bb, None, 0.5)])
        return [out, *_grads(out, [g, u, w, b, a, bb], ws)]

    truth = run(_eager, torch.float64, False)
    eager = run(_eager, torch.bfloat16, True)
    ours = run(gated_mlp, torch.bfloat16, True)
    for o, e, t in zip(ours, eager, truth):
        assert o.dtype == e.dtype and o.shape == e.shape
        assert _err(o, t) <= 1.5 * _err(e, t) + 1e-2 * t.abs().max().item()


def test_backward_under_autocast_is_unaffected():
    """Autocast left on during backward must not change the op's (explicitly cast) backward."""
    g, u, w = _leaf(6, 16), _leaf(6, 16), _leaf(8, 16)
    ws = torch.randn(6, 8)
    out = gated_mlp(g, u, w, None, "silu")
    plain = _grads(out, [g, u, w], ws)
    out = gated_mlp(g, u, w, None, "silu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = _grads(out, [g, u, w], ws)
    for a, b in zip(plain, under):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gated_act_matches_eager():
    y = _leaf(5, 2 * 16, scale=2.0)
    up, gate = y.chunk(2, dim=-1)
    ws = torch.randn(5, 16)
    h, ref = gated_act(gate, up, "gelu"), F.gelu(gate) * up
    torch.testing.assert_close(h, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(_grads(h, [y], ws)[0], _grads(ref, [y], ws)[0], rtol=1e-5, atol=1e-5)


def test_empty_batch():
    g, u, w = _leaf(0, 8), _leaf(0, 8), _leaf(4, 8)
    out = gated_mlp(g, u, w, None, "silu")
    assert out.shape == (0, 4)
    out.sum().backward()
    assert g.grad.shape == (0, 8) and torch.count_nonzero(w.grad) == 0


def test_input_validation():
    g, u, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="unknown activation"):
        gated_mlp(g, u, w, act="relu")
    with pytest.raises(ValueError, match="differ in shape"):
        gated_mlp(g, u[:, :4], w)
    with pytest.raises(ValueError, match="does not take"):
        gated_mlp(g, u, w.t())
    with pytest.raises(ValueError, match="bias"):
        gated_mlp(g, u, w, torch.randn(5))
    with pytest.raises(ValueError, match="LoRA shapes"):
        gated_mlp(g, u, w, lora=[LoraAdapter(torch.randn(2, 8), torch.randn(4, 3), None, 1.0)])
    with pytest.raises(TypeError, match="scale"):
        gated_mlp(g, u, w, lora=[LoraAdapter(torch.randn(2, 8), torch.randn(4, 2), None, torch.tensor(1.0))])
    with pytest.raises(TypeError, match="dtype"):
        gated_mlp(g.int(), u, w)


# ------------------------------------------------------------------------------------------------------
# Saved tensors: only g and u, the very storages passed in
# ------------------------------------------------------------------------------------------------------
def test_saves_only_the_given_g_and_u():
    T, f, n = 7, 24, 10
    g, u = _leaf(T, f), _leaf(T, f)
    w, b = torch.nn.Parameter(torch.randn(n, f)), torch.nn.Parameter(torch.randn(n))
    ad = LoraAdapter(torch.nn.Parameter(torch.randn(3, f)), torch.nn.Parameter(torch.randn(n, 3)), None, 1.0)
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gated_mlp(g, u, w, b, "silu", [ad])
    activations = [t for t in packed if not isinstance(t, torch.nn.Parameter)]
    assert {t.data_ptr() for t in activations} == {g.data_ptr(), u.data_ptr()}
    with SavedTensorLedger([w, b, ad.a_weight, ad.b_weight]) as ledger:
        gated_mlp(g, u, w, b, "silu", [ad])
    assert ledger.bytes == 2 * T * f * 4, ledger.summary()


def test_fused_views_keep_one_storage():
    T, f = 5, 16
    y = _leaf(T, 2 * f, dtype=torch.bfloat16)
    g, u = y.chunk(2, dim=-1)
    w = torch.nn.Parameter(torch.randn(8, f, dtype=torch.bfloat16))
    with SavedTensorLedger([w]) as ledger:
        gated_mlp(g, u, w, None, "gelu")
    assert ledger.count == 1 and ledger.bytes == T * 2 * f * 2, ledger.summary()


# ------------------------------------------------------------------------------------------------------
# Triton launchers (interpreter on CPU tensors) against the PyTorch path
# ------------------------------------------------------------------------------------------------------
triton_only = pytest.mark.skipif(not gm.HAS_TRITON, reason="triton not installed")


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)


@triton_only
@pytest.mark.parametrize("act", ACT_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_launchers_match_torch(act, dtype):
    y = torch.randn(2, 3, 2 * 37, dtype=dtype) * 3
    g, u = y.chunk(2, dim=-1)  # strided rows, odd width: masked tail
    dh = torch.randn(2, 3, 37, dtype=dtype)
    torch.testing.assert_close(gm._fwd_triton(g, u, act, dtype), gm._fwd_torch(g, u, act, dtype), **_tol(dtype))
    got = gm._bwd_triton(dh.clone(), g, u, act, dtype, dg_into_dh=True)
    ref = gm._bwd_torch(dh, g, u, act, dtype)
    for a, r in zip(got, ref):
        assert a.dtype == r.dtype and a.shape == r.shape
        torch.testing.assert_close(a, r, **_tol(dtype))
    dg, du, h = gm._bwd_triton(dh, g, u, act, None)
    assert h is None
    torch.testing.assert_close(dg, ref[0], **_tol(dtype))


@triton_only
@pytest.mark.parametrize("act", ACT_KINDS)
def test_triton_act_and_derivative_against_autograd(act):
    """The kernels' closed-form act and act' (incl. the saturated tails) against fp64 autograd."""
    g64 = torch.linspace(-30, 30, 3001, dtype=torch.float64, requires_grad=True)
    (da_ref,) = torch.autograd.grad(TORCH_ACT[act](g64).sum(), g64)
    g = g64.detach().float()
    ones = torch.ones_like(g)
    dg, du, h = gm._bwd_triton(ones, g, ones, act, torch.float32)
    torch.testing.assert_close(dg.double(), da_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(du, TORCH_ACT[act](g), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h, du, rtol=0, atol=0)
    torch.testing.assert_close(gm._fwd_triton(g, ones, act, torch.float32), h, rtol=0, atol=0)


@triton_only
def test_triton_bwd_h_bitwise_equals_forward_h():
    """The backward recompute of h is the forward's h, so dW is taken from what the forward used."""
    for act in ACT_KINDS:
        g, u = torch.randn(4, 50) * 4, torch.randn(4, 50)
        h_fwd = gm._fwd_triton(g, u, act, torch.bfloat16)
        _, _, h_bwd = gm._bwd_triton(torch.randn(4, 50), g, u, act, torch.bfloat16)
        assert torch.equal(h_fwd, h_bwd), act


@triton_only
def test_triton_dg_written_into_dh():
    g, u = torch.randn(6, 40), torch.randn(6, 40)
    dh = torch.randn(6, 40)
    ref = gm._bwd_torch(dh, g, u, "silu", None)
    work = dh.clone()
    dg, du, _ = gm._bwd_triton(work, g, u, "silu", None, dg_into_dh=True)
    assert dg.data_ptr() == work.data_ptr()
    torch.testing.assert_close(dg, ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(du, ref[1], rtol=1e-5, atol=1e-5)


@triton_only
def test_function_on_triton_path_matches_torch_path(monkeypatch):
    """The whole op with the Triton dispatch forced on (CPU tensors, interpreter) equals the PyTorch path."""
    y = _leaf(3, 2 * 24, scale=2.0)
    w, b = _leaf(8, 24), _leaf(8)
    ad = LoraAdapter(_leaf(2, 24), _leaf(8, 2), None, 0.5)
    inputs = [y, w, b, ad.a_weight, ad.b_weight]
    ws = torch.randn(3, 8)

    def run():
        g, u = y.chunk(2, dim=-1)
        out = gated_mlp(g, u, w, b, "gelu_tanh", [ad])
        return [out, *_grads(out, inputs, ws)]

    ref = run()
    monkeypatch.setattr(gm, "use_triton", lambda t: True)
    got = run()
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


@triton_only
def test_custom_ops_opcheck():
    g, u, dh = torch.randn(3, 20), torch.randn(3, 20), torch.randn(3, 20)
    for triton in (True, False):  # the op wraps both paths (opaque to torch.compile either way)
        torch.library.opcheck(torch.ops.lmbp_convert.gated_mlp_fwd.default, (g, u, "silu", torch.float32, triton),
                              test_utils=("test_schema", "test_faketensor"))
        for h_dtype in (torch.float32, None):
            torch.library.opcheck(torch.ops.lmbp_convert.gated_mlp_bwd.default, (dh, g, u, "gelu", h_dtype, triton),
                                  test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("edit", ["a_weight", "weight", "g"])
def test_an_edit_of_what_backward_recomputes_from_raises_under_enclosing_hooks(edit):
    """The fused op recomputes h and A(h) from g, u and the weights, where unfused autograd kept the products (an
    edit since forward could not reach its gradient). ``save_on_cpu`` on CPU tensors keeps the tensors themselves
    and switches autograd's own check off: the op checks the versions itself (a silent wrong gradient before)."""
    torch.manual_seed(0)
    g = torch.randn(4, 6, 7, requires_grad=True) * 1
    u = torch.randn(4, 6, 7, requires_grad=True) * 1
    weight = torch.randn(5, 7, requires_grad=True)
    a, b = torch.randn(2, 7, requires_grad=True), torch.randn(5, 2, requires_grad=True)
    with torch.autograd.graph.save_on_cpu():
        y = gated_mlp(g, u, weight, None, "silu", [LoraAdapter(a, b, None, 0.5)])
    with torch.no_grad():
        {"a_weight": a, "weight": weight, "g": g}[edit].mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
