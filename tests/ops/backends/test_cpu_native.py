"""Native CPU kernels (ops/backends/cpu_native.py, csrc/cpu_ops.cpp) against the PyTorch path they replace.

Codes must be identical byte for byte, backward of approx_act bit for bit (the same fp32 product, rounded once),
everything else within the tolerance table; saved bytes unchanged; and where the kernels do not apply (or
cannot be built) the PyTorch path runs. The library is built once per cache directory (first use), so only the
first test here pays the compile.
"""
from __future__ import annotations

import contextlib
import math
import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch
from tolerances import tol
from torch.utils._python_dispatch import TorchDispatchMode

from lmbp_convert.memory import SavedTensorLedger
from lmbp_convert.ops import approx_act as A
from lmbp_convert.ops.backends import build, cpu_native as N
from lmbp_convert.ops import ms_norm as M
from lmbp_convert.ops.norm_affine import affine_forward, norm_affine

pytestmark = pytest.mark.skipif(not N.available(), reason=f"native CPU kernels unavailable: {N.status()}")

LOW = (torch.float32, torch.bfloat16, torch.float16)
TESTS_OPS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(TESTS_OPS))


def _torch_path(fn, *args):
    with N.disabled():
        return fn(*args)


def _act_inputs(n: int, dtype: torch.dtype, kind: str, bits: int) -> torch.Tensor:
    """Random values plus every threshold exactly, its neighbours on x's grid, ±inf, NaN, ±0."""
    x = torch.randn(n) * 4
    specials = [math.inf, -math.inf, math.nan, 0.0, -0.0, 1e30, -1e30, 88.5, -88.5, 100.0, -100.0]
    ts = torch.tensor(A.get_constants(kind, bits).c_f32, dtype=torch.float32).to(dtype)
    up = torch.nextafter(ts, torch.full_like(ts, math.inf))
    down = torch.nextafter(ts, torch.full_like(ts, -math.inf))
    edge = torch.cat([torch.tensor(specials), ts.float(), up.float(), down.float()])
    x[: edge.numel()] = edge
    x = x[torch.randperm(n)]
    return x.to(dtype)


# ----------------------------------------------------------------------------------------------- approx_act
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("kind", A.ACT_KINDS)
def test_act_codes_identical_outputs_close(kind, dtype):
    for bits in A.ACT_BITS:
        for n in (1, 7, 8, 1023, 1025, 5000):  # odd sizes: partial last byte and partial last block
            x = _act_inputs(max(n, 64), dtype, kind, bits)[:n]
            y, packed = A._fwd_torch(x, kind, bits)
            y_ref, packed_ref = _torch_path(A._fwd_torch, x, kind, bits)
            assert packed.dtype == torch.uint8 and packed.numel() == A.packed_nbytes(n, bits)
            assert torch.equal(packed, packed_ref), (kind, bits, n)
            assert y.dtype == dtype and y.shape == x.shape
            torch.testing.assert_close(y, y_ref, equal_nan=True, **tol(dtype))
            g = torch.randn(n).to(dtype)
            g[: min(n, 3)] = torch.tensor([math.inf, math.nan, -2.0])[: min(n, 3)].to(dtype)
            dx = A._bwd_torch(g, packed, bits, kind)
            dx_ref = _torch_path(A._bwd_torch, g, packed, bits, kind)
            assert dx.dtype == dtype and torch.equal(dx.isnan(), dx_ref.isnan())
            assert torch.equal(dx.nan_to_num(), dx_ref.nan_to_num()), (kind, bits, n)


