"""CUDA-only checks of the ops (skipped without a GPU, and under Triton's interpreter).

Run on a GPU machine with compiled kernels (scripts/gpu_run.sh does this first):

    TRITON_INTERPRET=0 python -m pytest -q tests/ops/test_cuda.py

Compiled Triton kernels against the PyTorch path on the same device (every op, kind and dtype; short,
non-power-of-2, max fused and looped norm rows; strided inputs), the public ops end to end on CUDA (dispatch to
the kernels, autograd, saved bytes, norm → Linear sharing under autocast), the
lean cached launch against Triton's own launch, CUDA-graph capture of eager steps (nothing allocated through a
cache miss or uploaded from the host inside the ops during capture), and torch.compile with inductor, default and
``mode="reduce-overhead"``, on converted models in train mode.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from tolerances import tol

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1",
                                reason="needs a CUDA device and compiled Triton kernels (TRITON_INTERPRET=0)")

DEV = "cuda"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def _same_rounding(a: torch.Tensor, b: torch.Tensor) -> None:
    """One fp32 product and one rounding on both paths; bf16 may still differ by an ulp (fused multiply)."""
    if a.dtype == torch.bfloat16:
        torch.testing.assert_close(a, b, atol=0, rtol=2 ** -7)
    else:
        torch.testing.assert_close(a, b, atol=0, rtol=1e-6)


def _act_inputs(dtype, strided=True):
    """Shapes that cover the kernels' masks and both source layouts (each distinct layout is one compile)."""
    wide = _randn(37, 2 * 333 + 5, dtype=dtype, scale=3.0)
    out = {"37x333": _randn(37, 333, dtype=dtype, scale=3.0), "n=4101": _randn(4101, dtype=dtype, scale=3.0),
           "transposed": _randn(65, 9, dtype=dtype).t()}  # no 2-D view: a contiguous copy
    if strided:
        out["strided half"] = wide[:, 5:338]  # read in place
    return out


# ------------------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ("gelu", "gelu_tanh", "silu", "quick_gelu"))
def test_approx_act_kernels_match_torch_path(kind, dtype):
    from lmbp_convert.ops import approx_act as A

    for name, x in _act_inputs(dtype).items():
        for bits in (2, 4) if dtype == torch.bfloat16 else (2,):  # other widths: the approx-act test below
            y, packed = A._fwd_triton(x, kind, bits)
            y_ref, packed_ref = A._fwd_torch(x, kind, bits)
            assert torch.equal(packed, packed_ref), (name, bits)
            torch.testing.assert_close(y, y_ref, **tol(dtype))
            torch.testing.assert_close(y, _TORCH_ACT[kind](x.float()).to(dtype), **tol(dtype))  # the exact act
            g = torch.randn_like(x)
            _same_rounding(A._bwd_triton(g, packed, bits, kind), A._bwd_torch(g, packed, bits, kind))


_TORCH_ACT = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu,
              "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ("gelu", "gelu_tanh", "silu", "quick_gelu"))
def test_approx_act_op_on_cuda_matches_cpu_and_saves_only_codes(kind, dtype):
    """The public op dispatches to the kernels; values and gradient equal the same op on CPU (its PyTorch path),
    and it keeps only the packed codes for backward."""
    from lmbp_convert import SavedTensorLedger
    from lmbp_convert.ops import approx_act as A

    x = _randn(64, 1000, dtype=dtype, scale=3.0).requires_grad_(True)
    g = _randn(64, 1000, dtype=dtype)
    assert A.use_triton(x)
    with SavedTensorLedger() as ledger:
        y = A.approx_act(x, kind, 2)
    (dx,) = torch.autograd.grad(y, x, g)
    xc = x.detach().cpu().requires_grad_(True)
    yc = A.approx_act(xc, kind, 2)
    (dxc,) = torch.autograd.grad(yc, xc, g.cpu())
    torch.testing.assert_close(y.cpu(), yc, **tol(dtype))
    torch.testing.assert_close(dx.cpu(), dxc, **tol(dtype, "bwd"))
    assert ledger.bytes == A.packed_nbytes(x.numel(), 2)


@pytest.mark.parametrize("bits", (1, 2, 3))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_approx_act_kernels_match_torch_path_at_every_width(bits, dtype):
    from lmbp_convert.ops import approx_act as A

    for name, x in _act_inputs(dtype, strided=False).items():  # the strided source path: the test above
        y_ref, packed_ref = A._fwd_torch(x, "gelu", bits)
        y, packed = A._fwd_triton(x, "gelu", bits)
        assert torch.equal(packed, packed_ref), name
        torch.testing.assert_close(y, y_ref, **tol(dtype))
        g = torch.randn_like(x)
        dx_ref = A._bwd_torch(g, packed_ref, bits, "gelu")
        _same_rounding(A._bwd_triton(g, packed_ref, bits, "gelu"), dx_ref)


