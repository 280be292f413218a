"""Smoke tests of the benchmark scripts: bench_ops.py runs and prints its table; gpu_check.py refuses to run
without CUDA, and its non-CUDA logic (arguments, byte accounting, tables, the checker itself, the check code
run through Triton's interpreter on CPU tensors) is right, since CI never sees a GPU."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.slow  # runs the scripts in subprocesses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "scripts", "bench_ops.py")
GPU_CHECK = os.path.join(ROOT, "scripts", "gpu_check.py")
HAS_APPROX_ACT = importlib.util.find_spec("lmbp_convert.ops.approx_act") is not None


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _load(BENCH, "_lmbp_bench_ops")


@pytest.fixture(scope="module")
def gc():
    return _load(GPU_CHECK, "_lmbp_gpu_check")


def _env(**extra: str) -> dict:
    """The environment a user runs the scripts in: no Triton interpreter (the test session sets it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(extra)
    return env


# ------------------------------------------------------------------------------------------ bench_ops
def test_bench_quick_prints_table(bench, tmp_path):
    out = tmp_path / "bench.md"
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--out", str(out)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout
    assert "| op | vs torch op | dtype | shape |" in text
    assert "CPU:" in text and f"torch {torch.__version__}" in text
    table = [line for line in text.splitlines()
             if line.startswith(("| ms_", "| approx_act")) and line.count("|") == len(bench.TIME_HEADER) + 1]
    refs = {line.split("|")[2].strip() for line in table}
    assert {"F.layer_norm +affine", "F.layer_norm", "F.rms_norm +weight", "F.rms_norm"} <= refs
    if HAS_APPROX_ACT:
        assert {"F.gelu", "F.gelu(tanh)", "F.silu", "x*sigmoid(1.702x)"} <= refs
    for line in table:  # every timing and ratio cell holds a number
        cells = [c.strip() for c in line.strip("|").split("|")]
        ratio = float(cells[7].rstrip("×"))
        totals = [float(v) for v in cells[6].split(" / ")]
        assert ratio > 0 and len(totals) == 2 and min(totals) > 0, line
    # The norm → Linear table shows the sharing: torch's pair keeps about twice the MS pair's bytes.
    pair = [line for line in text.splitlines() if line.startswith("| ms_layer_norm → folded Linear")]
    assert pair, text
    assert 1.9 < float(pair[0].strip("| ").split("|")[-1].strip().rstrip("×")) < 2.1, pair[0]
    assert out.read_text().strip() in text


def test_bench_args(bench):
    a = bench.parse_args(["--sizes", "8K,1M", "--row", "1024", "--dtypes", "bf16"])
    assert a.size_list == [8192, 2 ** 20] and a.dtype_list == [torch.bfloat16]
    assert bench.parse_args(["--quick"]).size_list == [65536]
    for bad in (["--dtypes", "fp8"], ["--sizes", "1000"], ["--kinds", "relu"], ["--ops", "conv"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_bench_rows_format(bench):
    r = bench.Row("ms_rms_norm", "F.rms_norm", "fp32", "4x8", 0.002, 0.004, 0.001, 0.004, 3 * 2 ** 20, 2048)
    assert r.ratio == pytest.approx(1.2)
    cells = bench.time_rows([r])[0]
    assert cells[6] == "6.00 / 5.00" and cells[7] == "1.20×" and cells[8] == "yes"
    assert cells[9] == "3.0 MiB / 2.0 KiB"
    slow = bench.Row("a", "b", "fp32", "1", 0.5, 0.5, 0.1, 0.1, 0, 0)
    assert bench.time_rows([slow])[0][8] == "**no**"
    md = bench.markdown_table(("x", "y"), [(1, 2)])
    assert md.splitlines() == ["| x | y |", "|---|---|", "| 1 | 2 |"]


# ------------------------------------------------------------------------------------------ gpu_check
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_gpu_check_fails_fast_without_cuda(gc):
    """It refuses before measuring anything: exit 2 and the one-line message (no wall-clock assertion: CI's
    machine is shared, and the subprocess timeout is only a safety net)."""
    proc = subprocess.run([sys.executable, GPU_CHECK], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "no CUDA device available" in proc.stderr and proc.stderr.strip() == gc.NO_CUDA_MESSAGE
    assert proc.stdout == ""


def test_gpu_check_refuses_the_interpreter():
    proc = subprocess.run([sys.executable, GPU_CHECK, "--skip-bench"], cwd=ROOT, env=_env(TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "TRITON_INTERPRET=1" in proc.stderr


def test_gpu_check_args(gc, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    a = gc.parse_args([])
    assert a.size_list == [16 * 2 ** 20, 64 * 2 ** 20, 256 * 2 ** 20]
    assert a.dtype_list == [torch.float32, torch.float16, torch.bfloat16] and a.bits_list == [1, 2, 3, 4]
    assert a.out is None
    monkeypatch.setenv("OUT", "/tmp/somewhere")
    assert gc.parse_args(["--quick"]).out == "/tmp/somewhere/gpu_check.md"
    assert gc.parse_args(["--out", "x.md"]).out == "x.md"
    for bad in (["--dtypes", "fp64"], ["--sizes", "100"], ["--bits", "0"], ["--runs", "0"]):
        with pytest.raises(SystemExit):
            gc.parse_args(bad)


def test_gpu_check_accounting_and_table(gc):
    x = torch.empty(4, 8, dtype=torch.bfloat16)
    wide = torch.empty(4, 16)
    assert gc.io_bytes([x, None], [wide[:, :8]]) == 64 + 128  # a view counts by its own size
    assert gc.gbps(4.8e12, 1.0) == pytest.approx(4800.0)
    assert gc.pct_peak(2400.0) == pytest.approx(50.0)
    assert gc.size_label(16 * 2 ** 20) == "16M" and gc.size_label(1000) == "1000"
    r = gc.BenchResult("ms_rms_norm", "rms_norm", "bf16", 2 ** 20, 1e-3, 2e-3, 2.4 * 10 ** 9, 2.4 * 10 ** 9,
                       1e-3, 1e-3, 10 ** 9, 10 ** 9)
    row = gc.bench_table([r]).splitlines()[2]
    assert "| 1M |" in row and "2400 / 1000" in row and "50% / 21%" in row and "1000.0 / 1000.0" in row


def test_gpu_check_checker_reports_failures(gc):
    ck = gc.Checker(time.perf_counter() + 60)
    a = torch.ones(3)
    assert ck.compare("same", torch.float32, (3,), lambda: [("a", a, a.clone())])
    assert not ck.compare("off", torch.float32, (3,), lambda: [("a", a, a + 1e-2)])
    assert not ck.compare("dtype", torch.float32, (3,), lambda: [("a", a, a.double())])
    assert not ck.compare("raises", torch.float32, (3,), lambda: 1 / 0)
    assert [r.ok for r in ck.results] == [True, False, False, False]
    assert ck.results[1].max_err == pytest.approx(1e-2) and "ZeroDivisionError" in ck.results[3].detail
    assert "**FAIL**" in gc.check_table(ck.results)
    late = gc.Checker(time.perf_counter() - 1)
    assert late.out_of_time("x") and late.timed_out and late.skipped[0].startswith("x ")


def test_gpu_check_report(gc):
    args = gc.parse_args(["--quick"])
    ok = gc.CheckResult("good", "bf16", "2x3", 0.0, True)
    bad = gc.CheckResult("bad", "fp16", "4", 0.5, False, "y: Mismatched elements")
    b = gc.BenchResult("ms_layer_norm", "layer_norm", "fp32", 2 ** 20, 1e-3, 1e-3, 10 ** 9, 10 ** 9, 1e-3,
                       1e-3, 10 ** 9, 10 ** 9)
    full = gc.render([ok, bad], [b], [], args, 12.0, full=True)
    short = gc.render([ok, bad], [b], [], args, 12.0, full=False)
    assert "1/2 checks pass" in full and "| good |" in full and "| good |" not in short
    assert "**FAIL** y: Mismatched elements" in short and "1 CHECKS FAILED" in short
    assert "| ms_layer_norm | layer_norm | fp32 | 1M |" in short
    done = gc.render([ok], [], ["x and the rest of its section (time budget)"], args, 1.0, full=False)
    assert "ALL CHECKS PASS (INCOMPLETE" in done and "## Skipped" in done


@pytest.fixture
def gc_cpu(gc, monkeypatch):
    """gpu_check's check code on CPU tensors (Triton's interpreter is on in tests), on small cases."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (tests/conftest.py sets it)")
    pytest.importorskip("triton")
    monkeypatch.setattr(gc, "DEVICE", "cpu")
    monkeypatch.setattr(gc, "NORM_CASES", [(5, 33, None), (3, 300, 64), (2, 16385, None)])
    monkeypatch.setattr(gc, "NORM_PUBLIC_ROWS", (64,))
    monkeypatch.setattr(gc, "GATED_CASES", [(5, 33, False), (3, 20, True)])
    monkeypatch.setattr(gc, "ACT_CHECK_SHAPES", [(3, 37, False), (2, 50, True)])
    return gc


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_gpu_check_bench_bytes(gc_cpu):
    """The bytes each benchmarked kernel moves, against hand counts (bf16, 8 rows of 64)."""
    rows, n, s = 8, 64, 2
    act = rows * n * s
    op, ref = gc_cpu.norm_kernels(rows * n, n, torch.bfloat16, is_rms=False)
    assert op.fwd_bytes == 2 * act + 4 * rows  # x in, y out, fp32 rstd out
    assert op.bwd_bytes == 3 * act + 4 * rows  # g, y, rstd in; dx out
    stat = ref.fwd_bytes - (2 * act + 2 * n * s)  # torch: x, weight, bias in; y, mean, rstd out
    assert stat in (2 * rows * 4, 2 * rows * s)  # fp32 statistics (CUDA) or the input dtype's (CPU)
    op, _ = gc_cpu.norm_kernels(rows * n, n, torch.bfloat16, is_rms=True)
    assert (op.fwd_bytes, op.bwd_bytes) == (2 * act + 4 * rows, 3 * act + 4 * rows)
    op, ref = gc_cpu.gated_kernels(rows * n, n, torch.bfloat16)
    assert (op.fwd_bytes, op.bwd_bytes) == (3 * act, 5 * act)  # g, u -> h; dh, g, u -> dg, du
    assert (ref.fwd_bytes, ref.bwd_bytes) == (op.fwd_bytes, op.bwd_bytes)
    for k in (op, ref):  # the closures run
        k.fwd()
        k.bwd()
    if HAS_APPROX_ACT:
        from lmbp_convert.ops.approx_act import ACT_KINDS

        for kind in ACT_KINDS:
            op, ref = gc_cpu.act_kernels(rows * n, n, torch.bfloat16, kind, bits=2)
            codes = rows * n // 4  # 2-bit codes, four per byte
            # ours: x -> y, codes; g, codes -> dx
            assert (op.fwd_bytes, op.bwd_bytes) == (2 * act + codes, 2 * act + codes)
            assert (ref.fwd_bytes, ref.bwd_bytes) == (2 * act, 3 * act)  # torch: x -> y; g, x -> dx
            for k in (op, ref):
                k.fwd()
                k.bwd()


def test_gpu_check_compile_check_runs(gc_cpu, monkeypatch):
    """The torch.compile section's code (on CPU it compiles the PyTorch path; one op keeps this short)."""
    monkeypatch.setattr(gc_cpu, "COMPILE_OPS", ("ms_rms_norm",))
    ck = gc_cpu.Checker(time.perf_counter() + 600)
    gc_cpu.check_compile(ck, torch.float32)
    assert [(r.name, r.ok) for r in ck.results] == [("ms_rms_norm torch.compile(fullgraph) vs eager", True)], \
        [r.detail for r in ck.results]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # interpreter, large |x|
def test_gpu_check_main_flow_on_interpreter(gc_cpu, monkeypatch, tmp_path, capsys):
    """main() end to end, CUDA swapped for CPU tensors through the interpreter: sections, bench, report file."""
    monkeypatch.setattr(gc_cpu, "environment_problem", lambda: None)
    monkeypatch.setattr(gc_cpu, "COMPILE_OPS", ())
    monkeypatch.setenv("OUT", str(tmp_path))
    rc = gc_cpu.main(["--dtypes", "bf16", "--bits", "2,3", "--bench-dtypes", "bf16", "--sizes", "2K,4K",
                      "--row", "512", "--runs", "1", "--warmup", "0"])
    shown = capsys.readouterr().out
    assert rc == 0, shown
    report = (tmp_path / "gpu_check.md").read_text()
    assert "ALL CHECKS PASS" in shown and "ALL CHECKS PASS" in report and "## Skipped" not in report
    assert "| ms_layer_norm triton fwd vs torch path | bf16 | 5x33 |" in report  # every check in the file
    assert "| ms_layer_norm triton fwd vs torch path |" not in shown  # only failures on stdout
    for name in ("ms_layer_norm triton chunk=64 bwd vs torch path", "ms_rms_norm triton fp32 in, low out",
                 "ms_rms_norm autocast bf16: saved bytes shared with Linear",
                 "gated_mlp gelu_tanh triton strided halves bwd vs torch path",
                 "gated_mlp silu op end to end vs eager"):
        assert f"| {name} |" in report, name
    if HAS_APPROX_ACT:
        for name in ("approx_act quick_gelu 3-bit triton strided fwd vs torch path",
                     "approx_act gelu 2-bit op end to end vs PyTorch path"):
            assert f"| {name} |" in report, name
    bench_rows = [line for line in report.splitlines() if line.startswith("| ") and " | 4K | " in line]
    ops = {line.split("|")[1].strip() for line in bench_rows}
    assert {"ms_layer_norm", "ms_rms_norm", "gated_mlp silu (elementwise)"} <= ops
    if HAS_APPROX_ACT:
        assert "approx_act quick_gelu 2-bit" in ops


def test_gpu_check_catches_a_wrong_kernel(gc_cpu, monkeypatch):
    """A kernel off by 1% fails its checks (and only those): the checks can fail."""
    from lmbp_convert.ops import ms_norm as M

    monkeypatch.setattr(gc_cpu, "NORM_CASES", [(5, 33, None)])
    right = M._bwd_torch
    monkeypatch.setattr(M, "_bwd_triton", lambda g, y, r, is_rms, dt, chunk=None: right(g, y, r, is_rms, dt) * 1.01)
    ck = gc_cpu.Checker(time.perf_counter() + 600)
    gc_cpu.check_norms(ck, [torch.float32])
    failed = {r.name for r in ck.results if not r.ok}
    assert "ms_layer_norm triton bwd vs torch path" in failed and "ms_rms_norm triton strided rows" in failed
    assert not any("fwd" in name for name in failed)
