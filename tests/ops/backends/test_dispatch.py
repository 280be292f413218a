"""The back-end table (`ops/backends/dispatch.py`): each op's order, a switched-off back end passing the call to
the next, the PyTorch reference last; and the ops' forwards following what `route` says."""
import pytest
import torch

from lmbp_convert.enums import Backend
from lmbp_convert.ops._common import HAS_TRITON, set_triton_device_types, use_triton
from lmbp_convert.ops.backends import cpu_native, cuda_host
from lmbp_convert.ops.backends.dispatch import APPLIES, TABLE, route

C, H, T, N, R = Backend.COMPILED, Backend.CUDA_HOST, Backend.TRITON, Backend.CPU_NATIVE, Backend.TORCH
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


def _route(op: str, x: torch.Tensor) -> Backend:
    return route(op, x, use_triton(x))  # as the ops ask


@pytest.fixture
def kernels_on_cpu():
    """CPU tensors routed to the Triton kernels (run by the interpreter conftest turns on), as on a GPU."""
    set_triton_device_types("cpu")
    try:
        yield
    finally:
        set_triton_device_types("cuda")


def test_each_op_tries_its_back_ends_in_this_order():
    assert TABLE == {
        "approx_act": (C, H, T, N, R),
        "ms_norm": (C, H, T, N, R),
        "gated_mlp": (C, H, T, R),
        "gated_act": (C, T, R),
        "cross_entropy": (C, T, R),
        "norm_affine": (N, R),
        "exact_norm": (N, R),
    }
    for row in TABLE.values():
        assert row[-1] is R and len(set(row)) == len(row)  # the reference last, each back end once
        assert [b for b in Backend if b in row] == list(row)  # one global order: the enum's
    assert set(APPLIES) == set(Backend)


def test_the_reference_always_applies():
    x = torch.empty(4, 8, device="meta")  # a device no back end but the reference takes
    assert all(_route(op, x) is R for op in TABLE)
    assert all(APPLIES[R](x, kernels) for kernels in (False, True))


@pytest.mark.skipif(not cpu_native.available(), reason=f"native CPU kernels unavailable: {cpu_native.status()}")
def test_cpu_tensors_take_the_native_kernels_unless_they_are_off():
    x = torch.randn(4, 8)
    assert {op: _route(op, x) for op in TABLE} == {op: N if N in row else R for op, row in TABLE.items()}
    with cpu_native.disabled():  # switched off: the next in the row
        assert all(_route(op, x) is R for op in TABLE)
    assert _route("ms_norm", x) is N


@needs_triton
def test_kernel_tensors_take_the_host_path_then_triton(kernels_on_cpu, monkeypatch):
    x = torch.randn(4, 8)
    assert not cuda_host.on()  # off by default (LMBP_CUDA_HOST unset)
    assert [_route(op, x) for op in ("approx_act", "ms_norm", "gated_mlp", "gated_act")] == [T, T, T, T]
    assert _route("norm_affine", x) is N or not cpu_native.usable()  # no kernel row: CPU tensors stay native
    monkeypatch.setattr(cuda_host.HOST, "active", True)  # as if built and loaded
    assert [_route(op, x) for op in ("approx_act", "ms_norm", "gated_mlp", "gated_act")] == [H, H, H, T]
    with cuda_host.disabled():  # switched off (this resets what `on` knew): the next in the row
        assert _route("ms_norm", x) is T
    assert route("gated_mlp", x, False) is R  # a tensor the kernels do not take (the gated ops: g or u)


@needs_triton
def test_under_torch_compile_the_library_op(kernels_on_cpu):
    seen = []

    def f(x):
        seen.append(_route("ms_norm", x))
        return x + 1

    torch.compile(f, backend="eager", fullgraph=True)(torch.randn(4, 8))
    assert seen == [C]
    assert _route("ms_norm", torch.randn(4, 8)) is T  # eager again


@needs_triton
def test_a_call_the_host_path_declines_runs_on_triton(kernels_on_cpu, monkeypatch):
    """The op's hook for CUDA_HOST hands a NotImplemented call on to its Triton launcher (the next in the row)."""
    from lmbp_convert.ops import approx_act as A, ms_norm as M

    x = torch.randn(4, 8)
    y_ref, a_ref = M.ms_norm_unchecked(x, 8, 1e-5, False), A.approx_act(x, "gelu", 2)  # (host path off)
    calls = []
    monkeypatch.setattr(cuda_host.HOST, "active", True)
    monkeypatch.setitem(M._HOST, 0, lambda *a: calls.append("ms_norm host") or NotImplemented)
    monkeypatch.setitem(A._HOST, ("gelu", 2), lambda *a: calls.append("approx_act host") or NotImplemented)
    fwd_triton = M._fwd_triton
    monkeypatch.setattr(M, "_fwd_triton", lambda *a: calls.append("ms_norm triton") or fwd_triton(*a))
    assert torch.equal(M.ms_norm_unchecked(x, 8, 1e-5, False), y_ref)
    assert torch.equal(A.approx_act(x, "gelu", 2), a_ref)
    assert calls == ["ms_norm host", "ms_norm triton", "approx_act host"]
