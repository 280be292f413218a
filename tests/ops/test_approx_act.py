"""approx_act: exact forward, k-bit step-derivative backward, only packed codes saved.

The PyTorch path is checked against torch's own activations and an independent step derivative (explicit sum
over thresholds in float64); the Triton launchers run on CPU tensors under TRITON_INTERPRET=1 and must give
the same codes bit for bit.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from approx_reference import step_derivative
from tolerances import tol
from torch import nn

from lmbp_convert.memory import SavedTensorLedger
from lmbp_convert.ops import approx_act as M
from lmbp_convert.ops import approx_codes
from lmbp_convert.ops._common import HAS_TRITON
from lmbp_convert.ops.approx_act import ACT_KINDS, approx_act, get_constants, pack_codes, packed_nbytes, unpack_codes

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
# The interpreter evaluates kernels with numpy, which warns on inf/nan arithmetic the tests feed on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

REF = {
    "gelu": lambda x: F.gelu(x),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _inputs(shape, dtype, scale=4.0):
    """Random inputs kept >= 1e-3 away from every threshold of every table (so the float64 reference
    derivative and the op's compares in the compute dtype cannot disagree), plus a few exact zeros."""
    x = torch.randn(*shape, dtype=torch.float64) * scale
    cs = torch.tensor(sorted({c for k in ACT_KINDS for b in (1, 2, 3, 4) for c in get_constants(k, b).c}),
                      dtype=torch.float64)
    for _ in range(3):
        near = (x[..., None] - cs).abs().min(-1)
        push = near.values < 1e-3
        x = torch.where(push, cs[near.indices] + 2e-3 * torch.sign(x - cs[near.indices] + 1e-12), x)
    x = x.to(dtype)
    if x.numel() > 3:
        x.view(-1)[1] = 0.0
    return x


# ------------------------------------------------------------------------------------------ constants & layout
def test_paper_constants_used_for_2bit_gelu_and_silu():
    g, s = get_constants("gelu", 2), get_constants("silu", 2)
    assert g.a == (-0.04922261145617846, 1.0979632065417297, -0.048740595085551286)
    assert g.c == (-3.1858810036855245, -0.001178821281161997, 3.190832613414926)
    assert s.a == (-0.04060357190528599, 1.080925428529668, -0.040321856624382146)
    assert s.c == (-6.3050461001646445, -0.0008684942046214787, 6.325815242089708)
    assert g.source.startswith("paper") and s.source.startswith("paper")


@pytest.mark.parametrize("kind", ACT_KINDS)
@pytest.mark.parametrize("bits", (1, 2, 3, 4))
def test_slope_table_is_cumulative_sum_of_a(kind, bits):
    const = get_constants(kind, bits)
    assert len(const.c) == 2**bits - 1 and list(const.c) == sorted(const.c)
    assert len(const.slopes) == 2**bits
    assert const.slopes[0] == 0.0
    assert const.slopes[-1] == pytest.approx(1.0, abs=1e-12)
    for j in range(1, 2**bits):
        assert const.slopes[j] == pytest.approx(sum(const.a[:j]), abs=1e-15)


def test_pack_layout_is_low_slot_first():
    codes = torch.tensor([1, 2, 3, 0, 1], dtype=torch.uint8)
    assert pack_codes(codes, 2).tolist() == [1 | 2 << 2 | 3 << 4, 1]
    assert pack_codes(torch.tensor([1, 0, 1, 1, 0, 0, 0, 1, 1], dtype=torch.uint8), 1).tolist() == [0b10001101, 1]
    assert pack_codes(torch.tensor([5, 7, 6], dtype=torch.uint8), 3).tolist() == [5 | 7 << 4, 6]  # 4-bit slots
    assert pack_codes(torch.tensor([15, 9, 3], dtype=torch.uint8), 4).tolist() == [15 | 9 << 4, 3]


@pytest.mark.parametrize("bits", (1, 2, 3, 4))
@pytest.mark.parametrize("n", (0, 1, 3, 4, 5, 9, 37))
def test_pack_unpack_roundtrip(bits, n):
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    per_byte = 2 if bits == 3 else 8 // bits
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / per_byte) == packed_nbytes(n, bits)
    assert torch.equal(unpack_codes(packed, n, bits), codes)


# ------------------------------------------------------------------------------------------ forward
@pytest.mark.parametrize("kind", ACT_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_torch_reference(kind, dtype):
    x = _inputs((4, 33), dtype)
    y = approx_act(x.requires_grad_(), kind, 2)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y, REF[kind](x.detach()), **tol(dtype))