def test_act_large_input_uses_all_threads_identically():
    """Big enough to split over threads (several blocks): same codes as one thread and as the PyTorch path."""
    x = _act_inputs(300_001, torch.bfloat16, "gelu", 2).view(-1)
    y2, p2 = A._fwd_torch(x, "gelu", 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        y1, p1 = A._fwd_torch(x, "gelu", 2)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(p1, p2)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(p2, _torch_path(A._fwd_torch, x, "gelu", 2)[1])


@pytest.mark.parametrize("dtype", LOW)
def test_act_non_contiguous_and_expanded(dtype):
    x = (torch.randn(6, 40, 9) * 3).to(dtype).transpose(0, 2)  # non-contiguous input
    y, packed = A._fwd_torch(x, "silu", 2)
    y_ref, packed_ref = _torch_path(A._fwd_torch, x, "silu", 2)
    assert torch.equal(packed, packed_ref) and y.shape == x.shape
    torch.testing.assert_close(y, y_ref, **tol(dtype))
    g = torch.randn(9, 40, 1).to(dtype).expand(9, 40, 6)  # stride-0 grad (as from .sum())
    torch.testing.assert_close(A._bwd_torch(g, packed, 2, "silu"), _torch_path(A._bwd_torch, g, packed, 2, "silu"),
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", LOW)
def test_act_autograd_end_to_end_saves_the_same_bytes(dtype):
    x = (torch.randn(4, 33, 17) * 3).to(dtype)
    g = torch.randn(4, 33, 17).to(dtype)
    outs = []
    for native in (True, False):
        xi = x.clone().requires_grad_()
        with (N.disabled() if not native else contextlib.nullcontext()):
            with SavedTensorLedger() as ledger:
                y = A.approx_act(xi, "gelu", 2)
            y.backward(g)
        outs.append((y.detach(), xi.grad, ledger.count, ledger.bytes))
    (y_n, dx_n, c_n, b_n), (y_t, dx_t, c_t, b_t) = outs
    assert (c_n, b_n) == (c_t, b_t) == (1, A.packed_nbytes(x.numel(), 2))
    torch.testing.assert_close(y_n, y_t, **tol(dtype))
    assert torch.equal(dx_n, dx_t)


# ------------------------------------------------------------------------------------------------- MS norms
@pytest.mark.parametrize("is_rms", (False, True))
@pytest.mark.parametrize("dtype", LOW)
def test_norm_matches_torch_path(dtype, is_rms):
    for n in (1, 37, 768, 5000):
        x = (torch.randn(3, 5, n) * 2 + 1).to(dtype)
        for out_dtype in LOW:  # out_dtype != dtype: the autocast case (fp32 in, bf16 / fp16 out)
            y, rstd = M._fwd_torch(x, n, 1e-5, is_rms, out_dtype)
            y_ref, rstd_ref = _torch_path(M._fwd_torch, x, n, 1e-5, is_rms, out_dtype)
            assert y.dtype == out_dtype and y.shape == x.shape and rstd.dtype == torch.float32
            assert rstd.shape == (15,)
            torch.testing.assert_close(y, y_ref, **tol(out_dtype))
            torch.testing.assert_close(rstd, rstd_ref, **tol(torch.float32))
            g = torch.randn(3, 5, n).to(out_dtype)
            dx = M._bwd_torch(g, y_ref, rstd_ref, is_rms, dtype)
            dx_ref = _torch_path(M._bwd_torch, g, y_ref, rstd_ref, is_rms, dtype)
            assert dx.dtype == dtype and dx.shape == x.shape
            torch.testing.assert_close(dx, dx_ref, **tol(dtype, "bwd"))


@pytest.mark.parametrize("is_rms", (False, True))
def test_norm_non_contiguous_and_special_values(is_rms):
    x = (torch.randn(3, 37, 4) * 2).transpose(1, 2)  # rows of 37, non-contiguous
    x[0, 0, 3] = math.inf
    x[1, 2, 5] = math.nan
    y, rstd = M._fwd_torch(x, 37, 1e-5, is_rms, torch.float32)
    y_ref, rstd_ref = _torch_path(M._fwd_torch, x, 37, 1e-5, is_rms, torch.float32)
    torch.testing.assert_close(y, y_ref, equal_nan=True, **tol(torch.float32))
    torch.testing.assert_close(rstd, rstd_ref, equal_nan=True, **tol(torch.float32))
    g = torch.randn(3, 4, 37).transpose(1, 2)
    torch.testing.assert_close(M._bwd_torch(g, y_ref, rstd_ref, is_rms, torch.float32),
                               _torch_path(M._bwd_torch, g, y_ref, rstd_ref, is_rms, torch.float32),
                               equal_nan=True, **tol(torch.float32, "bwd"))


@pytest.mark.parametrize("kind", ("ln", "rms"))
def test_norm_autograd_under_autocast_saves_the_same_bytes(kind):
    fn = M.ms_layer_norm if kind == "ln" else M.ms_rms_norm
    x = torch.randn(2, 9, 64) * 3
    lin = torch.nn.Linear(64, 8)
    results = []
    for native in (True, False):
        xi = x.clone().requires_grad_()
        with (N.disabled() if not native else contextlib.nullcontext()), torch.autocast("cpu", dtype=torch.bfloat16):
            with SavedTensorLedger(lin) as ledger:
                out = lin(fn(xi, 64))
            out.float().sum().backward()
        results.append((out.detach(), xi.grad, ledger.count, ledger.bytes))
    assert results[0][2:] == results[1][2:]
    torch.testing.assert_close(results[0][0], results[1][0], **tol(torch.bfloat16))
    torch.testing.assert_close(results[0][1], results[1][1], **tol(torch.bfloat16, "bwd"))


# ------------------------------------------------------------------------------------ exact norm's affine
def _affine_inputs(rows: int, n: int, dtype: torch.dtype, strided: bool, specials: bool = False):
    """x̂ (rows, n) in ``dtype`` (column-major where ``strided``), w and β in fp32; ``specials``: ±inf, NaN, -0."""
    torch.manual_seed(rows * 31 + n)
    x = torch.randn(n, rows).t() if strided else torch.randn(rows, n)
    if specials:
        x[0, 0], x[-1, -1], x[rows // 2, n // 2] = math.inf, math.nan, -0.0
        if x.numel() > 3:
            x[0, -1] = -math.inf
    return x.to(dtype), (torch.rand(n) + 0.5), torch.randn(n)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("strided", (False, True))
def test_affine_forward_is_bitwise_the_torch_path(dtype, strided):
    """x̂·γ + β in one native pass: the same bits as the two out= ops, every output dtype, with and without β,
    γ = w or 1 + w, a fused cast, odd row lengths (vector tails) and column-major x̂."""
    for rows, n in ((1, 1), (3, 7), (5, 17), (33, 768), (2, 1000)):
        x, w, b = _affine_inputs(rows, n, dtype, strided, specials=True)
        assert x.is_contiguous() != strided or n == 1 or rows == 1
        for out in LOW:
            for bias, one_plus in ((b, False), (None, False), (b, True), (None, True)):
                for wd in {torch.float32, dtype}:
                    for cast in (None, torch.bfloat16, torch.float16):
                        args = (x, w.to(wd), None if bias is None else bias.to(wd), one_plus, out)
                        got = affine_forward(*args, cast_to=cast)
                        want = _torch_path(lambda *a: affine_forward(*a, cast_to=cast), *args)
                        assert got.dtype == want.dtype and got.shape == want.shape
                        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
                        fin = got.float().isfinite()  # and the bits themselves where the value is finite
                        assert torch.equal(got.float()[fin], want.float()[fin])


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("bias,one_plus", [(True, False), (False, False), (True, True)])
def test_affine_backward_matches_the_torch_path(dtype, bias, one_plus):
    """dx̂ bit for bit; dw and dβ (fp32 sums in another order, rounded to the parameters' dtype) within rounding,
    from a contiguous and an expanded (stride-0) gradient, for every subset of inputs that want a gradient."""
    for rows, n, strided in ((3, 7, False), (130, 33, True), (70, 768, False)):
        x0, w0, b0 = _affine_inputs(rows, n, dtype, strided)
        for out in {dtype, torch.float32}:
            for g in (torch.randn(rows, n).to(out), torch.randn(1, n).to(out).expand(rows, n)):
                for want_x, want_w in ((True, True), (True, False), (False, True)):
                    grads = []
                    for native in (True, False):
                        x = x0.clone().requires_grad_(want_x)
                        w = w0.to(dtype).requires_grad_(want_w)
                        b = b0.to(dtype).requires_grad_() if bias else None
                        with contextlib.nullcontext() if native else N.disabled():
                            y = norm_affine(x, w, b, one_plus, out)
                            inputs = [t for t in (x, w, b) if t is not None and t.requires_grad]
                            grads.append(torch.autograd.grad(y, inputs, g))
                    for a, e, t in zip(*grads, [t for t in (x, w, b) if t is not None and t.requires_grad]):
                        assert a.dtype == e.dtype == t.dtype and a.shape == e.shape
                        if t is x:
                            assert torch.equal(a, e)
                        else:
                            # fp32 sums in two orders, then one rounding to the parameter's dtype (1 ulp)
                            torch.testing.assert_close(a.float(), e.float(), atol=1e-5 * rows,
                                                       rtol=max(1e-5, torch.finfo(t.dtype).eps))


def test_affine_backward_sums_do_not_depend_on_the_thread_count():
    x, g = torch.randn(4000, 64).bfloat16(), torch.randn(4000, 64)
    gamma = torch.rand(64) + 0.5
    old = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(N.affine_bwd(g, x, gamma, True, True, True))
    finally:
        torch.set_num_threads(old)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_exact_norm_native_and_torch_path_agree_and_save_the_same_bytes(dtype):
    """An exact LayerNorm and three consumers inside a shared-saves region under autocast: the same outputs
    (y is bitwise), the same gradients within rounding, the same saved bytes (the rebuilt y is not kept)."""
    from lmbp_convert.enums import NormType
    from lmbp_convert.nn.exact_norms import MSExactNorm
    from testsupport.regions import open_region

    torch.manual_seed(5)
    norm = MSExactNorm(NormType.LAYER, (48,), 1e-6, torch.nn.Parameter(torch.rand(48).to(dtype) + 0.5),
                       torch.nn.Parameter(torch.randn(48).to(dtype)))
    lins = [torch.nn.Linear(48, 24).to(dtype) for _ in range(3)]
    params = [p for m in [norm, *lins] for p in m.parameters()]
    x0 = torch.randn(4, 19, 48, dtype=dtype)
    runs = []
    for native in (True, False):
        x = x0.clone().requires_grad_()
        with (contextlib.nullcontext() if native else N.disabled()), SavedTensorLedger(params) as led:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                with open_region() as region:
                    y = norm(x * 1)
                    outs = [lin(y) for lin in lins]
            loss = sum(o.float().square().sum() for o in outs)
            grads = torch.autograd.grad(loss, [x, *params])
        runs.append(([o.detach() for o in outs], grads, led.bytes, region.recipes))
    (o1, g1, b1, r1), (o2, g2, b2, r2) = runs
    assert b1 == b2 and r1 == r2 > 0
    assert all(torch.equal(a, b) for a, b in zip(o1, o2))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a.float(), b.float(), **tol(dtype, "bwd"))


# --------------------------------------------------------------------------------------------- dispatch
def test_not_applicable_returns_none():
    x = torch.randn(8, 16)
    thr = A.get_constants("gelu", 2).c_f32
    assert N.act_fwd(x.double(), "gelu", 2, thr) is None  # fp64: PyTorch path (gradcheck)
    assert N.act_fwd(x.to("meta"), "gelu", 2, thr) is None
    assert N.act_fwd(x[:0], "gelu", 2, thr) is None
    assert N.norm_fwd(x.double(), 16, 1e-5, False, torch.float64) is None
    assert N.norm_bwd(x, x.bfloat16(), torch.ones(8), False, torch.float32) is None  # g and y dtypes differ
    gamma = torch.ones(16)
    assert N.affine_fwd(x.double(), gamma, None, torch.float64) is None
    assert N.affine_fwd(x, gamma.bfloat16(), None, torch.float32) is None  # γ, β: fp32 vectors of the row length
    assert N.affine_fwd(x, torch.ones(8), None, torch.float32) is None
    assert N.affine_bwd(x, x[:4], gamma, True, True, True) is None  # g and x̂ shapes differ
    with torch.enable_grad():  # an input autograd records (double backward): the PyTorch path's ops
        assert N.affine_fwd(x, gamma.clone().requires_grad_(), None, torch.float32) is None
    with N.disabled():
        assert N.act_fwd(x, "gelu", 2, thr) is None
    assert N.act_fwd(x, "gelu", 2, thr) is not None


def test_dispatch_modes_see_the_torch_ops():
    """A dispatch mode (a tracer, FlopCounter, fake tensors) must see real ops, not a ctypes call."""
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        y, _ = A._fwd_torch(torch.randn(64), "silu", 2)
    assert any("silu" in s for s in seen) and y.shape == (64,)


def test_compile_traces_the_torch_path():
    f = torch.compile(lambda t: A.approx_act(t, "gelu", 2), backend="eager", fullgraph=True)
    x = torch.randn(4, 32, requires_grad=True)
    f(x).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    A.approx_act(x2, "gelu", 2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


# --------------------------------------------------------------------------------------- build / fallback
def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=300)


_FALLBACK_CHECK = """
    import warnings, torch
    from lmbp_convert.ops import approx_act as A, ms_norm as M
    from lmbp_convert.ops.backends import cpu_native as N
    from lmbp_convert.ops.norm_affine import norm_affine
    x = torch.randn(5, 40, requires_grad=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        A.approx_act(x, "silu", 2).sum().backward()
        A.approx_act(x, "gelu", 2).sum().backward()
        M.ms_layer_norm(x, 40).sum().backward()
        norm_affine(x, torch.ones(40, requires_grad=True), torch.zeros(40), False, torch.bfloat16).sum().backward()
    lines = [str(m.message) for m in w if "native CPU kernels" in str(m.message)]
    print(len(lines), "|", N.status(), "|", lines[0] if lines else "")
"""


@pytest.mark.slow  # fresh Python process
def test_env_switch_turns_it_off_without_a_notice():
    proc = _run(_FALLBACK_CHECK, LMBP_CPU_NATIVE="0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    count, status, _ = proc.stdout.rstrip("\n").split(" | ")
    assert count == "0" and "PyTorch path (LMBP_CPU_NATIVE=0)" in status


@pytest.mark.slow  # fresh Python process
def test_no_compiler_falls_back_with_one_notice(tmp_path):
    proc = _run(_FALLBACK_CHECK, CXX=str(tmp_path / "no-such-compiler"), LMBP_CPU_NATIVE_DIR=str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    count, status, line = proc.stdout.rstrip("\n").split(" | ")
    assert count == "1" and status.startswith("PyTorch path (no C++ compiler")
    assert "\n" not in line and "using the PyTorch path" in line


@pytest.mark.slow  # fresh Python process
def test_failing_build_falls_back_with_one_notice(tmp_path):
    fake = tmp_path / "fake-cxx"
    fake.write_text("#!/bin/sh\necho 'fake-cxx: error: cannot compile' >&2\nexit 1\n")
    fake.chmod(0o755)
    proc = _run(_FALLBACK_CHECK, CXX=str(fake), LMBP_CPU_NATIVE_DIR=str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    count, status, line = proc.stdout.rstrip("\n").split(" | ")
    assert count == "1" and "cannot compile" in status and "cannot compile" in line
    assert not list((tmp_path / "c").rglob("*.so"))  # nothing half-built left behind


@pytest.mark.slow  # fresh Python processes
def test_cached_build_is_reused_across_processes():
    info = N.build_info()
    proc = _run("from lmbp_convert.ops.backends import cpu_native as N\n"
                "i = N.build_info(); print(i['path'], i['built'])")
    assert proc.returncode == 0, proc.stderr[-2000:]
    path, built = proc.stdout.split()
    assert path == info["path"] and built == "False"


def _host_flags() -> set:
    try:
        with open("/proc/cpuinfo") as fh:
            return {f for ln in fh if ln.startswith("flags") for f in ln.split(":", 1)[1].split()}
    except OSError:
        return set()


def _arch_variants() -> list:
    """Builds -march=native does not make on this host: the AVX2 loops on an AVX-512 host, the portable loops."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    flags = _host_flags()
    out = [""]
    if {"avx2", "fma", "avx512f"} <= flags:
        out.append("-mavx2 -mfma -mf16c" if "f16c" in flags else "-mavx2 -mfma")
    return out


@pytest.mark.slow  # fresh Python processes, one build each
@pytest.mark.parametrize("arch", _arch_variants())
def test_other_instruction_sets_match_the_torch_path(arch, tmp_path):
    """The vector loops for another instruction set (LMBP_CPU_NATIVE_ARCH) pass the same checks as the host's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(LMBP_CPU_NATIVE_ARCH=arch, LMBP_CPU_NATIVE_DIR=str(tmp_path / "build"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.abspath(__file__), os.path.join(TESTS_OPS, "test_exact_norm.py"),
                           "-k", "act_codes_identical or norm_matches_torch_path or affine or one_node"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout
    assert list((tmp_path / "build").rglob("*.so"))  # built with these flags, not a cached native build


def test_first_build_says_in_one_line_what_it_compiles(tmp_path, monkeypatch, capsys):
    """The first use compiles for ~10-25 s: one stderr line says what, about how long and where it is cached, once
    (not again for the next flag set, and not when the library is already in the cache)."""
    calls = []

    def no_compiler_run(cxx, flags, out):  # the build itself is not what is tested: fail every flag set
        calls.append(flags)
        raise RuntimeError("not built in this test")

    cached = os.path.dirname(os.path.dirname(N.build_info()["path"]))
    monkeypatch.setenv(N.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(build, "_announced", set())
    monkeypatch.setattr(N, "_compile", no_compiler_run)
    with pytest.raises(RuntimeError, match="not built in this test"):
        N._build_and_load()
    err = capsys.readouterr().err
    assert calls and err.count("\n") == 1, err
    assert err.startswith("lmbp_convert: compiling the native CPU kernels (cpu_ops.cpp, ")
    assert f"about {build.BUILD_SECONDS['cpu_ops']} s; cached in {tmp_path}" in err
    # a cached library: nothing said (the real cache of this process's build)
    monkeypatch.setattr(build, "_announced", set())
    monkeypatch.setenv(N.ENV_DIR, cached)
    N._build_and_load()
    assert capsys.readouterr().err == ""
