"""The lean launch path and the compile registration of the Triton path, without a GPU.

Triton's interpreter bypasses both, so these run in a fresh process with TRITON_INTERPRET=0 and the GPU stubbed at
Triton's level (testsupport's `stub_triton_driver`: a fake sm_90 driver, a compile step returning a do-nothing
kernel). What is checked is host-side plumbing: the cached launch passes exactly the arguments Triton's own launch path passes,
Triton's path runs once per specialisation (not per call), a new specialisation (alignment, size class) is not
served from a stale entry, and under torch.compile every op is a traced ``triton_op`` with its registered autograd.
"""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lmbp_convert.ops._common import HAS_TRITON
from lmbp_convert.ops._launch import cdiv, next_pow2

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
ROOT = Path(__file__).resolve().parents[2]  # the checkout: the scripts import testsupport from it


def test_integer_helpers():
    assert [cdiv(a, 4) for a in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert [next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 1000, 1024, 1025)] == [1, 1, 2, 4, 4, 8, 1024, 1024, 2048]


def _run(script: str) -> str:
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                         timeout=600, cwd=ROOT, env={**__import__("os").environ, "TRITON_INTERPRET": "0"})
    assert res.returncode == 0, res.stderr[-4000:]
    return res.stdout


LAUNCH_SCRIPT = """
    import torch
    from triton.runtime.jit import JITFunction
    from lmbp_convert.ops import approx_act as A, gated_mlp as G, ms_norm as N
    from lmbp_convert.ops._common import set_triton_device_types
    from testsupport.triton_compile import stub_triton_driver

    calls = {"triton": 0}
    launched = []
    orig_run = JITFunction.run
    def counting_run(self, *args, **kw):
        calls["triton"] += 1
        return orig_run(self, *args, **kw)
    JITFunction.run = counting_run

    with stub_triton_driver() as stub:
        orig_stub_run = stub.run
        stub.run = lambda self, *a: launched.append(a)
        set_triton_device_types("cpu")
        x = torch.randn(6, 40, requires_grad=True)
        u = torch.randn(6, 40, requires_grad=True)
        ops = [lambda t: A.approx_act(t, "silu", 2), lambda t: N.ms_layer_norm(t, (40,)),
               lambda t: N.ms_rms_norm(t, (40,)), lambda t: G.gated_act(t, u, "gelu")]
        for op in ops:
            for i in range(3):
                calls["triton"] = 0
                launched.clear()
                op(x).backward(torch.ones(6, 40))
                # first call: Triton's own launch path twice (fwd, bwd); afterwards the cached launcher only
                assert calls["triton"] == (2 if i == 0 else 0), (i, calls)
                assert len(launched) == 2, launched
                if i == 0:
                    first = [a[9:] for a in launched]  # Triton's path: the kernel arguments after the launch prefix
                else:  # the cached launch passes the same kernel arguments (tensors fresh, same shapes)
                    again = [a[9:] for a in launched]
                    for f, s in zip(first, again):
                        assert len(f) == len(s)
                        for p, q in zip(f, s):
                            assert type(p) is type(q), (p, q)
                            if isinstance(p, torch.Tensor):
                                assert p.shape == q.shape and p.dtype == q.dtype
                            else:
                                assert p == q, (p, q)
        # a new size class and a misaligned view: new specialisations go through Triton's path again
        calls["triton"] = 0
        A.approx_act(torch.randn(17), "gelu", 2)
        assert calls["triton"] == 1
        base = torch.randn(64)
        A.approx_act(base[1:33], "gelu", 2)  # same numel as a 32-element aligned tensor, 4-byte offset
        A.approx_act(base[:32], "gelu", 2)
        assert calls["triton"] == 3, calls
        set_triton_device_types("cuda")
    # leaving the stub drops every cached stub kernel
    assert all(not k.cache for k in (A._FWD, A._BWD, N._FWD, N._BWD, G._FWD, G._BWD))
    print("ok")
"""


@pytest.mark.slow  # compiles Triton kernels
@needs_triton
def test_cached_launch_matches_tritons_own_launch():
    assert "ok" in _run(LAUNCH_SCRIPT)


COMPILE_SCRIPT = """
    import torch
    from torch._dynamo.testing import AotEagerAndRecordGraphs
    from lmbp_convert.ops import approx_act as A, gated_mlp as G, ms_norm as N
    from lmbp_convert.ops._common import set_triton_device_types
    from testsupport.triton_compile import stub_triton_driver

    with stub_triton_driver():
        set_triton_device_types("cpu")
        lin = torch.nn.Linear(32, 32)
        def block(x, u):
            h = lin(N.ms_layer_norm(x, (32,)))
            h = lin(A.approx_act(h, "gelu", 2)) + N.ms_rms_norm(x, (32,))
            return lin(G.gated_act(h, u, "silu"))
        backend = AotEagerAndRecordGraphs()
        x, u = torch.randn(4, 32, requires_grad=True), torch.randn(4, 32, requires_grad=True)
        torch.compile(block, backend=backend, fullgraph=True)(x, u).sum().backward()
        fw, bw = backend.fw_graphs[0].code, backend.bw_graphs[0].code
        kernels = lambda code: code.count("triton_kernel_wrapper_functional(")
        assert kernels(fw) == 4 and kernels(bw) == 4, (fw, bw)  # every op is traced down to its kernel
        assert "lmbp_convert" not in fw and "lmbp_convert" not in bw  # no opaque op left for inductor
        set_triton_device_types("cuda")
    print("ok")
"""