@pytest.mark.parametrize("kind", ACT_KINDS)
def test_forward_without_grad_matches_and_saves_nothing(kind):
    x = _inputs((5, 7), torch.float32)
    with SavedTensorLedger() as ledger:
        y0 = approx_act(x, kind, 3)  # x does not require grad
    assert ledger.count == 0 and y0.grad_fn is None
    assert torch.equal(y0, approx_act(x.clone().requires_grad_(), kind, 3).detach())


# ------------------------------------------------------------------------------------------ backward
@pytest.mark.parametrize("kind", ACT_KINDS)
@pytest.mark.parametrize("bits", (1, 2, 3, 4))
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_is_grad_timesstep_derivative(kind, bits, dtype):
    x = _inputs((3, 29), dtype).requires_grad_()
    g = torch.randn(3, 29, dtype=dtype)
    approx_act(x, kind, bits).backward(g)
    expected = (g.double() * step_derivative(x.detach(), kind, bits)).to(dtype)
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad, expected, **tol(dtype, "bwd"))


def test_backward_differs_from_exact_derivative_as_a_step_function():
    """Guards against silently using the exact derivative: between thresholds the gradient is constant."""
    x = torch.tensor([-1.0, -0.5, 0.5, 1.0, 2.0], requires_grad=True)
    approx_act(x, "gelu", 2).sum().backward()
    a = get_constants("gelu", 2).a
    assert torch.allclose(x.grad, torch.tensor([a[0], a[0], a[0] + a[1], a[0] + a[1], a[0] + a[1]]))


def test_double_backward_through_torch_path():
    x = _inputs((2, 9), torch.float64).requires_grad_()
    g = torch.randn(2, 9, dtype=torch.float64, requires_grad=True)
    y = approx_act(x, "silu", 2)
    (dx,) = torch.autograd.grad(y, x, g, create_graph=True)
    (dg,) = torch.autograd.grad(dx.sum(), g)
    torch.testing.assert_close(dg, step_derivative(x.detach(), "silu", 2))


