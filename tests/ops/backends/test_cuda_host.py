"""The C++ host path (`ops/backends/cuda_host.py`, ``csrc/cuda_host.cpp``) without a GPU.

Proof by the driver call itself: with the stub libcuda of testsupport/triton_stub.py recording every
``cuLaunchKernelEx`` (config, attributes, the word at each parameter address), each op runs once through the
Python path (Triton's own C launcher) and again through C++, on the same tensors; the two launches must be
identical parameter by parameter (pointers resolved to the tensors they point at), for every variant class:
contiguous and strided inputs, fp32 / bf16 / fp16, odd sizes, misaligned pointers, sizes where Triton turns an
int equal to 1 into a constexpr, the looped norm kernels, autocast. Kernels are never compiled: the test's fake
compile hands Triton's real ``CudaLauncher`` a signature, so the check takes seconds (plus the one-time build
of the extension, ~20 s on a 2-core machine, cached on disk).

GPU-only tests (skipped without CUDA) compare outputs and gradients of the C++ path with the Python path bitwise.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from lmbp_convert.ops.backends import cuda_host
from lmbp_convert.ops._common import HAS_TRITON

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("c++") is None,
                               reason="needs gcc and a C++ compiler (stub libcuda, the extension)")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(autouse=True)
def cpp_path_asked_for(monkeypatch):
    """The C++ host path is off unless asked for (LMBP_CUDA_HOST=1): these tests ask for it, here and in the
    subprocesses they start; the next test elsewhere reads the variable again."""
    monkeypatch.setenv(cuda_host.ENV_SWITCH, "1")
    cuda_host.reload()
    yield
    cuda_host.reload()

PARITY_SCRIPT = r"""
import struct, sys
from types import SimpleNamespace
import torch
from testsupport import triton_stub as stub

st = stub.activate(native=True)
assert st.mode == "native-launch", st.note
from triton.runtime.jit import JITFunction
from triton.backends.nvidia.driver import CudaLauncher
from lmbp_convert.ops import approx_act as A, gated_mlp as G, ms_norm as N
from lmbp_convert.ops.backends import cuda_host

TYPES = {}  # tagged kernel handle -> Triton's parameter types (extractor indices), scratch pointers included
counter = [0]

def fake_compile(self, key, signature, device, constexprs, options, attrs, warmup):
    # Triton's real launcher for the real signature; the kernel is never built. Backward kernels ask for
    # programmatic dependent launch, norm kernels for a cooperative grid, so the attribute paths are covered.
    src = self.ASTSource(self, signature, constexprs, attrs)
    name = self.fn.__name__
    md = SimpleNamespace(num_ctas=1, global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0,
                         profile_scratch_align=1, launch_cooperative_grid="ms_norm" in name,
                         launch_pdl="bwd" in name)
    run = CudaLauncher(src, md)
    counter[0] += 1
    nparams = len(run.kernel_signature) + 2
    handle = stub.RECORD_TAG | (counter[0] << 8) | nparams
    TYPES[handle] = bytes(run.kernel_signature) + b"\x01\x01"
    k = SimpleNamespace(src=src, run=run, function=handle, launch_metadata=lambda *a: None,
                        packed_metadata=(options.num_warps, 1, 1024 + 16 * options.num_warps))
    self.device_caches[device][0][key] = k
    return k

JITFunction._do_compile = fake_compile

def symbolic(rec, names):
    types = TYPES[rec["function"]]
    assert len(types) == len(rec["params"]), (types, rec)
    params = []
    for t, w in zip(types, rec["params"]):
        if t == 1:
            params.append(names.get(w, "NULL" if w == 0 else "ptr?"))
        elif t in (4, 8):
            params.append(("i32", w & 0xFFFFFFFF))
        elif t in (5, 9):
            params.append(("i64", w))
        elif t == 12:
            params.append(("f32", struct.unpack("<f", struct.pack("<I", w & 0xFFFFFFFF))[0]))
        else:
            raise AssertionError(f"unexpected parameter type {t}")
    return {k: rec[k] for k in ("grid", "block", "shared", "stream", "function", "attrs")} | {"params": params}

