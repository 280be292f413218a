"""Smoke tests of the op benchmarks: benchmarks.ops runs and prints its table; benchmarks.kernels refuses to run
without CUDA, and its non-CUDA logic (arguments, byte accounting, tables, the bench run through Triton's
interpreter on CPU tensors) is right, since CI never sees a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import common as C
from benchmarks import kernels as K
from benchmarks import ops as bench

ROOT = C.ROOT


def _env(**extra: str) -> dict:
    """The environment a user runs the benchmarks in: no Triton interpreter (the test session sets it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(extra)
    return env


# ------------------------------------------------------------------------------------------ bench_ops
@pytest.mark.slow  # a subprocess or Triton's interpreter
def test_bench_quick_prints_table(tmp_path):
    out = tmp_path / "bench.md"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.ops", "--quick", "--out", str(out)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout
    assert "| op | vs torch op | dtype | shape |" in text
    assert "CPU:" in text and f"torch {torch.__version__}" in text
    table = [line for line in text.splitlines()
             if line.startswith(("| ms_", "| approx_act")) and line.count("|") == len(bench.TIME_HEADER) + 1]
    refs = {line.split("|")[2].strip() for line in table}
    assert {"F.layer_norm +affine", "F.layer_norm", "F.rms_norm +weight", "F.rms_norm"} <= refs
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


def test_cpu_targets_json_and_docs_table(tmp_path):
    """--cpu-targets measures the issue's pairs (later flags override its shapes); --json keeps the rows and how they
    were timed; the docs table keeps each op against the op it replaces (norms: with their affine) and its target."""
    a = bench.parse_args(["--cpu-targets"])
    assert a.shape_list == [(64, 197, 768), (8, 512, 4096)] and a.threads == 1 and a.kind_list == ["gelu", "silu"]
    threads = torch.get_num_threads()  # main() sets torch's threads: restored after
    path = tmp_path / "ops.json"
    try:
        assert bench.main(["--cpu-targets", "--shapes", "4x64", "--dtypes", "fp32", "--runs", "1", "--warmup", "0",
                           "--json", str(path)]) == 0
    finally:
        torch.set_num_threads(threads)
    data = json.loads(path.read_text())
    assert data["threads"] == 1 and data["clock"] == "thread_time" and data["shapes"] == "4x64"
    assert {r["op"] for r in data["rows"]} == {"approx_act gelu (2-bit)", "approx_act silu (2-bit)", "ms_layer_norm",
                                               "ms_rms_norm"}
    table = bench.cpu_targets_table(data).splitlines()[2:]
    refs = [line.split("|")[2].strip() for line in table]
    assert sorted(refs) == ["F.gelu", "F.layer_norm +affine", "F.rms_norm +weight", "F.silu"]
    assert all(("≤ 1.00×" in line) == ("approx_act" in line) for line in table)


def test_bench_args():
    a = bench.parse_args(["--sizes", "8K,1M", "--row", "1024", "--dtypes", "bf16"])
    assert a.size_list == [8192, 2 ** 20] and a.dtype_list == [torch.bfloat16]
    assert bench.parse_args(["--quick"]).size_list == [65536]
    for bad in (["--dtypes", "fp8"], ["--sizes", "1000"], ["--kinds", "relu"], ["--ops", "conv"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_bench_rows_format():
    r = bench.Row("ms_rms_norm", "F.rms_norm", "fp32", "4x8", 0.002, 0.004, 0.001, 0.004, 3 * 2 ** 20, 2048)
    assert r.ratio == pytest.approx(1.2)
    cells = bench.time_rows([r])[0]
    assert cells[6] == "6.00 / 5.00" and cells[7] == "1.20×" and cells[8] == "yes"
    assert cells[9] == "3.0 MiB / 2.0 KiB"
    slow = bench.Row("a", "b", "fp32", "1", 0.5, 0.5, 0.1, 0.1, 0, 0)
    assert bench.time_rows([slow])[0][8] == "**no**"
    md = bench.markdown_table(("x", "y"), [(1, 2)])
    assert md.splitlines() == ["| x | y |", "|---|---|", "| 1 | 2 |"]


# ------------------------------------------------------------------------------------------- kernels
@pytest.mark.slow  # a subprocess or Triton's interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_kernels_fail_fast_without_cuda():
    """It refuses before measuring anything: exit 2 and the one-line message (no wall-clock assertion: CI's
    machine is shared, and the subprocess timeout is only a safety net)."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.kernels"], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == K.NO_CUDA_MESSAGE and proc.stdout == ""


@pytest.mark.slow  # a subprocess or Triton's interpreter
def test_kernels_refuse_the_interpreter():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.kernels"], cwd=ROOT, env=_env(TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "TRITON_INTERPRET=1" in proc.stderr


def test_kernels_args(monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    a = K.parse_args([])
    assert a.size_list == [16 * 2 ** 20, 64 * 2 ** 20, 256 * 2 ** 20]
    assert a.dtype_list == [torch.bfloat16, torch.float32] and a.bits == 2 and a.out is None
    monkeypatch.setenv("OUT", "/tmp/somewhere")
    assert K.parse_args(["--quick"]).out == "/tmp/somewhere/kernels.md"
    assert K.parse_args(["--out", "x.md"]).out == "x.md"
    for bad in (["--dtypes", "fp64"], ["--sizes", "100"], ["--bits", "0"], ["--runs", "0"]):
        with pytest.raises(SystemExit):
            K.parse_args(bad)


def test_kernels_accounting_and_table():
    x = torch.empty(4, 8, dtype=torch.bfloat16)
    wide = torch.empty(4, 16)
    assert K.io_bytes([x, None], [wide[:, :8]]) == 64 + 128  # a view counts by its own size
    assert K.gbps(4.8e12, 1.0) == pytest.approx(4800.0)
    assert K.pct_peak(2400.0) == pytest.approx(50.0)
    assert C.size_label(16 * 2 ** 20) == "16M" and C.size_label(1000) == "1000"
    r = K.BenchResult("ms_rms_norm", "rms_norm", "bf16", 2 ** 20, 1e-3, 2e-3, 2.4 * 10 ** 9, 2.4 * 10 ** 9,
                      1e-3, 1e-3, 10 ** 9, 10 ** 9)
    row = K.bench_table([r]).splitlines()[2]
    assert "| 1M |" in row and "2400 / 1000" in row and "50% / 21%" in row and "1000.0 / 1000.0" in row


@pytest.fixture
def k_cpu(monkeypatch):
    """The bandwidth bench's code on CPU tensors (Triton's interpreter is on in tests)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (the root conftest.py sets it)")
    pytest.importorskip("triton")
    monkeypatch.setattr(K, "DEVICE", "cpu")
    return K


@pytest.mark.slow  # a subprocess or Triton's interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_kernels_bench_bytes(k_cpu):
    """The bytes each benchmarked kernel moves, against hand counts (bf16, 8 rows of 64)."""
    from lmbp_convert.ops.approx_act import ACT_KINDS

    rows, n, s = 8, 64, 2
    act = rows * n * s
    op, ref = k_cpu.norm_kernels(rows * n, n, torch.bfloat16, is_rms=False)
    assert op.fwd_bytes == 2 * act + 4 * rows  # x in, y out, fp32 rstd out
    assert op.bwd_bytes == 3 * act + 4 * rows  # g, y, rstd in; dx out
    stat = ref.fwd_bytes - (2 * act + 2 * n * s)  # torch: x, weight, bias in; y, mean, rstd out
    assert stat in (2 * rows * 4, 2 * rows * s)  # fp32 statistics (CUDA) or the input dtype's (CPU)
    op, _ = k_cpu.norm_kernels(rows * n, n, torch.bfloat16, is_rms=True)
    assert (op.fwd_bytes, op.bwd_bytes) == (2 * act + 4 * rows, 3 * act + 4 * rows)
    op, ref = k_cpu.gated_kernels(rows * n, n, torch.bfloat16)
    assert (op.fwd_bytes, op.bwd_bytes) == (3 * act, 5 * act)  # g, u -> h; dh, g, u -> dg, du
    assert (ref.fwd_bytes, ref.bwd_bytes) == (op.fwd_bytes, op.bwd_bytes)
    for k in (op, ref):  # the closures run
        k.fwd()
        k.bwd()
    for kind in ACT_KINDS:
        op, ref = k_cpu.act_kernels(rows * n, n, torch.bfloat16, kind, bits=2)
        codes = rows * n // 4  # 2-bit codes, four per byte
        assert (op.fwd_bytes, op.bwd_bytes) == (2 * act + codes, 2 * act + codes)  # x -> y, codes; g, codes -> dx
        assert (ref.fwd_bytes, ref.bwd_bytes) == (2 * act, 3 * act)  # torch: x -> y; g, x -> dx
        for k in (op, ref):
            k.fwd()
            k.bwd()


@pytest.mark.slow  # a subprocess or Triton's interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # interpreter, large |x|
def test_kernels_main_flow_on_interpreter(k_cpu, monkeypatch, tmp_path, capsys):
    """main() end to end, CUDA swapped for CPU tensors through the interpreter: bench, report file."""
    monkeypatch.setattr(k_cpu, "environment_problem", lambda: None)
    monkeypatch.setenv("OUT", str(tmp_path))
    rc = k_cpu.main(["--dtypes", "bf16", "--sizes", "2K", "--row", "512", "--runs", "1", "--warmup", "0"])
    shown = capsys.readouterr().out
    assert rc == 0, shown
    report = (tmp_path / "kernels.md").read_text()
    bench_rows = [line for line in report.splitlines() if line.startswith("| ") and " | 2K | " in line]
    ops = {line.split("|")[1].strip() for line in bench_rows}
    assert {"ms_layer_norm", "ms_rms_norm", "gated_mlp silu (elementwise)", "approx_act quick_gelu 2-bit"} <= ops
    assert "## Skipped" not in report