# ------------------------------------------------------------------------------------------ memory
@pytest.mark.parametrize("bits", (1, 2, 3, 4))
@pytest.mark.parametrize("n", (1, 6, 37, 1000))
def test_saves_only_packed_codes(bits, n):
    x = torch.randn(n, requires_grad=True)
    with SavedTensorLedger() as ledger:
        y = approx_act(x, "gelu", bits)
    per_byte = {1: 8, 2: 4, 3: 2, 4: 2}[bits]
    assert ledger.count == 1, ledger.summary()
    assert ledger.entries[0].dtype == torch.uint8
    assert ledger.bytes == math.ceil(n / per_byte)
    if bits == 2:
        assert ledger.bytes == -(-n // 4)
    y.sum().backward()


@pytest.mark.parametrize("kind", ("gelu", "silu"))
def test_linear_act_linear_under_bf16_autocast_shares_the_output(kind):
    """Saved: the first Linear's bf16 input copy, the codes, and the act output (which the second Linear
    saves as its input: bf16 already, so autocast makes no copy)."""
    lin1, lin2 = nn.Linear(24, 40), nn.Linear(40, 8)
    model = nn.Sequential(lin1, _Act(kind), lin2)
    x = torch.randn(6, 24)
    acts = []
    model[1].register_forward_hook(lambda m, i, o: acts.append(o))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with SavedTensorLedger(model) as ledger:
            out = model(x)
        saved = []  # second pass: which storages are saved (hooks do not nest, so not inside the ledger)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            model(x)
    assert acts[0].dtype == torch.bfloat16 and out.dtype == torch.bfloat16
    got = sorted((str(e.dtype), e.nbytes) for e in ledger.entries)
    want = sorted([("torch.bfloat16", 6 * 24 * 2), ("torch.uint8", 6 * 40 // 4), ("torch.bfloat16", 6 * 40 * 2)])
    assert got == want, ledger.summary()
    ptrs = {t.untyped_storage().data_ptr() for t in saved}
    assert acts[1].untyped_storage().data_ptr() in ptrs  # the very output tensor, not a copy
    out.float().sum().backward()
    assert lin1.weight.grad is not None and torch.isfinite(lin1.weight.grad).all()


class _Act(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        return approx_act(x, self.kind, 2)


# ------------------------------------------------------------------------------------------ edge cases
@pytest.mark.parametrize("backend", ("torch", pytest.param("triton", marks=needs_triton)))
@pytest.mark.parametrize("shape", ((0,), (0, 5), (3, 0, 2)))
def test_empty(backend, shape):
    x = torch.empty(shape, requires_grad=True)
    with SavedTensorLedger() as ledger:
        y = approx_act(x, "gelu", 2, backend=backend)
    assert y.shape == x.shape and ledger.bytes == 0
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("backend", ("torch", pytest.param("triton", marks=needs_triton)))
@pytest.mark.parametrize("kind", ACT_KINDS)
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_nan_and_inf(backend, kind, dtype):
    x = torch.tensor([math.inf, -math.inf, math.nan, 1.0], dtype=dtype, requires_grad=True)
    y = approx_act(x, kind, 2, backend=backend)
    assert y[0].item() == math.inf  # the true limit (ATen's vectorised fp32/bf16 CPU gelu says nan here)
    assert math.isnan(y[1].item()) and math.isnan(y[2].item())  # -inf * 0, as every torch reference gives
    ref = REF[kind](x.detach()[1:])
    torch.testing.assert_close(y[1:].detach(), ref, equal_nan=True, **tol(dtype))
    g = torch.full((4,), 2.0, dtype=dtype)
    y.backward(g)
    const = get_constants(kind, 2)
    assert x.grad[0].item() == pytest.approx(2.0 * const.slopes[-1], rel=1e-2)  # +inf: sum(a) = 1
    assert x.grad[1].item() == 0.0  # -inf: below every threshold
    assert x.grad[2].item() == 0.0  # nan: code 0 (documented; the exact derivative would be nan)


@pytest.mark.parametrize("dtype", (torch.int32, torch.int64, torch.bool, torch.complex64))
def test_bad_dtype(dtype):
    x = torch.zeros(4, dtype=dtype)
    with pytest.raises(TypeError, match=str(dtype).replace("torch.", "")):
        approx_act(x, "gelu", 2)


def test_bad_kind_bits_backend():
    x = torch.randn(3)
    with pytest.raises(ValueError, match="relu"):
        approx_act(x, "relu", 2)
    for bits in (0, 5, 2.0, True):
        with pytest.raises(ValueError, match="bits"):
            approx_act(x, "gelu", bits)
    with pytest.raises(ValueError, match="backend"):
        approx_act(x, "gelu", 2, backend="cuda")


@needs_triton
def test_triton_rejects_float64():
    with pytest.raises(TypeError, match="float64"):
        approx_act(torch.randn(3, dtype=torch.float64), "gelu", 2, backend="triton")


# ------------------------------------------------------------------------------------------ Triton launchers
def _triton_cases():
    t = torch.randn(3, 4, 2 * 11)
    return {
        "n=1": torch.randn(1),
        "n=7": torch.randn(7),
        "2x13": torch.randn(2, 13),
        "n=4101": torch.randn(4101),  # three programs at every width
        "gate_half": t[..., :11],  # strided rows read in place
        "up_half": t[..., 11:],
        "transposed": torch.randn(9, 5).t(),  # no 2-D view: contiguous copy
        "scalar": torch.randn(()),
    }


@needs_triton
@pytest.mark.parametrize("case", list(_triton_cases()))
@pytest.mark.parametrize("kind", ACT_KINDS)
def test_triton_forward_matches_torch_path(case, kind):
    base = _triton_cases()[case]
    for dtype in TRITON_DTYPES:
        for bits in (1, 2, 3, 4):
            x = (base * 4).to(dtype)
            y_t, p_t = M._fwd_triton(x, kind, bits)
            y_r, p_r = M._fwd_torch(x, kind, bits)
            assert p_t.dtype == torch.uint8 and p_t.numel() == packed_nbytes(x.numel(), bits)
            assert torch.equal(p_t, p_r), (dtype, bits)
            assert y_t.dtype == dtype and y_t.shape == x.shape
            torch.testing.assert_close(y_t, y_r, **tol(dtype))


def _assert_same_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """grad * slope is one fp32 product and one rounding in both paths: bit-identical for fp32/fp16. The
    interpreter's fp32->bf16 cast truncates (GPUs round to nearest even), so bf16 may differ by one ulp."""
    if actual.dtype == torch.bfloat16:
        torch.testing.assert_close(actual, expected, atol=0, rtol=2**-7)
    else:
        assert torch.equal(actual, expected)


@needs_triton
@pytest.mark.parametrize("case", list(_triton_cases()))
def test_triton_backward_matches_torch_path(case):
    base = _triton_cases()[case]
    for dtype in TRITON_DTYPES:
        for kind, bits in (("gelu", 2), ("silu", 1), ("gelu_tanh", 3), ("quick_gelu", 4)):
            x = (base * 4).to(dtype)
            _, packed = M._fwd_torch(x, kind, bits)
            g = torch.randn(x.shape).to(dtype)
            dx_t = M._bwd_triton(g, packed, bits, kind)
            dx_r = M._bwd_torch(g, packed, bits, kind)
            assert dx_t.dtype == dtype and dx_t.shape == x.shape
            _assert_same_rounding(dx_t, dx_r)


@needs_triton
def test_triton_backward_reads_strided_and_expanded_grads():
    x = torch.randn(6, 10) * 4
    _, packed = M._fwd_torch(x, "gelu", 2)
    wide = torch.randn(6, 20)
    for g in (wide[:, 5:15], torch.ones(()).expand(6, 10), torch.randn(10, 6).t()):
        torch.testing.assert_close(M._bwd_triton(g, packed, 2, "gelu"), M._bwd_torch(g, packed, 2, "gelu"),
                                   rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_triton_autograd_end_to_end(dtype):
    t = (torch.randn(4, 2 * 9) * 4).to(dtype)
    grads = {}
    for backend in ("torch", "triton"):
        base = t.clone().requires_grad_()
        x = base[:, :9]  # the gate half of a fused projection
        with SavedTensorLedger() as ledger:
            y = approx_act(x, "silu", 2, backend=backend)
        assert ledger.count == 1 and ledger.bytes == math.ceil(36 / 4)
        y.backward(torch.linspace(-1, 1, 36).view(4, 9).to(dtype))
        grads[backend] = (y.detach(), base.grad)
    torch.testing.assert_close(grads["triton"][0], grads["torch"][0], **tol(dtype))
    _assert_same_rounding(grads["triton"][1], grads["torch"][1])


@needs_triton
def test_triton_backward_falls_back_for_create_graph():
    x = _inputs((3, 5), torch.float32).requires_grad_()
    g = torch.randn(3, 5, requires_grad=True)
    (dx,) = torch.autograd.grad(approx_act(x, "gelu", 2, backend="triton"), x, g, create_graph=True)
    (dg,) = torch.autograd.grad(dx.sum(), g)
    torch.testing.assert_close(dg, step_derivative(x.detach(), "gelu", 2).float())


# ------------------------------------------------------------------------------------------ torch.compile
def _block_grads(fn, lin1, lin2, x):
    for p in (*lin1.parameters(), *lin2.parameters()):
        p.grad = None
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.square().sum().backward()
    return y.detach(), [x.grad, lin1.weight.grad, lin1.bias.grad, lin2.weight.grad]


@pytest.mark.parametrize("backend", ("torch", pytest.param("triton", marks=needs_triton)))
def test_compile_matches_eager(backend):
    """CPU: the PyTorch path traces into one graph; 'triton' exercises the custom-op registration (fake
    impls under dynamo, kernels under the interpreter). fullgraph=True: no graph breaks allowed."""
    torch._dynamo.reset()
    lin1, lin2 = nn.Linear(8, 20), nn.Linear(20, 4)

    def block(x):
        return lin2(approx_act(lin1(x), "gelu", 2, backend=backend))

    x = torch.randn(3, 5, 8)
    y_e, g_e = _block_grads(block, lin1, lin2, x)
    y_c, g_c = _block_grads(torch.compile(block, fullgraph=True), lin1, lin2, x)
    torch.testing.assert_close(y_c, y_e, **tol(torch.float32))
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, **tol(torch.float32, "bwd"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_device_slope_table_equals_the_cpu_table(dtype):
    """The slope table built on a device from Python scalars (no host-to-device copy, so CUDA-graph capture
    works) holds exactly the CPU table's values: both backward paths give bit-identical gradients."""
    from lmbp_convert.ops import approx_act as A

    for (kind, bits), const in A._CONSTANTS.items():
        built = A._slope_table_on(const, dtype, torch.device("cpu"))
        assert torch.equal(built, A._SLOPE_TABLES[((kind, bits), dtype)]), (kind, bits)


# ------------------------------------------------------------------------------ default dispatch, Triton
@needs_triton
@pytest.mark.parametrize("kind", ("gelu", "silu"))
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_default_dispatch_on_the_triton_path(kind, dtype, monkeypatch):
    """What a converted model calls (`approx_act_unchecked`, no backend) on a tensor routed to Triton (CUDA in
    production; CPU under the interpreter here): the eager hot path gives the PyTorch path's values and
    gradients, saves only the codes, takes the PyTorch backward for double backward, and keeps nothing
    without grad."""
    monkeypatch.setattr(M, "use_triton", lambda t: t.dtype in TRITON_DTYPES)
    x = _inputs((6, 37), dtype).requires_grad_()  # 222 elements: a partial last code byte
    go = torch.randn(6, 37, dtype=dtype)
    with SavedTensorLedger() as ledger:
        y = M.approx_act_unchecked(x, kind, 2)
    assert type(y.grad_fn).__name__.startswith("_TritonApproxAct")  # the hot path ran
    assert ledger.count == 1 and ledger.bytes == packed_nbytes(x.numel(), 2)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = M.approx_act(x_ref, kind, 2, backend="torch")
    torch.testing.assert_close(y, y_ref, **tol(dtype))
    (dx,) = torch.autograd.grad(y, x, go)
    (dx_ref,) = torch.autograd.grad(y_ref, x_ref, go)
    torch.testing.assert_close(dx, dx_ref, **tol(dtype))
    # double backward: the first-order gradient is differentiable through the PyTorch path
    y2 = M.approx_act_unchecked(x, kind, 2)
    g = go.clone().requires_grad_()
    (dx2,) = torch.autograd.grad(y2, x, g, create_graph=True)
    torch.testing.assert_close(dx2, dx_ref, **tol(dtype))
    (dgo,) = torch.autograd.grad(dx2.sum(), g)  # d(g·slope)/dg: the slopes themselves
    (slopes,) = torch.autograd.grad(M.approx_act(x_ref, kind, 2, backend="torch"), x_ref, torch.ones_like(go))
    torch.testing.assert_close(dgo, slopes, **tol(dtype))
    with torch.no_grad(), SavedTensorLedger() as ledger:
        y0 = M.approx_act_unchecked(x, kind, 2)
    assert ledger.count == 0 and y0.grad_fn is None
    torch.testing.assert_close(y0, y_ref.detach(), **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [2, 3])
def test_torch_backward_in_chunks_is_bitwise_the_whole_and_holds_a_chunk(dtype, bits, monkeypatch):
    """The eager PyTorch backward (no C++ kernel: a dispatch mode, no compiler) runs in chunks of BWD_CHUNK
    elements: the same bits as one pass, and its compute-dtype temporaries cover one chunk."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lmbp_convert.ops.backends import cpu_native

    n, chunk = 10_000 + 3, 1024
    g = torch.randn(n // 7 + 1, 7, generator=torch.Generator().manual_seed(0)).to(dtype).view(-1)[:n].view(n, 1)
    per = 8 // (4 if bits == 3 else bits)
    packed = torch.randint(0, 256, (-(-n // per),), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))

    class Allocations(TorchDispatchMode):
        sizes: list = []
        seen = {g.untyped_storage().data_ptr(), packed.untyped_storage().data_ptr()}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                ptr = out.untyped_storage().data_ptr()
                if ptr not in Allocations.seen:  # a new storage, not a view of one
                    Allocations.seen.add(ptr)
                    Allocations.sizes.append(out.untyped_storage().nbytes())
            return out

    with cpu_native.disabled():
        whole = M._bwd_torch(g, packed, bits, "gelu")
        monkeypatch.setattr(approx_codes, "BWD_CHUNK", chunk)
        with Allocations():
            chunked = M._bwd_torch(g, packed, bits, "gelu")
    assert torch.equal(chunked, whole) and chunked.shape == g.shape and chunked.dtype == dtype
    sizes = sorted(Allocations.sizes)
    assert sizes[-1] == n * g.element_size() and sizes[-2] <= chunk * 4  # the result; one chunk's fp32 slopes


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_torch_forward_in_chunks_packs_the_same_codes(bits, monkeypatch):
    """The eager PyTorch forward packs its codes chunk by chunk (whole packed words): the same bytes."""
    from lmbp_convert.ops.backends import cpu_native

    x = torch.randn(10_000 + 5, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with cpu_native.disabled():
        y, whole = M._fwd_torch(x, "gelu", bits)
        monkeypatch.setattr(approx_codes, "BWD_CHUNK", 1000)
        y2, chunked = M._fwd_torch(x, "gelu", bits)
    assert torch.equal(y, y2) and torch.equal(chunked, whole) and chunked.dtype == torch.uint8