def run(op, x, g):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
        y = op(x)
    n0 = st.launch_count()
    dx = None
    if x.requires_grad:  # backward() as in training: every leaf that requires grad gets one
        x.grad = None
        flowed = []  # the gradient the backward kernel wrote, before AccumulateGrad steals or clones it (which
        handle = x.register_hook(lambda t: flowed.append(t))  # depends on who else holds it at that moment)
        y.backward(g)
        handle.remove()
        dx = flowed[0]
    names = {x.data_ptr(): "x", y.data_ptr(): "y"}  # what the forward launch can point at
    names.update({t.data_ptr(): f"saved{i}" for i, t in enumerate(saved)})
    names_bwd = dict(names)
    names_bwd[g.data_ptr()] = "g"
    if dx is not None:  # an address the forward freed may come back here: named for the backward only
        names_bwd[dx.data_ptr()] = "dx"
    k = 2 if x.requires_grad else 1
    recs = stub.launch_records(st.launch_count() - k)
    assert len(recs) == k and st.launch_count() - n0 == k - 1, (len(recs), k)
    return [symbolic(r, names if i == 0 else names_bwd) for i, r in enumerate(recs)], y, dx

def check(label, op, x, g):
    with stub.triton_path(True):
        with cuda_host.disabled():
            ref, y0, dx0 = run(op, x, g)  # Triton's own launcher
        before = cuda_host.ext().stats()["direct"]
        run(op, x, g)  # first C++ call of this variant class: may launch through Python (a miss)
        mid = cuda_host.ext().stats()["direct"]
        got, y1, dx1 = run(op, x, g)
        after = cuda_host.ext().stats()["direct"]
    assert after - mid == len(got), (label, "the C++ launch did not run", before, mid, after)
    assert y1.dtype == y0.dtype and y1.shape == y0.shape and y1.stride() == y0.stride(), label
    if dx0 is not None:
        assert dx1.dtype == dx0.dtype and dx1.shape == dx0.shape, label
    assert got == ref, (label, ref, got)
    # the comparison is sensitive: a swapped parameter pair is a difference
    bad = [dict(r, params=r["params"][1:2] + r["params"][:1] + r["params"][2:]) for r in got]
    assert bad != ref, label
    return len(got)

cases = 0
def rnd(*shape, dtype, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)

