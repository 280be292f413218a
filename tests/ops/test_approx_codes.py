"""approx_codes under torch.compile: the forms the PyTorch path traces in (`_counted_codes`, `spread_codes`,
`_bwd_traced`) are bitwise the eager codes and gradients, the traced graphs hold no gather and no uint8 sums
(what inductor's CPU code cannot vectorise), and a compiled step keeps only the packed codes."""
from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from tolerances import tol
from torch._dynamo.backends.common import aot_autograd

from lmbp_convert.memory import SavedTensorLedger
from lmbp_convert.ops import approx_codes as A
from lmbp_convert.ops.backends import cpu_native
from lmbp_convert.ops.approx_act import ACT_KINDS, approx_act, packed_nbytes, unpack_codes

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SPECIAL = (float("inf"), -float("inf"), float("nan"), 0.0, -0.0)


def _x(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    x = (torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 4).to(dtype)
    x[:len(SPECIAL)] = torch.tensor(SPECIAL, dtype=dtype)
    return x


@pytest.mark.parametrize("bits", A.ACT_BITS)
@pytest.mark.parametrize("n", (1, 5, 37, 2048))
def test_spread_codes_is_unpack_codes(bits, n):
    """Every byte value (random bytes: also codes no forward writes, such as 3-bit slots past 7)."""
    packed = torch.randint(0, 256, (packed_nbytes(n, bits),), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(n))
    packed[:min(256, packed.numel())] = torch.arange(256, dtype=torch.uint8)[:min(256, packed.numel())]
    assert torch.equal(A.spread_codes(packed, n, bits), unpack_codes(packed, n, bits))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", A.ACT_BITS)
def test_counted_codes_are_the_step_codes(dtype, bits):
    x = _x(4099, dtype)
    for kind in ACT_KINDS:
        const = A.get_constants(kind, bits)
        thresholds = const.c if dtype == torch.float64 else A._THRESHOLDS[((kind, bits), dtype)]
        assert torch.equal(A._counted_codes(x, thresholds), A._step_codes(x, thresholds)), kind


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", A.ACT_BITS)
@pytest.mark.parametrize("native", (True, False), ids=("native", "torch"))
def test_traced_backward_is_bitwise_the_eager_one(dtype, bits, native):
    n = 4099
    g = _x(n, dtype, seed=1).view(-1, 1)
    g[:3] = 1.0  # finite products where the codes are random
    packed = torch.randint(0, 256, (packed_nbytes(n, bits),), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(2))
    for kind in ACT_KINDS:
        if native:
            eager = A._bwd_torch(g, packed, bits, kind)
        else:
            with cpu_native.disabled():
                eager = A._bwd_torch(g, packed, bits, kind)
        traced = A._bwd_traced(g, packed, bits, kind)
        assert traced.dtype == eager.dtype and traced.shape == eager.shape
        assert torch.equal(traced.view(-1).view(_bits(dtype)), eager.view(-1).view(_bits(dtype))), kind


def _bits(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype of ``dtype``'s width: compares NaNs and signed zeros bit for bit."""
    return {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]


def _aot_graphs(fn, *args):
    """(result, forward graph, backward graph) of ``fn`` compiled with fullgraph=True by AOTAutograd with
    compilers that keep the graphs and run them as they are (what inductor is handed)."""
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    out = torch.compile(fn, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)(*args)
    return out, graphs


def _ops(gm) -> set:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("bits", A.ACT_BITS)
def test_traced_graphs_have_no_gather_and_no_byte_sums(bits):
    """The forward counts codes in fp32 (no add on uint8 tensors), the backward spreads them by shifts and
    picks slopes by selects (no index_select / gather / index); gradients bit for bit the eager ones."""
    x = _x(1000, torch.bfloat16).view(10, 100).requires_grad_()
    go = _x(1000, torch.bfloat16, seed=3).view(10, 100).nan_to_num(0.0)
    y_e = approx_act(x, "gelu", bits)
    (dx_e,) = torch.autograd.grad(y_e, x, go)
    y_c, graphs = _aot_graphs(lambda t: approx_act(t, "gelu", bits), x)
    (dx_c,) = torch.autograd.grad(y_c, x, go)
    assert len(graphs) == 2
    fwd, bwd = graphs
    aten = torch.ops.aten
    gathers = {aten.index_select.default, aten.gather.default, aten.index.Tensor, aten.take.default}
    assert not _ops(bwd) & gathers and not _ops(fwd) & gathers
    byte_sums = [n for n in fwd.graph.nodes if n.op == "call_function" and n.target in (aten.add.Tensor, aten.add_.Tensor)
                 and n.meta["val"].dtype == torch.uint8]
    assert not byte_sums, byte_sums
    torch.testing.assert_close(y_c, y_e, **tol(torch.bfloat16), equal_nan=True)  # ATen's gelu, the C++ kernel's
    assert torch.equal(dx_c, dx_e)


@pytest.mark.parametrize("kind,bits,dtype", [("gelu", 2, torch.bfloat16),
                                             pytest.param("silu", 1, torch.float32, marks=pytest.mark.slow),
                                             pytest.param("quick_gelu", 3, torch.float16, marks=pytest.mark.slow)])
def test_inductor_step_is_bitwise_eager_and_keeps_the_codes(kind, bits, dtype):
    """torch.compile (inductor, CPU): gradients bit for bit the eager ones (codes and slopes exact), and what the
    compiled graph keeps for backward is the packed codes, as eager."""
    x = _x(6 * 131, dtype).view(6, 131).requires_grad_()
    go = _x(6 * 131, dtype, seed=4).view(6, 131).nan_to_num(0.0, 1.0, -1.0)
    (dx_e,) = torch.autograd.grad(approx_act(x, kind, bits), x, go)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: approx_act(t, kind, bits), fullgraph=True)
    for _ in range(2):  # the second call runs the cached graph
        with SavedTensorLedger() as ledger:
            y = compiled(x)
        (dx_c,) = torch.autograd.grad(y, x, go)
        assert torch.equal(dx_c, dx_e)
        assert ledger.bytes == packed_nbytes(x.numel(), bits) and ledger.entries[0].dtype == torch.uint8, \
            ledger.summary()
    torch._dynamo.reset()
