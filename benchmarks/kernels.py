"""Per-kernel bandwidth on a CUDA machine: each Triton kernel's forward / backward GB/s next to torch's own kernel.

    python -m benchmarks.kernels                 # bf16 + fp32 at 16M / 64M / 256M elements
    python -m benchmarks.kernels --quick         # small sizes, fewer runs
    python -m benchmarks.kernels --dtypes bf16 --sizes 64M

Bytes moved: every tensor a kernel must read plus every tensor it writes, once (``io_bytes``); a kernel at the
memory roofline reaches the peak. Time: CUDA events, median of ``--runs`` (L2 flushed and the GPU kept busy ahead
of the timed launch, so host launch latency is not timed). Bandwidth is printed as % of the datasheet HBM peak
(H200: 4.8 TB/s) and of a measured device-to-device copy (the practical ceiling). (The approx_act kernel variants
this benchmark once timed against each other are deleted; what they measured: lmbp_convert/ops/approx_act.py,
``FWD_LAUNCH``.) A time budget (``--budget-s``) skips what would overrun it; skipped work is listed. Writes ``$OUT/kernels.md`` when OUT is set (or ``--out``).
Exit status 2 without CUDA (or with Triton's interpreter on).

The kernels' correctness on a GPU is tested, not benchmarked: ``TRITON_INTERPRET=0 python -m pytest
tests/ops/test_cuda.py`` (skipped without CUDA; scripts/gpu_run.sh runs it first).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch

from benchmarks.common import DTYPE_NAMES, markdown_table, parse_dtypes, parse_size, size_label

HBM_PEAK_GBPS = 4800.0  # H200 HBM3e, TB/s * 1000
#: Where the kernels allocate; tests set "cpu" to run the same code through Triton's interpreter.
DEVICE = "cuda"
NO_CUDA_MESSAGE = ("benchmarks.kernels: no CUDA device available (torch.cuda.is_available() is False). It times "
                   "the Triton kernels on a CUDA GPU; run it on the GPU machine.")

# ------------------------------------------------------------------------------------------ accounting
def io_bytes(reads: Iterable[Optional[torch.Tensor]], writes: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes a kernel must move: each tensor read once plus each tensor written once (views by their size)."""
    return sum(t.numel() * t.element_size() for t in list(reads) + list(writes) if t is not None)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def pct_peak(gb_per_s: float, peak: float = HBM_PEAK_GBPS) -> float:
    return 100.0 * gb_per_s / peak



@dataclass
class BenchResult:
    op: str
    ref: str
    dtype: str
    numel: int
    fwd_s: float
    bwd_s: float
    fwd_bytes: int
    bwd_bytes: int
    ref_fwd_s: float
    ref_bwd_s: float
    ref_fwd_bytes: int
    ref_bwd_bytes: int


def _g(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.0f}"


def bench_table(results: Sequence[BenchResult], peak: float = HBM_PEAK_GBPS,
                copy_gbps: Optional[float] = None) -> str:
    header = ("op (Triton)", "torch op", "dtype", "elements", "fwd GB/s op / torch", "fwd % peak op / torch",
              "bwd GB/s op / torch", "bwd % peak op / torch", "fwd µs op / torch", "bwd µs op / torch")
    if copy_gbps:
        header += ("fwd % copy op / torch", "bwd % copy op / torch")
    rows = []
    for r in results:
        f, rf = gbps(r.fwd_bytes, r.fwd_s), gbps(r.ref_fwd_bytes, r.ref_fwd_s)
        b, rb = gbps(r.bwd_bytes, r.bwd_s), gbps(r.ref_bwd_bytes, r.ref_bwd_s)
        row = (r.op, r.ref, r.dtype, size_label(r.numel), f"{_g(f)} / {_g(rf)}",
               f"{pct_peak(f, peak):.0f}% / {pct_peak(rf, peak):.0f}%", f"{_g(b)} / {_g(rb)}",
               f"{pct_peak(b, peak):.0f}% / {pct_peak(rb, peak):.0f}%",
               f"{r.fwd_s * 1e6:.1f} / {r.ref_fwd_s * 1e6:.1f}",
               f"{r.bwd_s * 1e6:.1f} / {r.ref_bwd_s * 1e6:.1f}")
        if copy_gbps:
            row += (f"{pct_peak(f, copy_gbps):.0f}% / {pct_peak(rf, copy_gbps):.0f}%",
                    f"{pct_peak(b, copy_gbps):.0f}% / {pct_peak(rb, copy_gbps):.0f}%")
        rows.append(row)
    return markdown_table(header, rows)