@pytest.mark.slow  # torch.compile of every op
@needs_triton
def test_compile_traces_every_op_down_to_its_triton_kernels():
    """fullgraph=True; forward and backward graphs hold the kernels themselves (inductor can emit the launches
    and CUDA-graph them), not opaque custom ops around Python launchers."""
    assert "ok" in _run(COMPILE_SCRIPT)


@needs_triton
def test_stub_is_not_usable_under_the_interpreter():
    """The interpreter never caches (there is no compiled kernel): eager results stay exact there."""
    from lmbp_convert.ops import approx_act as A
    x = torch.randn(50)
    A._fwd_triton(x, "gelu", 2)
    assert not A._FWD.cache


@needs_triton
def test_direct_launch_passes_what_tritons_launcher_passes():
    """`LeanKernel`'s cached launch calls Triton's C launcher itself: for a kernel with no scratch buffers, the
    call must be exactly the one Triton's ``CudaLauncher.__call__`` makes (same arguments, same order)."""
    nvidia = pytest.importorskip("triton.backends.nvidia.driver")
    from lmbp_convert.ops import _launch, approx_act
    from testsupport.triton_compile import stub_triton_driver

    calls = []

    class CudaLauncher:  # the attributes Triton's launcher reads in __call__, its C launch recorded
        launch = staticmethod(lambda *a: calls.append(a))
        global_scratch_size = profile_scratch_size = 0
        global_scratch_align = profile_scratch_align = 1
        gsan_enabled = False
        num_ctas = 1
        launch_cooperative_grid, launch_pdl = False, True
        arg_annotations, kernel_signature = ["ann"], b"sig"

    class Compiled:
        run = CudaLauncher()
        function, packed_metadata = 1234, (4, 1, 0)

    entry = _launch._Entry(Compiled(), (7, True), lambda dev: 55, None)
    assert entry.c == CudaLauncher.launch  # the direct path was taken
    args = (torch.empty(3), 5, 6)
    kernel = approx_act._FWD  # any LeanKernel: the entry is planted under a key of its own
    kernel.cache["test-key"] = entry
    try:
        kernel.launch("test-key", (2, 3, 1), args, 0, (7, True), 4)
    finally:
        del kernel.cache["test-key"]
    with stub_triton_driver():  # CudaLauncher.__call__ reads the active driver
        nvidia.CudaLauncher.__call__(Compiled.run, 2, 3, 1, 55, 1234, (4, 1, 0), None, None, None, *args, 7, True)
    assert len(calls) == 2 and len(calls[0]) == len(calls[1])
    for ours, theirs in zip(*calls):
        assert ours is theirs or ours == theirs, (calls[0], calls[1])

    # scratch buffers (or anything else unusual): Triton's own launcher
    class WithScratch(CudaLauncher):
        global_scratch_size = 64

    class Compiled2(Compiled):
        run = WithScratch()

    assert not _launch._direct_launchable(Compiled2.run)
    assert _launch._Entry(Compiled2(), (), lambda dev: 0, None).c != CudaLauncher.launch


def test_launch_knobs_guard_reads_what_this_triton_has(monkeypatch):
    """The Triton internals the cached launch reads are guarded, not assumed from the declared floor: without
    ``triton.knobs`` (or without its runtime launch hooks) `triton_launch_knobs` says so, and with it it returns
    the hooks' holder."""
    triton = pytest.importorskip("triton")
    from lmbp_convert.ops import _launch

    if hasattr(getattr(getattr(triton, "knobs", None), "runtime", None), "launch_enter_hook"):
        runtime, _chain = _launch.triton_launch_knobs()
        assert runtime is triton.knobs.runtime
    monkeypatch.setattr(triton, "knobs", type("Knobs", (), {"runtime": object()}), raising=False)
    assert _launch.triton_launch_knobs() is None  # knobs without launch hooks
    monkeypatch.delattr(triton, "knobs")
    monkeypatch.setitem(sys.modules, "triton.knobs", None)  # a Triton without the module
    assert _launch.triton_launch_knobs() is None


def test_without_launch_knobs_every_launch_is_tritons_own(monkeypatch):
    """The fallback of the guard: no launch hooks to check, so no compiled kernel is cached and every call is the
    ordinary ``kernel[grid](...)`` (a kernel object standing in for a ``@triton.jit`` function counts them)."""
    from lmbp_convert.ops import _launch

    class Param:
        def __init__(self, name, const):
            self.name, self.is_constexpr = name, const

    calls = []

    class Compiled:  # what a real launch returns: a compiled kernel that would be cached
        packed_metadata = (4, 1, 0)

    class Kernel:
        __name__ = "fake_kernel"
        params = [Param("x", False), Param("BLOCK", True)]

        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append((grid, args, kw)) or Compiled()

    monkeypatch.setattr(_launch, "_KNOBS", None)
    k = _launch.LeanKernel(Kernel())
    for _ in range(3):
        k.launch("key", (1, 1, 1), (5,), None, (64,))
    assert len(calls) == 3 and calls[0] == ((1, 1, 1), (5,), {"num_warps": 4, "BLOCK": 64})
    assert k.cache == {}