for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for kind, bits in (("silu", 2), ("gelu", 3)):
        act = lambda t, kind=kind, bits=bits: A.approx_act_unchecked(t, kind, bits)
        shapes = {"contiguous": rnd(4, 64, dtype=dtype), "odd": rnd(5, 33, dtype=dtype),
                  "one element": rnd(1, dtype=dtype), "16-multiple": rnd(2, 128, dtype=dtype)}
        base = torch.randn(6, 64, dtype=dtype)
        shapes["strided rows"] = base[:, :40].requires_grad_()
        shapes["strided cols"] = torch.randn(8, 10, dtype=dtype)[:, ::2].requires_grad_()
        shapes["misaligned"] = torch.randn(200, dtype=dtype)[1:161].view(4, 40).requires_grad_()
        shapes["no grad"] = rnd(3, 48, dtype=dtype, grad=False)
        for label, x in shapes.items():
            g = torch.randn(x.shape, dtype=dtype)
            if label == "strided rows":
                g = torch.randn(6, 64, dtype=dtype)[:, :40]
            cases += check(f"{kind}/{bits} {dtype} {label}", act, x, g)
    for rms in (False, True):
        norm = lambda t, rms=rms: N.ms_norm_unchecked(t, t.shape[-1], 1e-5, rms)
        shapes = {"contiguous": rnd(3, 40, dtype=dtype), "n == 1": rnd(7, 1, dtype=dtype),
                  "16-multiple": rnd(2, 64, dtype=dtype), "looped": rnd(2, 20000, dtype=dtype),
                  "strided rows": torch.randn(5, 64, dtype=dtype)[:, :40].requires_grad_(),
                  "misaligned": torch.randn(200, dtype=dtype)[1:121].view(3, 40).requires_grad_(),
                  "no grad": rnd(3, 40, dtype=dtype, grad=False)}
        for label, x in shapes.items():
            g = torch.randn(x.shape, dtype=dtype)
            if label == "strided rows":  # a strided upstream gradient too: stride_g (64) differs from stride_y (40)
                g = torch.randn(5, 64, dtype=dtype)[:, :40]
            cases += check(f"norm rms={rms} {dtype} {label}", norm, x, g)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 in, bf16 out (what the next Linear computes in)
            x = rnd(3, 40, dtype=dtype)
            cases += check(f"norm rms={rms} {dtype} autocast", norm, x, torch.randn(3, 40, dtype=torch.bfloat16))
    for act, trainable in (("silu", False), ("gelu", True)):  # STORE_H off / on in the backward kernel
        f = 24
        w = torch.randn(10, f, dtype=dtype).requires_grad_(trainable)
        halves = lambda t, act=act, w=w: G.gated_mlp(t[..., :f], t[..., f:], w, None, act)  # strided g, u
        cases += check(f"gated {act} {dtype} strided halves", halves, rnd(6, 2 * f, dtype=dtype),
                       torch.randn(6, 10, dtype=dtype))
        u = torch.randn(5, 40, dtype=dtype)[:, :33]  # row stride 40, g's 33: every stride argument differs
        w2 = torch.randn(7, 33, dtype=dtype).requires_grad_(trainable)
        plain = lambda t, act=act, u=u, w2=w2: G.gated_mlp(t, u, w2, None, act)  # contiguous g, odd width
        cases += check(f"gated {act} {dtype} contiguous", plain, rnd(5, 33, dtype=dtype), torch.randn(5, 7, dtype=dtype))
print("launches compared:", cases)
print("ok")
"""


def _run(script: str, env: dict | None = None) -> str:
    """Run ``script`` in a fresh Python; ``env`` entries override the environment (None: unset)."""
    full = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": ROOT, **(env or {})}
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                         timeout=900, cwd=ROOT, env={k: v for k, v in full.items() if v is not None})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res.stdout


@pytest.mark.slow  # builds the extension once (~20 s), then seconds
@needs_triton
@needs_gcc
def test_cpp_launch_passes_what_tritons_launcher_passes():
    out = _run(PARITY_SCRIPT)
    assert "ok" in out, out


SWITCH_SCRIPT = """
import warnings
from lmbp_convert.ops.backends import cuda_host
with warnings.catch_warnings():
    warnings.simplefilter("error")  # switched off: no build, no warning
    assert cuda_host.ext() is None
