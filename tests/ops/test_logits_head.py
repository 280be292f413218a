"""The LM head fused with the memory-sharing cross-entropy's backward: the head's input, weight and bias gradients
equal the unfused path's (plain ``F.linear`` + the same loss) per dtype; backward never allocates an (N, V)
gradient; the loss writes its own gradient whenever something may read it (``autograd.grad`` on the logits,
``retain_grad``, a hook, another consumer of the logits, ``create_graph``); autocast; the Triton kernels
(interpreter) through the hand-off."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lmbp_convert.ops import cross_entropy as C
from lmbp_convert.ops import logits_head as LH
from lmbp_convert.ops._common import HAS_TRITON
from lmbp_convert.ops.cross_entropy import cross_entropy
from lmbp_convert.ops.logits_head import logits_head

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
N, D, V = 40, 16, 301


def _data(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(2, N // 2, D, generator=gen).to(dtype)
    w = (torch.randn(V, D, generator=gen) / 4).to(dtype)
    b = torch.randn(V, generator=gen).to(dtype)
    t = torch.randint(0, V, (N,), generator=gen)
    t[::7] = -100
    return h, w, b, t


def _run(fused, h0, w0, b0, t, loss_fn=None, train_w=True):
    h = h0.clone().requires_grad_()
    w = w0.clone().requires_grad_(train_w)
    b = b0.clone().requires_grad_(train_w) if b0 is not None else None
    logits = (logits_head if fused else F.linear)(h, w, b)
    loss = (loss_fn or (lambda lg: cross_entropy(lg.reshape(-1, V), t)))(logits)
    loss.backward()
    grads = [h.grad, w.grad, None if b is None else b.grad]
    return loss.detach(), logits.detach(), grads


def _abs_product_sums(h, w, b, logits, t, loss_fn):
    """Per gradient element, the sum of the absolute products it adds up (|G|·|W|, |G|ᵀ·|h|, Σ|G|, G the
    loss's gradient on the logits): the scale of its fp32 accumulation error in any summation order."""
    lg = logits.detach().double().requires_grad_()
    loss = (loss_fn or (lambda x: cross_entropy(x.reshape(-1, V), t)))(lg)
    (g,) = torch.autograd.grad(loss, lg)
    g = g.abs().reshape(-1, V)
    return [(g @ w.double().abs()).reshape(h.shape), g.t() @ h.double().abs().reshape(-1, D),
            None if b is None else g.sum(0)]


class _Calls:
    """Counts the fused backwards (the hand-off taken) in a test."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = LH._fused_backward

        def spy(*args):
            self.n += 1
            return real(*args)

        monkeypatch.setattr(LH, "_fused_backward", spy)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("bias,train_w", [(True, True), (False, True), (False, False)])
@pytest.mark.parametrize("reduction", ("mean", "divisor"))
def test_gradients_equal_the_unfused_path(dtype, bias, train_w, reduction, monkeypatch):
    monkeypatch.setattr(LH, "ROW_CHUNK_ELEMENTS", 7 * V)  # several chunks, the last one short
    calls = _Calls(monkeypatch)
    h, w, b, t = _data(dtype)
    fn = None if reduction == "mean" else (lambda lg: cross_entropy(lg.reshape(-1, V), t, reduction="sum",
                                                                    divisor=torch.tensor(9)))
    ref = _run(False, h, w, b if bias else None, t, fn, train_w)
    got = _run(True, h, w, b if bias else None, t, fn, train_w)
    assert calls.n == 1
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])  # the same loss and logits
    # the sums of products run in another order (row chunks: another GEMM blocking on some CPUs; fp32
    # accumulation, rounded once to the dtype): within a rounding of the dtype, plus fp32 accumulation error
    # relative to each sum's absolute terms
    bounds = _abs_product_sums(h, w, b if bias else None, ref[1], t, fn)
    for g, g_r, bound in zip(got[2], ref[2], bounds):
        assert (g is None) == (g_r is None)
        if g is None:
            continue
        assert g.dtype == g_r.dtype
        tol = 4 * torch.finfo(dtype).eps * g_r.abs().max().double() + 4 * torch.finfo(torch.float32).eps * bound
        err = (g.double() - g_r.double()).abs()
        assert bool((err <= tol).all()), f"{float((err - tol).max())} over the rounding bound"


@pytest.mark.parametrize("bias,train_w", [(True, True), (False, True), (False, False)])
@pytest.mark.parametrize("reduction", ("mean", "divisor"))
def test_one_chunk_is_bitwise_a_plain_linear_and_torchs_loss(bias, train_w, reduction, monkeypatch):
    """fp32, the whole gradient in one chunk: the hand-off taken, and dx, dW, db bitwise ``F.linear`` followed by
    ``F.cross_entropy`` (what an unconverted HF model runs), not just within rounding."""
    assert N * V <= LH.ROW_CHUNK_ELEMENTS
    calls = _Calls(monkeypatch)
    h, w, b, t = _data(torch.float32)
    b = b if bias else None
    if reduction == "mean":
        fn, ref_fn = None, (lambda lg: F.cross_entropy(lg.reshape(-1, V), t))
    else:
        fn = (lambda lg: cross_entropy(lg.reshape(-1, V), t, reduction="sum", divisor=torch.tensor(9)))
        ref_fn = (lambda lg: F.cross_entropy(lg.reshape(-1, V), t, reduction="sum") / torch.tensor(9))
    ref = _run(False, h, w, b, t, ref_fn, train_w)
    got = _run(True, h, w, b, t, fn, train_w)
    assert calls.n == 1
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    for g, g_r in zip(got[2], ref[2]):
        assert (g is None) == (g_r is None) and (g is None or torch.equal(g, g_r))


def test_backward_never_allocates_the_logits_gradient(monkeypatch):
    """The largest storage backward makes is one chunk of rows (or the weight's fp32 gradient), never (N, V)."""
    monkeypatch.setattr(LH, "ROW_CHUNK_ELEMENTS", 4 * V)
    monkeypatch.setattr(C, "CHUNK_ELEMENTS", 2 * V)
    h, w, _, t = _data(torch.bfloat16)
    h.requires_grad_()
    for train_w in (False, True):
        w.requires_grad_(train_w)
        loss = cross_entropy(logits_head(h, w, None).reshape(-1, V), t)
        sizes = []

        class Allocs(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                given = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
                for o in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in given:
                        sizes.append(o.untyped_storage().nbytes())  # a new storage (not a view, not in place)
                return out

        with Allocs():
            loss.backward()
        biggest = max(sizes)
        assert biggest <= max(4 * V * 4, V * D * 4 if train_w else 0, N * D * 2), biggest
        assert biggest < N * V * 2


def test_grad_of_the_logits_themselves_is_written_by_the_loss(monkeypatch):
    calls = _Calls(monkeypatch)
    h, w, _, t = _data(torch.float32)
    h.requires_grad_()
    logits = logits_head(h, w, None)
    (g,) = torch.autograd.grad(cross_entropy(logits.reshape(-1, V), t), logits)
    x = F.linear(h, w).detach().requires_grad_()
    (g_r,) = torch.autograd.grad(cross_entropy(x.reshape(-1, V), t), x)
    assert calls.n == 0 and torch.equal(g, g_r)


@pytest.mark.parametrize("watch", ("retain_grad", "hook"))
def test_a_watched_logits_gradient_is_the_real_one(watch, monkeypatch):
    calls = _Calls(monkeypatch)
    h, w, _, t = _data(torch.float32)
    h.requires_grad_()
    logits = logits_head(h, w, None)
    seen = []
    if watch == "retain_grad":
        logits.retain_grad()
    else:
        logits.register_hook(lambda g: seen.append(g.clone()))
    cross_entropy(logits.reshape(-1, V), t).backward()
    x = F.linear(h, w).detach().requires_grad_()
    cross_entropy(x.reshape(-1, V), t).backward()
    assert calls.n == 0
    assert torch.equal(logits.grad if watch == "retain_grad" else seen[0], x.grad)


def test_another_consumer_of_the_logits_adds_its_gradient(monkeypatch):
    calls = _Calls(monkeypatch)
    h, w, b, t = _data(torch.float32)

    def fn(lg):
        return cross_entropy(lg.reshape(-1, V), t) + 0.1 * lg.pow(2).mean()

    ref, got = _run(False, h, w, b, t, fn), _run(True, h, w, b, t, fn)
    assert calls.n == 1
    for g, g_r in zip(got[2], ref[2]):
        torch.testing.assert_close(g, g_r, atol=1e-6, rtol=1e-5)


def test_create_graph_keeps_the_plain_path(monkeypatch):
    calls = _Calls(monkeypatch)
    h, w, _, t = _data(torch.float64)
    h.requires_grad_()
    loss = cross_entropy(logits_head(h, w, None).reshape(-1, V), t)
    (gh,) = torch.autograd.grad(loss, h, create_graph=True)
    x = h.detach().clone().requires_grad_()
    (gh_r,) = torch.autograd.grad(cross_entropy(F.linear(x, w).reshape(-1, V), t), x)
    assert calls.n == 0 and torch.allclose(gh, gh_r)


def test_autocast_casts_like_autocast_linear(monkeypatch):
    calls = _Calls(monkeypatch)
    h, w, b, t = _data(torch.float32)
    out = []
    for fused in (False, True):
        hh, ww, bb = (x.clone().requires_grad_() for x in (h, w, b))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = (logits_head if fused else F.linear)(hh, ww, bb)
            loss = cross_entropy(logits.reshape(-1, V), t)
        loss.backward()
        out.append((logits.dtype, loss.detach(), hh.grad, ww.grad, bb.grad))
    assert calls.n == 1 and out[0][0] == out[1][0] == torch.bfloat16
    torch.testing.assert_close(out[1][1], out[0][1], atol=0, rtol=0)
    for g, g_r in zip(out[1][2:], out[0][2:]):
        assert g.dtype == g_r.dtype == torch.float32
        torch.testing.assert_close(g, g_r, atol=4 * torch.finfo(torch.bfloat16).eps * float(g_r.abs().max()), rtol=0)


@needs_triton
def test_triton_kernels_through_the_hand_off(monkeypatch):
    """CE dispatch forced to Triton (CPU tensors, interpreter): the head's backward runs the kernel per chunk."""
    monkeypatch.setattr(C, "use_triton", lambda x: True)
    monkeypatch.setattr(LH, "ROW_CHUNK_ELEMENTS", 9 * V)
    calls = _Calls(monkeypatch)
    h, w, b, t = _data(torch.bfloat16)
    got = _run(True, h, w, b, t)
    monkeypatch.setattr(C, "use_triton", lambda x: False)
    ref = _run(False, h, w, b, t)
    assert calls.n == 1
    for g, g_r in zip(got[2], ref[2]):
        torch.testing.assert_close(g.float(), g_r.float(), atol=0.02 * float(g_r.abs().max()), rtol=0)


@pytest.mark.parametrize("path", ("torch", pytest.param("triton", marks=needs_triton)))
def test_logits_edited_before_the_heads_backward_raise(path, monkeypatch):
    """The head's fused backward reads the kept logits too: an edit made after the loss's backward handed off
    (here by a hook on another consumer of the logits, which the engine runs in between) raises, as the loss's
    own backward does; under saved-tensor hooks too (autograd's own check is off there)."""
    from lmbp_convert.errors import LogitsModifiedError

    monkeypatch.setattr(C, "use_triton", lambda x: path == "triton")
    calls = _Calls(monkeypatch)
    h, w, _, t = _data(torch.float32)
    h.requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda a: a, lambda a: a):
        logits = logits_head(h, w, None)
        other = logits * 1
        aux = other.sum()
        loss = cross_entropy(logits.reshape(-1, V), t) + 0 * aux

    def edit(g):
        with torch.no_grad():
            logits.mul_(2)

    other.register_hook(edit)
    with pytest.raises(LogitsModifiedError, match="the memory-sharing loss keeps"):
        loss.backward()
    assert calls.n == 1


@pytest.mark.parametrize("tied", (False, True))
@pytest.mark.parametrize("watch", ("prehook", "hook"))
def test_hooks_on_the_heads_node_see_the_real_gradient(watch, tied, monkeypatch):
    """A pre-hook on the head's autograd node that scales the gradient, or a hook that reads it: the loss writes
    its gradient (the plain path), the hook sees the real one, and every gradient below the head is what a plain
    Linear with the same hook gives (the weight tied to an input lookup, or not)."""
    calls = _Calls(monkeypatch)
    h0, w0, _, t = _data(torch.float32)
    out = []
    for fused in (False, True):
        w = w0.clone().requires_grad_()
        emb = torch.randint(0, V, (2, N // 2), generator=torch.Generator().manual_seed(1))
        h = h0 + F.embedding(emb, w) if tied else h0.clone().requires_grad_()
        logits = (logits_head if fused else F.linear)(h, w, None)
        seen = []
        if watch == "prehook":
            logits.grad_fn.register_prehook(lambda g: (seen.append(g[0].clone()), (g[0] * 2,))[1])
        else:
            logits.grad_fn.register_hook(lambda gi, go: seen.append(go[0].clone()))
        cross_entropy(logits.reshape(-1, V), t).backward()
        out.append((seen[0], w.grad, None if tied else h.grad))
    assert calls.n == 0
    (s0, gw0, gh0), (s1, gw1, gh1) = out
    assert torch.equal(s1, s0) and bool(s0.abs().sum() > 0)
    torch.testing.assert_close(gw1, gw0, atol=0, rtol=1e-6)
    if not tied:
        torch.testing.assert_close(gh1, gh0, atol=0, rtol=1e-6)