# ---------------------------------------------------------------------------------------------- args
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="bf16,fp32", help="dtypes (fp32, fp16, bf16)")
    p.add_argument("--sizes", default="16M,64M,256M", help="sizes in elements (K/M/G suffix)")
    p.add_argument("--row", type=int, default=4096, help="norm row length (and gated MLP width)")
    p.add_argument("--runs", type=int, default=10, help="timed runs per measurement (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bits", type=int, default=2, help="approx_act bits")
    p.add_argument("--quick", action="store_true", help="1M/4M only, 5 runs")
    p.add_argument("--budget-s", type=float, default=170.0, help="skip remaining work past this many seconds")
    p.add_argument("--peak-gbps", type=float, default=HBM_PEAK_GBPS, help="HBM peak for the %% column")
    p.add_argument("--out", default=None, help="markdown file (default $OUT/kernels.md when OUT is set)")
    a = p.parse_args(argv)
    if a.quick:
        a.sizes, a.runs, a.warmup = "1M,4M", 5, 1
    a.dtype_list = parse_dtypes(p, a.dtypes)
    try:
        a.size_list = [parse_size(s) for s in a.sizes.split(",") if s.strip()]
    except ValueError:
        p.error("--sizes: cannot parse")
    if a.row <= 0 or any(s <= 0 or s % a.row for s in a.size_list):
        p.error(f"--sizes must be positive multiples of --row ({a.row})")
    if not 1 <= a.bits <= 8:
        p.error("--bits must be in 1..8")
    if a.runs < 1 or a.warmup < 0:
        p.error("--runs must be >= 1, --warmup >= 0")
    if a.out is None and os.environ.get("OUT"):
        a.out = os.path.join(os.environ["OUT"], "kernels.md")
    return a