print(cuda_host.status())
"""


def test_env_switch_turns_the_cpp_path_off_without_building():
    out = _run(SWITCH_SCRIPT, {cuda_host.ENV_SWITCH: "0"})
    assert "Python launch path (LMBP_CUDA_HOST=0)" in out


@pytest.mark.parametrize("value", [None, "", "2"])
def test_cpp_path_is_off_unless_asked_for(value):
    """Until a GPU run has validated it, a wrong launch parameter would be an illegal memory access in the user's
    process: unset (or not an on value), the variable keeps the Python launch path, with no build and no warning,
    and the status line says how to turn it on."""
    out = _run(SWITCH_SCRIPT, {cuda_host.ENV_SWITCH: value})
    assert out.strip() == ("Python launch path (C++ host path off by default until a GPU run validates it; "
                           "LMBP_CUDA_HOST=1 turns it on)"), out


def test_reload_reads_the_switch_again(monkeypatch):
    with cuda_host.under_interpreter():  # (else the status names the interpreter)
        monkeypatch.setenv(cuda_host.ENV_SWITCH, "0")
        cuda_host.reload()
        assert cuda_host.status() == "Python launch path (LMBP_CUDA_HOST=0)"
        monkeypatch.delenv(cuda_host.ENV_SWITCH)
        assert cuda_host.status() == "Python launch path (LMBP_CUDA_HOST=0)"  # read once per process...
        cuda_host.reload()  # ... unless asked again
        assert cuda_host.status().endswith("LMBP_CUDA_HOST=1 turns it on)")


@needs_triton
def test_describe_reads_the_parameter_layout_from_the_compiled_kernel():
    """Kernel parameters are the runtime arguments Triton did not make constexpr, typed as its C launcher's
    ``kernel_signature`` says; anything C++ cannot launch (no direct entry, tuples) is refused."""
    from types import SimpleNamespace

    src = SimpleNamespace(signature={"x": "*bf16", "n": "i32", "one": "constexpr", "s": "i64", "eps": "fp32",
                                     "BLOCK": "constexpr"})
    entry = SimpleNamespace(compiled=SimpleNamespace(src=src), annotations=[], metadata=(8, 1, 4096),
                            signature=b"\x01\x04\x05\x0c", function=77, coop=False, pdl=True)
    assert cuda_host.describe(entry, 5) == (77, 8, 1, 4096, False, True, b"\x01\x01\x00\x01\x01",
                                            b"\x01\x04\x05\x0c")
    assert cuda_host.describe(SimpleNamespace(**{**vars(entry), "annotations": None}), 5) is None  # via Triton
    assert cuda_host.describe(entry, 7) is None  # more runtime arguments than the kernel has
    tup = SimpleNamespace(signature={**src.signature, "t": ("i32", "i32")})
    assert cuda_host.describe(SimpleNamespace(**{**vars(entry), "compiled": SimpleNamespace(src=tup)}), 5) is None


# ------------------------------------------------------------------------------------------------ GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and Triton")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4, 64), (5, 33), (1,), (3, 20000)])
def test_gpu_cpp_path_is_bitwise_the_python_path(dtype, shape):
    from lmbp_convert.ops import approx_act as A
    from lmbp_convert.ops import ms_norm as N

    assert cuda_host.available(), cuda_host.status()
    ops = [lambda t: A.approx_act_unchecked(t, "silu", 2), lambda t: A.approx_act_unchecked(t, "gelu", 2)]
    if len(shape) > 1:
        ops += [lambda t: N.ms_norm_unchecked(t, t.shape[-1], 1e-5, False),
                lambda t: N.ms_norm_unchecked(t, t.shape[-1], 1e-6, True)]
    base = torch.randn(*shape[:-1], shape[-1] + 8, device="cuda", dtype=dtype)
    for x0 in (base[..., :shape[-1]].contiguous(), base[..., :shape[-1]]):  # contiguous, strided rows
        for op in ops:
            outs = []
            for cxx in (False, True):
                x = x0.detach().clone().requires_grad_() if x0.is_contiguous() else x0.detach().requires_grad_()
                g = torch.randn(shape, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(0))
                ctx = cuda_host.disabled() if not cxx else __import__("contextlib").nullcontext()
                with ctx:
                    y = op(x)
                    (dx,) = torch.autograd.grad(y, x, g.to(y.dtype))
                outs.append((y, dx))
            (y0, dx0), (y1, dx1) = outs
            assert y0.dtype == y1.dtype and torch.equal(y0, y1)
            assert torch.equal(dx0, dx1)
    torch.cuda.synchronize()
    stats = cuda_host.ext().stats()
    assert stats["direct"] > 0  # the C++ launch ran
    assert stats["self_checked"] > 0 and not stats["self_check_failed"], stats


@needs_cuda
@pytest.mark.parametrize("dtype,amp", [(torch.bfloat16, None), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("adapters,strided", [(0, False), (2, True)])
def test_gpu_cpp_gated_mlp_is_bitwise_the_python_path(dtype, amp, adapters, strided):
    import contextlib

    from lmbp_convert.ops import gated_mlp as G

    outs = []
    for cxx in (False, True):
        g, u, w, b, lora, leaves = _gated_case(dtype, True, True, adapters, strided)
        to = lambda t: t.detach().cuda().requires_grad_(t.requires_grad)  # noqa: E731
        g, u, w, b = (to(t) if t is not None else None for t in (g, u, w, b))
        if strided:  # the two halves of one fused gate_up output, on the GPU
            f = g.shape[-1]
            gu = torch.cat([g, u], -1).detach().requires_grad_()
            g, u = gu[..., :f], gu[..., f:]
        lora = [G.LoraAdapter(to(a.a_weight), to(a.b_weight), to(a.b_bias) if a.b_bias is not None else None,
                              a.scale, a.cast_input) for a in lora]
        ctx = cuda_host.disabled() if not cxx else contextlib.nullcontext()
        amp_ctx = torch.autocast("cuda", dtype=amp) if amp else contextlib.nullcontext()
        with ctx, amp_ctx:
            out = G.gated_mlp(g, u, w, b, "silu", lora)
        leaves = [t for t in ([gu] if strided else [g, u]) + [w, b]
                  + [x for a in lora for x in (a.a_weight, a.b_weight, a.b_bias)] if t is not None and t.requires_grad]
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype).cuda()
        outs.append((out, torch.autograd.grad(out, leaves, dy)))
    (o0, g0), (o1, g1) = outs
    assert torch.equal(o0, o1)
    for a, c in zip(g0, g1):
        assert torch.equal(a, c)
    assert not cuda_host.ext().stats()["self_check_failed"]


@needs_cuda
def test_gpu_cpp_path_uses_torchs_current_stream():
    from lmbp_convert.ops import approx_act as A

    s = torch.cuda.Stream()
    x = torch.randn(1000, device="cuda", requires_grad=True)
    A.approx_act_unchecked(x, "silu", 2).sum().backward()  # warm: entries cached
    with torch.cuda.stream(s):
        x2 = x.detach().clone().requires_grad_()
        y = A.approx_act_unchecked(x2, "silu", 2)
        y.backward(torch.ones_like(y))
    s.synchronize()
    with cuda_host.disabled():
        ref = A.approx_act_unchecked(x.detach(), "silu", 2)
    assert torch.equal(y, ref) and torch.isfinite(x2.grad).all()


# ------------------------------------------------------------------- the C++ autograd, under the interpreter
@pytest.fixture
def cxx_path(monkeypatch):
    """The C++ host path on CPU tensors: its Functions, allocations and saved tensors run for real; each launch
    goes back through Python to Triton's interpreter (which computes the values)."""
    if not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter")
    from lmbp_convert.ops import approx_act as A
    from lmbp_convert.ops import ms_norm as N

    for mod in (A, N):
        monkeypatch.setattr(mod, "use_triton", lambda t: t.dtype in (torch.float32, torch.bfloat16, torch.float16))
    with cuda_host.under_interpreter():
        if not cuda_host.available():
            pytest.skip(f"C++ host path not built: {cuda_host.status()}")
        yield A, N