@pytest.mark.parametrize("is_rms", (False, True))
@pytest.mark.parametrize("dtype", DTYPES)
def test_ms_norm_kernels_match_torch_path(is_rms, dtype):
    from lmbp_convert.ops import ms_norm as N

    # tiny, typical, non-power-of-2, the max fused row (16384), looped rows just past it / long / odd, and the
    # looped kernel forced on a short row
    for rows, n, chunk in ((37, 33, None), (16, 768, None), (8, 4096, None), (6, 5120, None), (4, 16384, None),
                           (3, 16385, None), (3, 20000, None), (2, 65536 + 7, None), (5, 300, 64)):
        x = _randn(rows, n, dtype=dtype, scale=2.0) + 0.5
        for out_dtype in {dtype, torch.bfloat16}:
            y, r = N._fwd_triton(x, n, 1e-5, is_rms, out_dtype, chunk=chunk)
            y_ref, r_ref = N._fwd_torch(x, n, 1e-5, is_rms, out_dtype)
            torch.testing.assert_close(y, y_ref, **tol(out_dtype))
            torch.testing.assert_close(r, r_ref, rtol=1e-5, atol=1e-6)
        g = torch.randn_like(x)
        dx = N._bwd_triton(g, y_ref, r_ref, is_rms, dtype, chunk=chunk)
        torch.testing.assert_close(dx, N._bwd_torch(g, y_ref, r_ref, is_rms, dtype), **tol(dtype, "bwd"))


@pytest.mark.parametrize("is_rms", (False, True))
@pytest.mark.parametrize("dtype", DTYPES)
def test_ms_norm_kernels_read_strided_rows(is_rms, dtype):
    """Rows that are a slice of a wider tensor are read in place."""
    from lmbp_convert.ops import ms_norm as N

    xs, gs = _randn(9, 1100, dtype=dtype, scale=2.0)[:, 13:1013], _randn(9, 1100, dtype=dtype)[:, 50:1050]
    y, r = N._fwd_triton(xs, 1000, 1e-5, is_rms, dtype)
    y_ref, r_ref = N._fwd_torch(xs, 1000, 1e-5, is_rms, dtype)
    torch.testing.assert_close(y, y_ref, **tol(dtype))
    torch.testing.assert_close(r, r_ref, rtol=1e-5, atol=1e-6)
    dx = N._bwd_triton(gs, y_ref, r_ref, is_rms, dtype)
    torch.testing.assert_close(dx, N._bwd_torch(gs, y_ref, r_ref, is_rms, dtype), **tol(dtype, "bwd"))


@pytest.mark.parametrize("n", (4096, 20000))
@pytest.mark.parametrize("is_rms", (False, True))
def test_ms_norm_op_on_cuda_matches_torch_norm(is_rms, n):
    """The public op (fused and looped kernel) against torch's own norm, values and input gradient (fp32)."""
    from lmbp_convert.ops import ms_norm as N

    eps = 1e-6 if is_rms else 1e-5
    x = (_randn(6, n, scale=2.0) + 0.3).requires_grad_(True)
    g = _randn(6, n)
    assert N.use_triton(x)
    y = (N.ms_rms_norm if is_rms else N.ms_layer_norm)(x, n, eps)
    (dx,) = torch.autograd.grad(y, x, g)
    xr = x.detach().requires_grad_(True)
    yr = F.rms_norm(xr, (n,), eps=eps) if is_rms else F.layer_norm(xr, (n,), eps=eps)
    (dxr,) = torch.autograd.grad(yr, xr, g)
    torch.testing.assert_close(y, yr, **tol(torch.float32))
    torch.testing.assert_close(dx, dxr, **tol(torch.float32, "bwd"))


@pytest.mark.parametrize("is_rms", (False, True))
def test_ms_norm_shares_its_output_with_the_next_linear_under_autocast(is_rms):
    """norm → Linear under bf16 autocast on CUDA keeps one activation storage (the norm's bf16 output, which the
    Linear saves as its input) plus the fp32 rstd: the pair keeps what the norm alone keeps."""
    from lmbp_convert import SavedTensorLedger
    from lmbp_convert.ops import ms_norm as N

    fn = N.ms_rms_norm if is_rms else N.ms_layer_norm
    lin = torch.nn.Linear(1024, 256, device=DEV)
    x = _randn(64, 1024).requires_grad_(True)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        with SavedTensorLedger(lin) as alone:
            y = fn(x, 1024)
        with SavedTensorLedger(lin) as pair:
            out = lin(fn(x, 1024))
    assert y.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
    assert alone.bytes == pair.bytes == y.numel() * 2 + 64 * 4