def environment_problem() -> Optional[str]:
    """Why the checks cannot run here (None when they can). Must not import the ops: kernels are defined
    at import, after TRITON_INTERPRET is read."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return ("benchmarks.kernels: TRITON_INTERPRET=1 is set, so Triton would run its CPU interpreter "
                "instead of compiling for the GPU; unset it and run again.")
    if not torch.cuda.is_available():
        return NO_CUDA_MESSAGE
    try:
        import triton  # noqa: F401
    except Exception as e:  # pragma: no cover - environment
        return f"benchmarks.kernels: triton cannot be imported ({e}); the kernels need it."
    return None


def describe_device() -> str:
    dev = torch.device(DEVICE)
    if dev.type != "cuda":
        return f"{dev} (Triton interpreter: TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')})"
    p = torch.cuda.get_device_properties(dev)
    return f"{p.name}, {p.total_memory / 2 ** 30:.0f} GiB, {p.multi_processor_count} SMs"


def _randn(shape, dtype, scale=1.0, shift=0.0):
    return (torch.randn(*shape, device=DEVICE, dtype=torch.float32) * scale + shift).to(dtype)



# -------------------------------------------------------------------------------------------- timing
def time_device(fn: Callable[[], object], runs: int, warmup: int, flush: Optional[torch.Tensor]) -> float:
    """Median seconds of ``fn()`` on DEVICE. CUDA: event-timed GPU time, L2 flushed, the stream kept busy
    (``_sleep``) so the timed launch is queued before it starts and host launch latency is not measured.
    Elsewhere (tests): wall time."""
    for _ in range(warmup):
        fn()
    cuda = torch.device(DEVICE).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        if flush is not None:
            flush.zero_()
        if not cuda:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            continue
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU clock cycles
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


@dataclass
class Kernel:
    """One side of a bandwidth comparison: fwd and bwd closures and the bytes each must move."""

    fwd: Callable[[], object]
    bwd: Callable[[], object]
    fwd_bytes: int
    bwd_bytes: int
    keep: list = field(default_factory=list)  # tensors kept alive for the closures


def norm_kernels(numel: int, row: int, dtype: torch.dtype, is_rms: bool) -> tuple:
    import torch.nn.functional as F

    from lmbp_convert.ops import ms_norm as M

    eps = 1e-6 if is_rms else 1e-5
    rows = numel // row
    x = _randn((rows, row), dtype, 2.0)
    g = _randn((rows, row), dtype)
    y, r = M._fwd_triton(x, row, eps, is_rms, dtype)
    dx = M._bwd_triton(g, y, r, is_rms, dtype)
    op = Kernel(lambda: M._fwd_triton(x, row, eps, is_rms, dtype), lambda: M._bwd_triton(g, y, r, is_rms, dtype),
                io_bytes([x], [y, r]), io_bytes([g, y, r], [dx]))
    del dx
    # torch's kernels with a frozen affine (the op replaced; no weight gradient), called at the aten level.
    w = torch.randn(row, device=DEVICE).to(dtype)
    if is_rms:
        try:  # the fused CUDA kernels F.rms_norm dispatches to
            yr, rr = torch.ops.aten._fused_rms_norm(x, [row], w, eps)
            dxr = torch.ops.aten._fused_rms_norm_backward(g, x, [row], rr, w, [True, False])[0]
            ref = Kernel(lambda: torch.ops.aten._fused_rms_norm(x, [row], w, eps),
                         lambda: torch.ops.aten._fused_rms_norm_backward(g, x, [row], rr, w, [True, False]),
                         io_bytes([x, w], [yr, rr]), io_bytes([g, x, rr, w], [dxr]), [yr])
        except (NotImplementedError, RuntimeError, AttributeError):  # no fused kernel: F.rms_norm + autograd
            xl = x.detach().requires_grad_(True)
            yr = F.rms_norm(xl, (row,), w, eps)
            rstd_bytes = rows * 4  # what a fused kernel would save and re-read
            ref = Kernel(lambda: F.rms_norm(x, (row,), w, eps),
                         lambda: torch.autograd.grad(yr, xl, g, retain_graph=True),
                         io_bytes([x, w], [yr]) + rstd_bytes, io_bytes([g, x, w], [x]) + rstd_bytes, [yr])
            return op, ref
    else:
        b = torch.randn(row, device=DEVICE).to(dtype)
        yr, mean, rr = torch.ops.aten.native_layer_norm(x, [row], w, b, eps)
        dxr = torch.ops.aten.native_layer_norm_backward(g, x, [row], mean, rr, w, b, [True, False, False])[0]
        ref = Kernel(lambda: torch.ops.aten.native_layer_norm(x, [row], w, b, eps),
                     lambda: torch.ops.aten.native_layer_norm_backward(g, x, [row], mean, rr, w, b,
                                                                        [True, False, False]),
                     io_bytes([x, w, b], [yr, mean, rr]), io_bytes([g, x, mean, rr, w], [dxr]), [yr])
    del dxr
    return op, ref


def gated_kernels(numel: int, row: int, dtype: torch.dtype, act: str = "silu") -> tuple:
    import torch.nn.functional as F

    from lmbp_convert.ops import gated_mlp as G

    rows = numel // row
    g, u, dh = _randn((rows, row), dtype, 2.0), _randn((rows, row), dtype), _randn((rows, row), dtype)
    h = G._fwd_triton(g, u, act, dtype)
    dg, du, _ = G._bwd_triton(dh, g, u, act, None)
    op = Kernel(lambda: G._fwd_triton(g, u, act, dtype), lambda: G._bwd_triton(dh, g, u, act, None),
                io_bytes([g, u], [h]), io_bytes([dh, g, u], [dg, du]))
    del h, dg, du
    # Eager act(g)*u: forward and autograd backward, several kernels; same ideal bytes.
    fa = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act]
    gl, ul = g.detach().requires_grad_(True), u.detach().requires_grad_(True)
    ho = fa(gl) * ul
    ref = Kernel(lambda: fa(g) * u, lambda: torch.autograd.grad(ho, (gl, ul), dh, retain_graph=True),
                 op.fwd_bytes, op.bwd_bytes, [ho])
    return op, ref


def run_bench(args: argparse.Namespace, deadline: float, skipped: list, specs: Sequence[tuple]) -> list:
    """``specs``: (op name, torch name, builder(numel, dtype) -> (op Kernel, ref Kernel))."""
    flush = None
    if torch.device(DEVICE).type == "cuda":
        flush = torch.empty(256 * 2 ** 20, dtype=torch.int8, device=DEVICE)  # > H200's 60 MB L2
    results = []
    for dtype in args.dtype_list:
        for numel in args.size_list:
            for name, ref_name, build in specs:
                what = f"bench {name} {DTYPE_NAMES[dtype]} {size_label(numel)}"
                if time.perf_counter() > deadline:
                    skipped.append(f"{what} (out of time)")
                    continue
                try:
                    op, ref = build(numel, dtype)
                    t = [time_device(k, args.runs, args.warmup, flush) for k in (op.fwd, op.bwd, ref.fwd, ref.bwd)]
                    results.append(BenchResult(name, ref_name, DTYPE_NAMES[dtype], numel, t[0], t[1],
                                               op.fwd_bytes, op.bwd_bytes, t[2], t[3], ref.fwd_bytes,
                                               ref.bwd_bytes))
                except Exception as e:  # noqa: BLE001 - e.g. out of memory at 256M; keep going
                    traceback.print_exc(limit=3)
                    skipped.append(f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
                finally:
                    op = ref = None  # noqa: F841
                    torch.cuda.empty_cache()
                print(f"  {what} done ({time.perf_counter() - START:.0f} s)", flush=True)
    return results


def bench_specs(args: argparse.Namespace) -> list:
    from lmbp_convert.ops.approx_act import ACT_KINDS

    specs = [(f"approx_act {kind} {args.bits}-bit", _TORCH_ACT_NAME[kind],
              lambda n, d, k=kind: act_kernels(n, args.row, d, k, args.bits)) for kind in ACT_KINDS]
    specs.append(("ms_layer_norm", "layer_norm +affine", lambda n, d: norm_kernels(n, args.row, d, False)))
    specs.append(("ms_rms_norm", "rms_norm +weight", lambda n, d: norm_kernels(n, args.row, d, True)))
    specs.append(("gated_mlp silu (elementwise)", "silu(g)*u eager",
                  lambda n, d: gated_kernels(n, args.row, d, "silu")))
    return specs


_TORCH_ACT_NAME = {"gelu": "gelu", "gelu_tanh": "gelu(tanh)", "silu": "silu",
                   "quick_gelu": "x*sigmoid(1.702x) eager"}


def act_kernels(numel: int, row: int, dtype: torch.dtype, kind: str, bits: int) -> tuple:
    from lmbp_convert.ops import approx_act as A

    x = _randn((numel // row, row), dtype, 3.0)
    g = _randn((numel // row, row), dtype)
    y, packed = A._fwd_triton(x, kind, bits)
    dx = A._bwd_triton(g, packed, bits, kind)
    op = Kernel(lambda: A._fwd_triton(x, kind, bits), lambda: A._bwd_triton(g, packed, bits, kind),
                io_bytes([x], [y, packed]), io_bytes([g, packed], [dx]), [packed])
    del y, dx
    fwd_bytes, bwd_bytes = io_bytes([x], [x]), io_bytes([g, x], [x])  # y and dx are x-sized
    if kind in ("gelu", "gelu_tanh"):  # torch's own single kernels, at the aten level
        approx = "tanh" if kind == "gelu_tanh" else "none"
        ref = Kernel(lambda: torch.ops.aten.gelu(x, approximate=approx),
                     lambda: torch.ops.aten.gelu_backward(g, x, approximate=approx), fwd_bytes, bwd_bytes)
    elif kind == "silu":
        ref = Kernel(lambda: torch.ops.aten.silu(x), lambda: torch.ops.aten.silu_backward(g, x),
                     fwd_bytes, bwd_bytes)
    else:  # quick_gelu as models write it: x * sigmoid(1.702 x), eager kernels and autograd
        xl = x.detach().requires_grad_(True)
        yl = xl * torch.sigmoid(1.702 * xl)
        ref = Kernel(lambda: x * torch.sigmoid(1.702 * x),
                     lambda: torch.autograd.grad(yl, xl, g, retain_graph=True), fwd_bytes, bwd_bytes, [yl])
    return op, ref




def measure_copy_gbps(runs: int = 10) -> float:
    """Device-to-device copy bandwidth (read + write bytes / time) of a 1 GiB buffer: the practical ceiling."""
    src = torch.empty(2 ** 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    t = time_device(lambda: dst.copy_(src), runs, 2, None)
    src = dst = None  # free the buffers (the lambda keeps the cells, not the tensors)
    torch.cuda.empty_cache()
    return gbps(2 * 2 ** 30, t)


def render(bench: Sequence[BenchResult], skipped: Sequence[str], args: argparse.Namespace, elapsed: float,
           copy_gbps: Optional[float] = None) -> str:
    """The markdown report: the bandwidth table and what was skipped."""
    body = []
    if bench:
        copy_note = f"; measured device-to-device copy {copy_gbps:.0f} GB/s" if copy_gbps else ""
        body += ["", f"## Bandwidth (bytes moved / time; CUDA events, median of {args.runs}; norms row "
                 f"{args.row}; torch norms with a frozen affine; peak {args.peak_gbps:.0f} GB/s{copy_note})", "",
                 bench_table(bench, args.peak_gbps, copy_gbps)]
    if skipped:
        body += ["", "## Skipped", ""] + [f"- {s}" for s in skipped]
    body += ["", f"Total {elapsed:.0f} s."]
    return "\n".join(body) + "\n"


# ----------------------------------------------------------------------------------------------- main
START = time.perf_counter()


def main(argv: Optional[Sequence[str]] = None) -> int:
    global START
    START = time.perf_counter()
    args = parse_args(argv)
    problem = environment_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    import triton

    deadline = START + args.budget_s
    torch.manual_seed(0)
    head = ["# lmbp kernels: Triton kernels' bandwidth next to torch's", "",
            f"- device: {describe_device()}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
            f"triton {triton.__version__}",
            f"- HBM peak used for %: {args.peak_gbps:.0f} GB/s"]
    print("\n".join(head), flush=True)
    copy_gbps = None
    if torch.device(DEVICE).type == "cuda":
        copy_gbps = measure_copy_gbps()
        print(f"  device-to-device copy: {copy_gbps:.0f} GB/s ({pct_peak(copy_gbps, args.peak_gbps):.0f}% of "
              f"the {args.peak_gbps:.0f} GB/s peak)", flush=True)
    skipped: list = []
    bench = run_bench(args, deadline, skipped, bench_specs(args))
    report = render(bench, skipped, args, time.perf_counter() - START, copy_gbps)
    print(report, flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            fh.write("\n".join(head) + "\n" + report)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
