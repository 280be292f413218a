"""gated_act_recomputed: the consumer's saved h is recomputed bitwise from g and u (views, casts, Triton path),
other saved tensors reach enclosing hooks, exact bytes, and composition with checkpointing and save_on_cpu."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmbp_convert.memory import SavedTensorLedger
from lmbp_convert.ops import gated_mlp as gm
from lmbp_convert.ops.gated_mlp import ACT_KINDS
from lmbp_convert.ops.gated_recompute import gated_act_recomputed

TORCH_ACT = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
T, F_, N = 6, 20, 8


class SaveAndCheck(torch.autograd.Function):
    """``F.linear(h, w)`` saving ``saved`` (a view or cast of h made by autograd-recorded ops, as autocast or
    PEFT make them) and checking in backward that what it gets back is bitwise what it saved."""

    @staticmethod
    def forward(ctx, saved, h, w):
        ctx.save_for_backward(saved, w)
        ctx.expected = saved.detach().clone()  # kept in ctx, outside the saved-tensor machinery
        ctx.layout = (saved.shape, saved.stride(), saved.storage_offset(), saved.dtype)
        return F.linear(h, w)

    @staticmethod
    def backward(ctx, dy):
        saved, w = ctx.saved_tensors
        assert (saved.shape, saved.stride(), saved.storage_offset(), saved.dtype) == ctx.layout
        assert torch.equal(saved, ctx.expected)
        ctx.checked = True
        return None, dy.matmul(w), None


VIEWS = {
    "h": lambda h: h,
    "2d view": lambda h: h.view(-1, h.shape[-1]),
    "transposed slice": lambda h: h.view(-1, h.shape[-1])[1:, 3:].t(),
    "bf16 cast": lambda h: h.to(torch.bfloat16),
    "view of a cast": lambda h: h.to(torch.float64).view(-1, h.shape[-1])[2:],
    "cast chain": lambda h: h.to(torch.float64).to(torch.bfloat16),
}


@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("act", ACT_KINDS)
def test_recomputed_saved_tensor_is_bitwise_the_saved_one(view, act):
    y = (torch.randn(2, 3, 2 * F_) * 3).requires_grad_()
    g, u = y.chunk(2, dim=-1)
    w = torch.randn(N, F_)
    nodes = []

    def consume(h):
        out = SaveAndCheck.apply(VIEWS[view](h), h, w)
        nodes.append(out.grad_fn)
        return out

    with SavedTensorLedger([w]) as ledger:
        out = gated_act_recomputed(g, u, act, consume)
    assert ledger.count == 1 and ledger.bytes == y.numel() * 4, ledger.summary()  # y only: h became a recipe
    out.sum().backward()
    assert nodes[0].checked


def _mlp(bias=True):
    torch.manual_seed(0)
    return nn.Linear(16, F_, bias=bias), nn.Linear(16, F_, bias=bias), nn.Linear(F_, N, bias=bias)


def _grads(fn, x, params):
    x = x.detach().requires_grad_()
    for p in params:
        p.grad = None
    out = fn(x)
    (out * torch.linspace(-1, 1, N)).sum().backward()  # not autograd.grad: reentrant checkpoints refuse it
    return [out, x.grad, *(p.grad for p in params)]


@pytest.mark.parametrize("act", ACT_KINDS)
def test_matches_eager_and_saves_x_g_u(act):
    gate, up, down = _mlp()
    params = [*gate.parameters(), *up.parameters(), *down.parameters()]
    x = torch.randn(2, T, 16)
    ref = _grads(lambda t: down(TORCH_ACT[act](gate(t)) * up(t)), x, params)
    got = _grads(lambda t: gated_act_recomputed(gate(t), up(t), act, down), x, params)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with SavedTensorLedger(params) as ledger:
        gated_act_recomputed(gate(x.requires_grad_()), up(x), act, down)
    assert ledger.bytes == 4 * (x.numel() + 2 * 2 * T * F_), ledger.summary()


def test_other_saved_tensors_reach_the_enclosing_hooks():
    """A consumer saving h and something else: the ledger sees the other tensor, not h."""
    g, u = torch.randn(T, F_, requires_grad=True), torch.randn(T, F_, requires_grad=True)
    w = nn.Parameter(torch.randn(N, F_))
    with SavedTensorLedger([w]) as ledger:
        gated_act_recomputed(g, u, "silu", lambda h: F.linear(h, w).sigmoid())  # sigmoid saves its output
    assert sorted(e.nbytes for e in ledger.entries) == sorted([4 * T * F_, 4 * T * F_, 4 * T * N]), ledger.summary()


def test_without_a_graph_the_consumer_runs_plainly():
    """g and u need no grad: nothing saves them, so h is saved as eager would (one T×f, not two)."""
    g, u = torch.randn(T, F_), torch.randn(T, F_)
    down = nn.Linear(F_, N)
    with SavedTensorLedger(down) as ledger:
        out = gated_act_recomputed(g, u, "gelu", down)
    assert ledger.bytes == 4 * T * F_, ledger.summary()
    out.sum().backward()
    torch.testing.assert_close(down.weight.grad, (F.gelu(g) * u).sum(0).expand(N, F_))
    with torch.no_grad():
        torch.testing.assert_close(gated_act_recomputed(g, u, "gelu", down), down(F.gelu(g) * u))


@pytest.mark.parametrize("how", ["non-reentrant checkpoint", "reentrant checkpoint", "save_on_cpu"])
def test_composes_with_checkpointing_and_offloading(how):
    gate, up, down = _mlp()
    params = [*gate.parameters(), *up.parameters(), *down.parameters()]
    x = torch.randn(T, 16)

    def block(t):
        return gated_act_recomputed(gate(t), up(t), "silu", down)

    def wrapped(t):
        if how == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu():
                return block(t)
        return checkpoint(block, t, use_reentrant=how == "reentrant checkpoint")

    ref = _grads(lambda t: down(F.silu(gate(t)) * up(t)), x, params)
    for a, b in zip(_grads(wrapped, x, params), ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_create_graph_first_order_matches():
    """create_graph=True works (the unpacked h carries h's grad_fn); g, u stay once-differentiable as in
    `gated_act`."""
    gate, up, down = _mlp()
    x = torch.randn(T, 16, requires_grad=True)
    ref = torch.autograd.grad(down(F.silu(gate(x)) * up(x)).pow(2).sum(), down.weight)[0]
    (got,) = torch.autograd.grad(gated_act_recomputed(gate(x), up(x), "silu", down).pow(2).sum(), down.weight,
                                 create_graph=True)
    assert got.requires_grad
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not gm.HAS_TRITON, reason="triton not installed")
def test_triton_path_recomputes_with_the_forward_kernel(monkeypatch):
    """Forced Triton dispatch (CPU tensors, interpreter): the recompute runs the Triton kernel, bitwise."""
    import lmbp_convert.ops.gated_act as ga
    import lmbp_convert.ops.gated_recompute as gr

    monkeypatch.setattr(ga, "use_triton", lambda t: True)  # the elementwise op's own dispatch
    calls = []
    real = ga._fwd_triton

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(ga, "_fwd_triton", spy)
    monkeypatch.setattr(gr, "_fwd_triton", spy)
    y = (torch.randn(T, 2 * F_) * 2).requires_grad_()
    g, u = y.chunk(2, dim=-1)
    nodes = []

    def consume(h):
        out = SaveAndCheck.apply(VIEWS["2d view"](h), h, torch.randn(N, F_))
        nodes.append(out.grad_fn)
        return out

    out = gated_act_recomputed(g, u, "gelu_tanh", consume)
    assert len(calls) == 1
    out.sum().backward()
    assert nodes[0].checked and len(calls) == 2


@pytest.mark.slow  # torch.compile
def test_torch_compile_saves_g_u_and_matches():
    gate, up, down = _mlp()
    params = [*gate.parameters(), *up.parameters(), *down.parameters()]
    x = torch.randn(T, 16)

    def block(t):
        return gated_act_recomputed(gate(t), up(t), "silu", down)

    compiled = torch.compile(block, fullgraph=True)
    ref = _grads(lambda t: down(F.silu(gate(t)) * up(t)), x, params)
    for a, b in zip(_grads(compiled, x, params), ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with SavedTensorLedger(params) as ledger:
        compiled(x.requires_grad_())
    assert ledger.bytes == 4 * (x.numel() + 2 * T * F_), ledger.summary()


# ------------------------------------------------------------------------------------------------------
# CUDA: the Triton kernels eager (recompute bitwise by the forward's kernel) and under torch.compile (the
# checkpoint-tagged triton_op recomputed by the partitioner). Skipped without a GPU.
# ------------------------------------------------------------------------------------------------------
cuda_only = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                               reason="needs a CUDA device and compiled Triton kernels (TRITON_INTERPRET=0)")


@cuda_only
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_bytes_and_gradients(compiled, dtype):
    torch.manual_seed(0)
    gate, up, down = (m.to("cuda", dtype) for m in _mlp())
    params = [*gate.parameters(), *up.parameters(), *down.parameters()]
    x = torch.randn(2, 64, 16, device="cuda", dtype=dtype)

    def block(t):
        return gated_act_recomputed(gate(t), up(t), "silu", down)

    run = torch.compile(block, fullgraph=True) if compiled else block
    if compiled:
        run(x.requires_grad_())  # compile outside the ledger
    with SavedTensorLedger(params) as ledger:
        run(x.detach().requires_grad_())
    item = x.element_size()
    assert ledger.bytes == item * (x.numel() + 2 * 2 * 64 * F_), ledger.summary()
    w = torch.linspace(-1, 1, N, device="cuda")

    def grads(fn):
        t = x.detach().requires_grad_()
        for p in params:
            p.grad = None
        (fn(t).float() * w).sum().backward()
        return [t.grad, *(p.grad for p in params)]

    ref = grads(lambda t: down(F.silu(gate(t)) * up(t)))
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(grads(run), ref, strict=True):
        torch.testing.assert_close(a, b, **tol)


def test_hooks_disabled_by_the_caller_keeps_h():
    """Inside disable_saved_tensors_hooks the consumer runs plainly (it keeps h) instead of raising."""
    gate, up, down = _mlp()
    params = [*gate.parameters(), *up.parameters(), *down.parameters()]
    x = torch.randn(T, 16)
    ref = _grads(lambda t: down(F.silu(gate(t)) * up(t)), x, params)
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
        got = _grads(lambda t: gated_act_recomputed(gate(t), up(t), "silu", down), x, params)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_empty_batch():
    gate, up, down = _mlp()
    x = torch.randn(0, 16, requires_grad=True)
    out = gated_act_recomputed(gate(x), up(x), "gelu", down)
    assert out.shape == (0, N)
    out.sum().backward()
    assert torch.count_nonzero(down.weight.grad) == 0


@pytest.mark.slow  # torch.compile
@pytest.mark.skipif(not gm.HAS_TRITON, reason="triton not installed")
def test_torch_compile_recomputes_the_triton_op_too():
    """With the Triton dispatch on (CPU tensors, interpreter) h comes from the opaque kernel op; inside the
    checkpoint region the partitioner still recomputes it rather than saving it."""
    from lmbp_convert.ops._common import set_triton_device_types

    gate, up, down = _mlp()
    params = [*gate.parameters(), *up.parameters(), *down.parameters()]
    x = torch.randn(T, 16)
    ref = _grads(lambda t: down(F.silu(gate(t)) * up(t)), x, params)
    set_triton_device_types("cpu")
    try:
        compiled = torch.compile(lambda t: gated_act_recomputed(gate(t), up(t), "silu", down), backend="aot_eager",
                                 fullgraph=True)
        got = _grads(compiled, x, params)
        with SavedTensorLedger(params) as ledger:
            compiled(x.requires_grad_())
    finally:
        set_triton_device_types("cuda")
    assert ledger.bytes == 4 * (x.numel() + 2 * T * F_), ledger.summary()
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_without_torch_hook_introspection_the_consumer_runs_plainly(monkeypatch):
    """A torch without the (private) hook-stack accessor: correct results, h kept."""
    import lmbp_convert.ops.gated_recompute as gr

    monkeypatch.setattr(gr, "_top_hooks", None)
    gate, up, down = _mlp()
    params = [*gate.parameters(), *up.parameters(), *down.parameters()]
    x = torch.randn(T, 16)
    ref = _grads(lambda t: down(F.silu(gate(t)) * up(t)), x, params)
    for a, b in zip(_grads(lambda t: gated_act_recomputed(gate(t), up(t), "silu", down), x, params), ref,
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with SavedTensorLedger(params) as ledger:
        gated_act_recomputed(gate(x.requires_grad_()), up(x), "silu", down)
    assert ledger.bytes == 4 * (x.numel() + 3 * T * F_), ledger.summary()