@pytest.mark.parametrize("act", ("silu", "gelu", "gelu_tanh"))
def test_gated_mlp_op_on_cuda_matches_eager(act, monkeypatch):
    """The fused gated MLP op against the eager maths Linear(act(g)·u): output and every gradient (fp32)."""
    from lmbp_convert.ops import gated_mlp as G

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    fa = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act]
    g, u = _randn(64, 512, scale=2.0).requires_grad_(True), _randn(64, 512).requires_grad_(True)
    w, b = (_randn(128, 512) * 512 ** -0.5).requires_grad_(True), _randn(128).requires_grad_(True)
    dy = _randn(64, 128)
    out = G.gated_mlp(g, u, w, b, act)
    ref = F.linear(fa(g) * u, w, b)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    for a, e in zip(torch.autograd.grad(out, (g, u, w, b), dy), torch.autograd.grad(ref, (g, u, w, b), dy)):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ("silu", "gelu", "gelu_tanh"))
def test_gated_kernels_match_torch_path(act, dtype):
    from lmbp_convert.ops import gated_mlp as G

    for rows, f in ((37, 333), (8, 4096), (11, 2000)):
        gu = _randn(rows, 2 * f, dtype=dtype, scale=2.0)
        g, u = gu[:, :f], gu[:, f:]  # the halves of a fused gate_up projection, read in place
        torch.testing.assert_close(G._fwd_triton(g, u, act, dtype), G._fwd_torch(g, u, act, dtype), **tol(dtype))
        dh = _randn(rows, f, dtype=dtype)
        ref = G._bwd_torch(dh, g, u, act, dtype)
        got = G._bwd_triton(dh.clone(), g, u, act, dtype, dg_into_dh=True)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, **tol(dtype, "bwd"))
        assert torch.equal(got[2], G._fwd_triton(g, u, act, dtype))  # the recomputed h is the forward's


def test_cached_launch_equals_tritons_own_launch():
    from lmbp_convert.ops import approx_act as A
    from lmbp_convert.ops import ms_norm as N

    x = _randn(64, 1000, dtype=torch.bfloat16, scale=3.0)
    for k in (A._FWD, N._FWD):
        k.cache.clear()
    y1, p1 = A._fwd_triton(x, "silu", 2)  # Triton's launch path, fills the cache
    r1 = N._fwd_triton(x, 1000, 1e-5, False, x.dtype)
    assert A._FWD.cache and N._FWD.cache
    y2, p2 = A._fwd_triton(x, "silu", 2)  # the cached launcher
    r2 = N._fwd_triton(x, 1000, 1e-5, False, x.dtype)
    assert torch.equal(y1, y2) and torch.equal(p1, p2)
    assert torch.equal(r1[0], r2[0]) and torch.equal(r1[1], r2[1])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the current stream is honoured
        y3, _ = A._fwd_triton(x, "silu", 2)
    torch.cuda.synchronize()
    assert torch.equal(y1, y3)


# ------------------------------------------------------------------------------------------- CUDA graphs
class _Block(torch.nn.Module):
    """Every op once: MS norms, approximate activation, gated MLP (fused and plain tail)."""

    def __init__(self, d=64, f=128):
        super().__init__()
        from lmbp_convert.nn.activations import ApproxActivation
        from lmbp_convert.nn.norms import MSLayerNorm, MSRMSNorm

        self.ln, self.rms = MSLayerNorm(d), MSRMSNorm(d)
        self.up, self.gate_up, self.down = torch.nn.Linear(d, f), torch.nn.Linear(d, 2 * f), torch.nn.Linear(f, d)
        self.act = ApproxActivation("gelu", 2)

    def forward(self, x):
        from lmbp_convert.ops.gated_mlp import gated_act, gated_mlp

        h = self.down(self.act(self.up(self.ln(x))))
        g, u = self.gate_up(self.rms(x + h)).chunk(2, dim=-1)
        return gated_mlp(g, u, self.down.weight, self.down.bias, "silu") + self.down(gated_act(g, u, "gelu"))


def _grads(model, x):
    out = model(x)
    out.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out.detach().clone(), grads