def _is_cpp(t: torch.Tensor) -> bool:
    return type(t.grad_fn).__name__ == "CppFunction"


@pytest.mark.slow  # the extension build (once)
@pytest.mark.parametrize("kind", ("gelu", "silu"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_cpp_approx_act_values_bytes_and_double_backward(cxx_path, kind, dtype):
    from tolerances import tol

    from lmbp_convert.memory import SavedTensorLedger
    from lmbp_convert.ops.approx_act import packed_nbytes

    A, _ = cxx_path
    x = (torch.randn(6, 37) * 3).to(dtype).requires_grad_()  # 222 elements: a partial last code byte
    go = torch.randn(6, 37, dtype=dtype)
    with SavedTensorLedger() as ledger:
        y = A.approx_act_unchecked(x, kind, 2)
    assert _is_cpp(y)
    assert ledger.count == 1 and ledger.bytes == packed_nbytes(x.numel(), 2)  # only the codes
    x_ref = x.detach().clone().requires_grad_()
    y_ref = A.approx_act(x_ref, kind, 2, backend="torch")
    torch.testing.assert_close(y, y_ref, **tol(dtype))
    (dx,) = torch.autograd.grad(y, x, go)
    (dx_ref,) = torch.autograd.grad(y_ref, x_ref, go)
    torch.testing.assert_close(dx, dx_ref, **tol(dtype))
    # double backward: the first-order gradient is differentiable (the PyTorch backward, called from C++)
    y2 = A.approx_act_unchecked(x, kind, 2)
    g = go.clone().requires_grad_()
    (dx2,) = torch.autograd.grad(y2, x, g, create_graph=True)
    torch.testing.assert_close(dx2, dx_ref, **tol(dtype))
    (dgo,) = torch.autograd.grad(dx2.sum(), g)
    (slopes,) = torch.autograd.grad(A.approx_act(x_ref, kind, 2, backend="torch"), x_ref, torch.ones_like(go))
    torch.testing.assert_close(dgo, slopes, **tol(dtype))
    with torch.no_grad(), SavedTensorLedger() as ledger:
        y0 = A.approx_act_unchecked(x, kind, 2)
    assert ledger.count == 0 and y0.grad_fn is None
    torch.testing.assert_close(y0, y_ref.detach(), **tol(dtype))
    # a strided input (a slice of a wider tensor) is read in place and gives the same values
    wide = (torch.randn(6, 50) * 3).to(dtype)
    xs = wide[:, :37].requires_grad_()
    ys = A.approx_act_unchecked(xs, kind, 2)
    assert _is_cpp(ys) and ys.is_contiguous()
    torch.testing.assert_close(ys, A.approx_act(wide[:, :37], kind, 2, backend="torch"), **tol(dtype))


@pytest.mark.slow  # the extension build (once)
@pytest.mark.parametrize("rms", (False, True))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_cpp_ms_norm_values_bytes_autocast_and_double_backward(cxx_path, rms, dtype):
    from torch import nn
    from tolerances import tol

    from lmbp_convert.memory import SavedTensorLedger

    _, N = cxx_path
    x = (torch.randn(2, 5, 32) * 2).to(dtype).requires_grad_()
    g = torch.randn(2, 5, 32).to(dtype)
    lin = nn.Linear(32, 16, dtype=dtype)
    with SavedTensorLedger(lin) as ledger:
        y = N.ms_norm_unchecked(x, 32, 1e-5, rms)
        out = lin(y)
    assert _is_cpp(y) and y.dtype == dtype
    assert ledger.count == 2 and ledger.bytes == y.numel() * y.element_size() + 10 * 4, ledger.summary()
    (dx,) = torch.autograd.grad(y, x, g, retain_graph=True)
    out.float().sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    y_ref, _ = N._fwd_torch(x_ref.detach(), 32, 1e-5, rms, dtype)
    torch.testing.assert_close(y, y_ref, **tol(dtype))
    ref_fn = N.ms_rms_norm if rms else N.ms_layer_norm
    with cuda_host.disabled():
        (dx_ref,) = torch.autograd.grad(ref_fn(x_ref, 32, 1e-5), x_ref, g)
    torch.testing.assert_close(dx, dx_ref, **tol(dtype, "bwd"))
    # autocast: fp32 input, the autocast dtype out, that one storage shared with the Linear
    xa = torch.randn(2, 5, 32, requires_grad=True)
    lin32 = nn.Linear(32, 16)
    with SavedTensorLedger(lin32) as ledger, torch.autocast("cpu", dtype=torch.bfloat16):
        ya = N.ms_norm_unchecked(xa, 32, 1e-5, rms)
        lin32(ya).float().sum().backward()
    assert _is_cpp(ya) and ya.dtype == torch.bfloat16 and xa.grad.dtype == torch.float32
    assert ledger.bytes == ya.numel() * 2 + 10 * 4, ledger.summary()
    # double backward: the C++ node's rstd cannot be linked to it (its backward in C++ takes no hand-off), so it
    # refuses with an LmbpError naming LMBP_CUDA_HOST=0 (the Python path, which differentiates it)
    from lmbp_convert.errors import NoSecondDerivativeError

    with pytest.raises(NoSecondDerivativeError, match="LMBP_CUDA_HOST=0"):
        torch.autograd.grad(N.ms_norm_unchecked(x, 32, 1e-5, rms).float().pow(2).sum(), x, create_graph=True)
    with torch.no_grad(), SavedTensorLedger() as ledger:
        y0 = N.ms_norm_unchecked(x, 32, 1e-5, rms)
    assert ledger.count == 0 and y0.grad_fn is None
    torch.testing.assert_close(y0, y_ref, **tol(dtype))


def _gated_case(dtype, bias, trainable, adapters, strided, seed=0):
    from lmbp_convert.ops.gated_mlp import LoraAdapter

    gen = torch.Generator().manual_seed(seed)
    t, f, n = 6, 24, 10
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    if strided:  # the two halves of one fused gate_up output
        gu = rnd(2, t // 2, 2 * f).requires_grad_()
        g, u = gu[..., :f], gu[..., f:]
        leaves = [gu]
    else:
        g, u = rnd(t, f).requires_grad_(), rnd(t, f).requires_grad_()
        leaves = [g, u]
    w = rnd(n, f).requires_grad_(trainable)
    b = rnd(n).requires_grad_(trainable) if bias else None
    lora = []
    for i in range(adapters):
        a_w = rnd(4, f).requires_grad_()
        b_w = rnd(n, 4).requires_grad_()
        b_b = rnd(n).requires_grad_() if i == 1 else None
        lora.append(LoraAdapter(a_w, b_w, b_b, 0.5 + i, cast_input=i == 0))
    params = [p for p in [w, b] + [x for ad in lora for x in (ad.a_weight, ad.b_weight, ad.b_bias)]
              if p is not None and p.requires_grad]
    return g, u, w, b, lora, leaves + params


@pytest.mark.slow  # the extension build (once)
@pytest.mark.parametrize("dtype,amp", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("bias,trainable,adapters,strided", [(False, False, 0, False), (True, True, 0, True),
                                                             (True, False, 2, False), (False, True, 1, True)])
def test_cpp_gated_mlp_is_bitwise_the_python_function(cxx_path, monkeypatch, dtype, amp, bias, trainable, adapters,
                                                      strided):
    """The C++ port of GatedMLPFunction makes the same ATen calls in the same order: outputs, every gradient and
    the saved bytes are identical to the Python Function's (PEFT LoRA adapters, autocast, strided gate/up)."""
    from lmbp_convert.memory import SavedTensorLedger
    from lmbp_convert.ops import gated_mlp as G

    monkeypatch.setattr(G, "use_triton", lambda t: t.dtype in (torch.float32, torch.bfloat16, torch.float16))
    results = []
    for cxx in (False, True):
        g, u, w, b, lora, leaves = _gated_case(dtype, bias, trainable, adapters, strided)
        ctx = cuda_host.disabled() if not cxx else __import__("contextlib").nullcontext()
        amp_ctx = torch.autocast("cpu", dtype=amp) if amp else __import__("contextlib").nullcontext()
        with ctx, SavedTensorLedger() as ledger, amp_ctx:
            out = G.gated_mlp(g, u, w, b, "silu", lora)
        assert _is_cpp(out) == cxx
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
        grads = torch.autograd.grad(out, leaves, dy)
        results.append((out, grads, ledger.bytes, ledger.count))
    (o0, g0, b0, c0), (o1, g1, b1, c1) = results
    assert o0.dtype == o1.dtype and torch.equal(o0, o1)
    assert (b0, c0) == (b1, c1)
    for a, c in zip(g0, g1):
        assert a.dtype == c.dtype and torch.equal(a, c)


@pytest.mark.slow  # the extension build (once)
def test_cpp_gated_mlp_double_backward_and_no_grad_saves_nothing(cxx_path, monkeypatch):
    from lmbp_convert.memory import SavedTensorLedger
    from lmbp_convert.ops import gated_mlp as G

    monkeypatch.setattr(G, "use_triton", lambda t: t.dtype in (torch.float32, torch.bfloat16, torch.float16))
    g, u, w, b, lora, leaves = _gated_case(torch.float32, True, True, 1, False)
    out = G.gated_mlp(g, u, w, b, "silu", lora)
    assert _is_cpp(out)
    grads = torch.autograd.grad(out.pow(2).sum(), leaves, create_graph=True)
    with cuda_host.disabled():
        ref = torch.autograd.grad(G.gated_mlp(g, u, w, b, "silu", lora).pow(2).sum(), leaves)
    for a, c in zip(grads, ref):
        torch.testing.assert_close(a, c)
    # the second backward: through the Python Function's recomputed forward, as without C++
    second = torch.autograd.grad(sum(t.pow(2).sum() for t in grads), leaves)
    with cuda_host.disabled():
        first = torch.autograd.grad(G.gated_mlp(g, u, w, b, "silu", lora).pow(2).sum(), leaves, create_graph=True)
        ref = torch.autograd.grad(sum(t.pow(2).sum() for t in first), leaves)
    for a, c in zip(second, ref):
        torch.testing.assert_close(a, c)
    with torch.no_grad(), SavedTensorLedger() as ledger:
        y0 = G.gated_mlp(g, u, w, b, "silu", lora)
    assert ledger.count == 0 and y0.grad_fn is None
    torch.testing.assert_close(y0, out.detach())


@pytest.mark.parametrize("value,off", [("0", True), ("no", True), (" OFF ", True), ("false", True), ("1", False),
                                       ("yes", False), (None, False)])
def test_every_ops_switch_reads_the_same_off_values(monkeypatch, value, off):
    """LMBP_CUDA_HOST, LMBP_CUDA_HOST_CHECK and LMBP_CPU_NATIVE share one reading (``=no`` once left the
    self-check on while it turned the other two off)."""
    from lmbp_convert.ops._common import env_off

    for name in (cuda_host.ENV_SWITCH, cuda_host.ENV_CHECK, "LMBP_CPU_NATIVE"):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        assert env_off(name) is off


def test_first_build_says_in_one_line_what_it_compiles(tmp_path, monkeypatch, capsys):
    """Building the host path takes ~25 s at the first CUDA op: one stderr line says so before it starts."""
    from lmbp_convert.ops.backends import build

    def not_built(cxx, flags, out):
        raise RuntimeError("not built in this test")

    if build.compiler() is None or sys.platform != "linux":
        pytest.skip("no C++ compiler: nothing is built")
    monkeypatch.setenv(build.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(build, "_announced", set())
    monkeypatch.setattr(cuda_host, "_compile", not_built)
    with pytest.raises(RuntimeError, match="not built in this test"):
        cuda_host._build_and_load()
    ours = [ln for ln in capsys.readouterr().err.splitlines() if "lmbp_convert" in ln]  # (torch logs its own)
    assert len(ours) == 1 and ours[0].startswith("lmbp_convert: compiling the C++ CUDA host path (cuda_host.cpp, ")
    assert ours[0].endswith(f"about {build.BUILD_SECONDS['cuda_host']} s; cached in {tmp_path}"), ours