def test_eager_step_captures_in_a_cuda_graph():
    """make_graphed_callables captures forward and backward through our autograd Functions and launchers."""
    torch.manual_seed(0)
    model = _Block().to(DEV)
    x = _randn(4, 16, 64, scale=2.0)
    ref_out, ref_grads = _grads(model, x)
    graphed = torch.cuda.make_graphed_callables(copy.deepcopy(model), (x.clone().requires_grad_(False),))
    for _ in range(2):  # replays
        out, grads = _grads(graphed, x)
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_torch_backward_uploads_nothing_during_capture():
    """The PyTorch backward off the CPU (double backward, fp64) builds its slope table on the device from
    scalars: capturing it cold works (a host-to-device copy would make the capture fail), and the table made
    inside the capture is not kept."""
    from lmbp_convert.ops import approx_act as A

    x = _randn(32, 100, scale=3.0)
    _, packed = A._fwd_torch(x, "silu", 3)
    g = torch.randn_like(x)
    expected = A._bwd_torch(g.cpu(), packed.cpu(), 3, "silu").to(DEV)
    A._bwd_torch(g, packed, 3, "silu")  # load the CUDA kernels involved (not the table: it is dropped next)
    torch.cuda.synchronize()
    A._DEVICE_SLOPE_TABLES.clear()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        dx = A._bwd_torch(g, packed, 3, "silu")
    assert not A._DEVICE_SLOPE_TABLES
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(dx, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------- torch.compile
def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters
    return counters["inductor"]["cudagraph_skips"]


@pytest.mark.parametrize("mode", ("default", "reduce-overhead"))
def test_compiled_block_matches_eager(mode):
    """Inductor emits our kernels itself (triton_ops) with fullgraph=True; reduce-overhead CUDA-graphs the whole
    step (no skip for an op that allocates, uploads or syncs)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Block().to(DEV)
    x = _randn(4, 16, 64, scale=2.0)
    ref_out, ref_grads = _grads(model, x)
    skips = _cudagraph_skips()
    compiled = torch.compile(copy.deepcopy(model), fullgraph=True, mode=mode)
    for _ in range(3):
        out, grads = _grads(compiled, x)
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    assert _cudagraph_skips() == skips
    torch._dynamo.reset()


def _family(name):
    from testsupport.families import hf, timm_vit

    b, t = 2, 16
    gen = torch.Generator().manual_seed(0)
    if name == "llama":
        ids = torch.randint(0, 128, (b, t), generator=gen).to(DEV)
        return hf("llama", num_hidden_layers=1), lambda m: m(input_ids=ids, labels=ids).loss
    if name == "bert":
        ids = torch.randint(0, 128, (b, t), generator=gen).to(DEV)
        labels = torch.tensor([0, 1], device=DEV)
        model = hf("bert", head="cls", num_hidden_layers=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return model, lambda m: m(input_ids=ids, labels=labels).loss
    x = torch.randn(b, 3, 32, 32, generator=gen).to(DEV)
    return timm_vit(), lambda m: m(x).square().mean()


@pytest.mark.parametrize("family", ("llama", "vit", "bert"))
def test_converted_model_trains_under_reduce_overhead(family):
    """A converted model's training step under torch.compile(mode="reduce-overhead", fullgraph=True): same
    losses as eager over SGD steps, and the step is CUDA-graphed (no cudagraph skip)."""
    from lmbp_convert import convert

    torch._dynamo.reset()
    model, loss_fn = _family(family)
    convert(model)
    model.to(DEV).train()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    skips = _cudagraph_skips()
    losses = {}
    for name, m, run in (("eager", eager, eager), ("compiled", model, compiled)):
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        losses[name] = []
        for _ in range(4):
            loss = loss_fn(run)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    torch.testing.assert_close(torch.tensor(losses["compiled"]), torch.tensor(losses["eager"]), rtol=1e-3, atol=1e-4)
    assert _cudagraph_skips() == skips
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------ cross-entropy
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", (37, 4096, 16032))
def test_cross_entropy_kernels_match_the_pytorch_path(dtype, v):
    """Compiled kernels (dispatched by the public op on CUDA) against the PyTorch path on the same device: loss
    to fp32 rounding, the one gradient in the logits' dtype to one rounding, saved bytes exact."""
    from lmbp_convert.memory import SavedTensorLedger
    from lmbp_convert.ops import cross_entropy as CE

    x = _randn(300, v, dtype=dtype, scale=3).requires_grad_()
    t = torch.randint(0, v, (300,), device=DEV)
    t[::7] = -100
    with SavedTensorLedger() as ledger:
        loss = CE.cross_entropy(x, t, reduction="sum", divisor=211)
    assert ledger.bytes == 300 * v * x.element_size() + 300 * 4 + 300 * 8
    (g,) = torch.autograd.grad(loss, x)
    loss_p, lse_p = CE._fwd_torch(x.detach(), t, -100)
    torch.testing.assert_close(loss, loss_p.sum() / 211, atol=1e-5, rtol=1e-5)
    g_p = CE._bwd_torch(torch.full((300,), 1 / 211, device=DEV), x.detach(), t, lse_p, -100)
    assert g.dtype == dtype
    torch.testing.assert_close(g.float(), g_p.float(), atol=2 * torch.finfo(dtype).eps * float(g_p.abs().max()),
                               rtol=0)
