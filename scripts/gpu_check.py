#!/usr/bin/env python
"""One prepared command for a CUDA machine: check every Triton kernel against the PyTorch path, then measure
forward / backward bandwidth next to torch's own kernels.

CI has no GPU (the kernels are only exercised there through Triton's interpreter), so this is where the
compiled kernels meet real hardware. Two parts, run in this order:

1. Correctness, fp32 / fp16 / bf16: each Triton launcher against the PyTorch path with the same contract
   (approx_act every kind and 1-4 bits; both MS norms on short, non-power-of-2, max fused (16384) and long,
   looped rows, strided inputs and autocast output dtypes; the gated MLP elementwise kernels incl. strided
   halves and in-place dg), plus the public ops end to end (autograd, dispatch, saved bytes) on CUDA and
   under torch.compile(fullgraph=True), where the Triton path runs as custom ops.
2. Bandwidth: bytes moved / time, CUDA events, median of runs (L2 flushed and the GPU kept busy ahead of the
   timed launch, so host launch latency is not timed), at 16M / 64M / 256M elements, next to torch's gelu /
   silu / layer_norm / rms_norm, as a markdown table with % of the HBM peak (H200: 4.8 TB/s).

Bytes moved: every tensor a kernel must read plus every tensor it writes, once (``io_bytes``); a kernel at
the memory roofline reaches the peak. A time budget (``--budget-s``, default 420 s, of which the checks leave
``--bench-reserve-s`` to the bench) skips what would overrun it; skipped work is listed. Exit status: 0 every
check run passed, 1 a check failed, 2 no CUDA (or Triton's interpreter is on), 3 checks skipped for time.
Writes ``$OUT/gpu_check.md`` when OUT is set (or ``--out FILE``). Usage::

    python scripts/gpu_check.py --fast           # about 3 min on an H200: pytest tests/ops/test_cuda.py, the
                                                 # bandwidth table and the approx_act kernel-variant timings
    python scripts/gpu_check.py                  # everything, defaults (the in-script checks too)
    python scripts/gpu_check.py --quick          # small sizes, fewer runs
    python scripts/gpu_check.py --skip-bench --dtypes bf16

After the bench it runs ``pytest tests/ops/test_cuda.py`` (the CUDA-only tests: every kernel and
approx_act variant against the PyTorch path, the cached launch, CUDA-graph capture, torch.compile default and
reduce-overhead on converted LLaMA / ViT / BERT) and reports it as one check. Bandwidth is printed as % of the
datasheet peak and as % of a measured device-to-device copy (the practical ceiling). The approx_act variant
table times every forward / backward kernel variant (``FWD_VARIANTS`` / ``BWD_VARIANTS`` in
lmbp_convert/ops/approx_act.py) and names the fastest; the defaults are ``FWD_VARIANT`` / ``BWD_VARIANT`` there.
"""
from __future__ import annotations

import argparse
import math
import subprocess
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.join(_ROOT, "tests", "ops")):  # the package, and the shared tolerance table
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

HBM_PEAK_GBPS = 4800.0  # H200 HBM3e, TB/s * 1000
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
#: Where checks and benches allocate; tests set "cpu" to run the same code through Triton's interpreter.
DEVICE = "cuda"
#: MS norm checks, (rows, n, forced chunk): tiny, non-power-of-2, typical, > 4096 non-pow2, the max fused
#: row (16384), looped rows just past it / long / odd, and the looped kernel forced on a short row.
NORM_CASES = [(37, 33, None), (16, 768, None), (8, 4096, None), (6, 5120, None), (4, 16384, None),
              (3, 16385, None), (3, 20000, None), (2, 65536 + 7, None), (5, 300, 64)]
#: Row lengths of the end-to-end norm op check (fused and looped kernel).
NORM_PUBLIC_ROWS = (4096, 20000)
#: approx_act checks, (rows, cols, strided): several programs with a ragged tail (N not a multiple of the
#: codes per byte nor of a program's 2048 elements), and a strided slice. Few shapes: each compiles anew.
ACT_CHECK_SHAPES = [(37, 333, False), (19, 500, True)]
#: Ops checked under torch.compile (approx_act gelu 2-bit, gated_mlp silu).
COMPILE_OPS = ("approx_act", "ms_layer_norm", "ms_rms_norm", "gated_mlp")
#: Gated MLP elementwise checks, (rows, f, g and u as strided halves of one gate_up tensor).
GATED_CASES = [(37, 333, False), (8, 4096, False), (11, 2000, True)]
NO_CUDA_MESSAGE = ("gpu_check: no CUDA device available (torch.cuda.is_available() is False). This script "
                   "checks and times the Triton kernels on a CUDA GPU; run it on the GPU machine.")


# ------------------------------------------------------------------------------------------ accounting
def io_bytes(reads: Iterable[Optional[torch.Tensor]], writes: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes a kernel must move: each tensor read once plus each tensor written once (views by their size)."""
    return sum(t.numel() * t.element_size() for t in list(reads) + list(writes) if t is not None)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def pct_peak(gb_per_s: float, peak: float = HBM_PEAK_GBPS) -> float:
    return 100.0 * gb_per_s / peak


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def size_label(n: int) -> str:
    for unit, m in (("G", 2 ** 30), ("M", 2 ** 20), ("K", 2 ** 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


# ----------------------------------------------------------------------------------------------- report
def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


@dataclass
class CheckResult:
    name: str
    dtype: str
    shape: str
    max_err: float = float("nan")
    ok: bool = False
    detail: str = ""


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


def check_table(results: Sequence[CheckResult]) -> str:
    rows = [(r.name, r.dtype, r.shape, f"{r.max_err:.3g}", "ok" if r.ok else f"**FAIL** {r.detail}")
            for r in results]
    return markdown_table(("check", "dtype", "shape", "max abs err", "result"), rows)


# ---------------------------------------------------------------------------------------------- args
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="fp32,fp16,bf16", help="correctness dtypes")
    p.add_argument("--bench-dtypes", default="bf16,fp32", help="bandwidth dtypes")
    p.add_argument("--sizes", default="16M,64M,256M", help="bandwidth sizes in elements (K/M/G suffix)")
    p.add_argument("--row", type=int, default=4096, help="norm row length (and gated MLP width) in the bench")
    p.add_argument("--runs", type=int, default=20, help="timed runs per measurement (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bits", default="1,2,3,4", help="approx_act bits to check")
    p.add_argument("--bench-bits", type=int, default=2, help="approx_act bits in the bench")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--skip-compile", action="store_true", help="skip the torch.compile checks")
    p.add_argument("--quick", action="store_true", help="bench 1M/4M only, 5 runs")
    p.add_argument("--fast", action="store_true",
                   help="about 3 min: pytest tests/ops/test_cuda.py instead of the in-script checks; bench bf16, "
                        "fp32 at 16M/64M/256M, 10 runs; variant timings")
    p.add_argument("--skip-pytest", action="store_true", help="do not run tests/ops/test_cuda.py")
    p.add_argument("--pytest-timeout-s", type=float, default=150.0)
    p.add_argument("--skip-variants", action="store_true", help="skip the approx_act kernel-variant timings")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip remaining work past this many seconds")
    p.add_argument("--bench-reserve-s", type=float, default=120.0,
                   help="seconds of the budget the checks leave to the bench")
    p.add_argument("--peak-gbps", type=float, default=HBM_PEAK_GBPS, help="HBM peak for the %% column")
    p.add_argument("--out", default=None, help="markdown file (default $OUT/gpu_check.md when OUT is set)")
    a = p.parse_args(argv)
    if a.fast:
        a.skip_check, a.bench_dtypes, a.runs, a.budget_s, a.pytest_timeout_s = True, "bf16,fp32", 10, 180.0, 150.0
    if a.quick:
        a.sizes, a.runs, a.warmup = "1M,4M", 5, 1

    def dtype_list(s: str, flag: str) -> list:
        names = [d.strip() for d in s.split(",") if d.strip()]
        bad = [d for d in names if d not in DTYPES]
        if bad:
            p.error(f"{flag}: unknown {bad}; choose from {list(DTYPES)}")
        return [DTYPES[d] for d in names]

    a.dtype_list = dtype_list(a.dtypes, "--dtypes")
    a.bench_dtype_list = dtype_list(a.bench_dtypes, "--bench-dtypes")
    try:
        a.size_list = [_parse_size(s) for s in a.sizes.split(",") if s.strip()]
        a.bits_list = [int(b) for b in a.bits.split(",") if b.strip()]
    except ValueError:
        p.error("--sizes / --bits: cannot parse")
    if a.row <= 0 or any(s <= 0 or s % a.row for s in a.size_list):
        p.error(f"--sizes must be positive multiples of --row ({a.row})")
    if any(b < 1 or b > 8 for b in a.bits_list) or not 1 <= a.bench_bits <= 8:
        p.error("bits must be in 1..8")
    if a.runs < 1 or a.warmup < 0:
        p.error("--runs must be >= 1, --warmup >= 0")
    if a.out is None and os.environ.get("OUT"):
        a.out = os.path.join(os.environ["OUT"], "gpu_check.md")
    return a


def environment_problem() -> Optional[str]:
    """Why the checks cannot run here (None when they can). Must not import the ops: kernels are defined
    at import, after TRITON_INTERPRET is read."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return ("gpu_check: TRITON_INTERPRET=1 is set, so Triton would run its CPU interpreter instead of "
                "compiling for the GPU; unset it and run again.")
    if not torch.cuda.is_available():
        return NO_CUDA_MESSAGE
    try:
        import triton  # noqa: F401
    except Exception as e:  # pragma: no cover - environment
        return f"gpu_check: triton cannot be imported ({e}); the kernels need it."
    return None


def describe_device() -> str:
    dev = torch.device(DEVICE)
    if dev.type != "cuda":
        return f"{dev} (Triton interpreter: TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')})"
    p = torch.cuda.get_device_properties(dev)
    return f"{p.name}, {p.total_memory / 2 ** 30:.0f} GiB, {p.multi_processor_count} SMs"


# ------------------------------------------------------------------------------------------ checking
class Checker:
    """Runs comparisons; a failure or an exception is recorded and the run continues with the next one."""

    def __init__(self, deadline: float):
        self.results: list = []
        self.deadline = deadline
        self.skipped: list = []
        self.timed_out = False

    def out_of_time(self, what: str) -> bool:
        if time.perf_counter() > self.deadline:
            self.skipped.append(f"{what} and the rest of its section (time budget)")
            self.timed_out = True
            return True
        return False

    def compare(self, name: str, dtype: torch.dtype, shape, pairs: Callable[[], Sequence[tuple]],
                which: str = "fwd", tol_override: Optional[dict] = None) -> bool:
        """``pairs()`` returns [(label, actual, expected[, tolerance])]; all must match, by default within the
        expected dtype's tolerance for ``which`` (tests/ops/tolerances.py), or ``tol_override``."""
        from tolerances import tol

        res = CheckResult(name, DTYPE_NAMES.get(dtype, str(dtype)), "x".join(map(str, shape)))
        worst = float("nan")
        try:
            worst = 0.0
            for label, act, exp, *pair_tol in pairs():
                if act.shape != exp.shape or act.dtype != exp.dtype:
                    raise AssertionError(f"{label}: {tuple(act.shape)} {act.dtype} vs {tuple(exp.shape)} "
                                         f"{exp.dtype}")
                t = (pair_tol[0] if pair_tol else tol_override
                     or tol(exp.dtype if exp.dtype in DTYPE_NAMES else torch.float32, which))
                if act.numel():
                    worst = max(worst, (act.double() - exp.double()).abs().max().item())
                try:
                    torch.testing.assert_close(act, exp, **t)
                except AssertionError as e:
                    raise AssertionError(f"{label}: " + " ".join(str(e).split("\n")[:3])) from None
            res.max_err, res.ok = worst, True
        except Exception as e:  # noqa: BLE001 - a kernel that fails to compile is a finding, not a crash
            res.max_err = worst
            res.detail = (str(e).splitlines() or [type(e).__name__])[0][:200]
            if not isinstance(e, AssertionError):
                res.detail = f"{type(e).__name__}: {res.detail}"
                traceback.print_exc(limit=3)
        self.results.append(res)
        return res.ok


def _randn(shape, dtype, scale=1.0, shift=0.0):
    return (torch.randn(*shape, device=DEVICE, dtype=torch.float32) * scale + shift).to(dtype)


def check_norms(ck: Checker, dtypes: Sequence[torch.dtype]) -> None:
    import torch.nn.functional as F

    from lmbp_convert.memory import SavedTensorLedger
    from lmbp_convert.ops import ms_norm as M

    for is_rms in (False, True):
        kind = "rms" if is_rms else "layer"
        eps = 1e-6 if is_rms else 1e-5
        for dtype in dtypes:
            for rows, n, chunk in NORM_CASES:
                if ck.out_of_time(f"ms_norm {kind} {DTYPE_NAMES[dtype]} {rows}x{n}"):
                    return
                x = _randn((rows, n), dtype, 2.0, 0.5)
                g = _randn((rows, n), dtype)
                tag = f"ms_{kind}_norm triton{' chunk=' + str(chunk) if chunk else ''}"

                def fwd(x=x, n=n, chunk=chunk):
                    y, r = M._fwd_triton(x, n, eps, is_rms, x.dtype, chunk=chunk)
                    y_ref, r_ref = M._fwd_torch(x, n, eps, is_rms, x.dtype)
                    return [("y", y, y_ref), ("rstd", r, r_ref)]

                ck.compare(f"{tag} fwd vs torch path", dtype, (rows, n), fwd)

                def bwd(x=x, g=g, n=n, chunk=chunk):
                    y, r = M._fwd_torch(x, n, eps, is_rms, x.dtype)
                    dx = M._bwd_triton(g, y, r, is_rms, x.dtype, chunk=chunk)
                    return [("dx", dx, M._bwd_torch(g, y, r, is_rms, x.dtype))]

                ck.compare(f"{tag} bwd vs torch path", dtype, (rows, n), bwd, "bwd")

        # Strided rows (a slice of a wider tensor) and fp32 in / low-precision out (the autocast case).
        for dtype in dtypes:
            if ck.out_of_time(f"ms_norm {kind} strided/mixed {DTYPE_NAMES[dtype]}"):
                return
            wide = _randn((9, 1100), dtype, 2.0)
            xs = wide[:, 13:13 + 1000]
            gs = _randn((9, 1100), dtype)[:, 50:1050]

            def strided(xs=xs, gs=gs):
                y, r = M._fwd_triton(xs, 1000, eps, is_rms, xs.dtype)
                y_ref, r_ref = M._fwd_torch(xs, 1000, eps, is_rms, xs.dtype)
                dx = M._bwd_triton(gs, y_ref, r_ref, is_rms, xs.dtype)
                return [("y", y, y_ref), ("rstd", r, r_ref),
                        ("dx", dx, M._bwd_torch(gs, y_ref, r_ref, is_rms, xs.dtype))]

            ck.compare(f"ms_{kind}_norm triton strided rows", dtype, (9, 1000), strided, "bwd")
            if dtype != torch.float32:
                x32 = _randn((7, 2048), torch.float32, 2.0)
                g_lo = _randn((7, 2048), dtype)

                def mixed(x32=x32, g_lo=g_lo, dtype=dtype):
                    y, r = M._fwd_triton(x32, 2048, eps, is_rms, dtype)
                    y_ref, r_ref = M._fwd_torch(x32, 2048, eps, is_rms, dtype)
                    dx = M._bwd_triton(g_lo, y_ref, r_ref, is_rms, torch.float32)
                    return [("y", y, y_ref), ("rstd", r, r_ref),
                            ("dx", dx, M._bwd_torch(g_lo, y_ref, r_ref, is_rms, torch.float32))]

                ck.compare(f"ms_{kind}_norm triton fp32 in, low out", dtype, (7, 2048), mixed, "bwd")

        # Public op end to end (dispatch to Triton on CUDA, autograd): against torch's own norm (fp32).
        fn = M.ms_rms_norm if is_rms else M.ms_layer_norm
        for n in NORM_PUBLIC_ROWS:
            if ck.out_of_time(f"ms_{kind}_norm public op n={n}"):
                return

            def public(n=n, fn=fn):
                x = _randn((6, n), torch.float32, 2.0, 0.3).requires_grad_(True)
                g = _randn((6, n), torch.float32)
                if x.is_cuda and not M.use_triton(x):
                    raise AssertionError("the op did not dispatch to its Triton kernels")
                y = fn(x, n, eps)
                (dx,) = torch.autograd.grad(y, x, g)
                xr = x.detach().requires_grad_(True)
                yr = F.rms_norm(xr, (n,), eps=eps) if is_rms else F.layer_norm(xr, (n,), eps=eps)
                (dxr,) = torch.autograd.grad(yr, xr, g)
                return [("y", y, yr), ("dx", dx, dxr)]

            ck.compare(f"ms_{kind}_norm op end to end vs F.{kind}_norm", torch.float32, (6, n), public, "bwd")

        # Memory sharing on CUDA under autocast: norm → Linear keeps one activation storage (+ rstd).
        if ck.out_of_time(f"ms_{kind}_norm autocast sharing"):
            return

        def sharing(fn=fn):
            lin = torch.nn.Linear(1024, 256, device=DEVICE)
            x = _randn((64, 1024), torch.float32).requires_grad_(True)
            with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
                with SavedTensorLedger(lin) as alone:
                    y = fn(x, 1024, eps)
                with SavedTensorLedger(lin) as pair:
                    out = lin(fn(x, 1024, eps))
            expect = y.numel() * y.element_size() + 64 * 4  # y (bf16) + rstd (fp32)
            got = torch.tensor([float(alone.bytes), float(pair.bytes), float(y.dtype == torch.bfloat16)])
            del out
            return [("saved bytes alone / with Linear / bf16 out", got,
                     torch.tensor([float(expect), float(expect), 1.0]))]

        ck.compare(f"ms_{kind}_norm autocast bf16: saved bytes shared with Linear", torch.bfloat16, (64, 1024),
                   sharing, tol_override={"atol": 0, "rtol": 0})


def check_gated(ck: Checker, dtypes: Sequence[torch.dtype]) -> None:
    try:
        from lmbp_convert.ops import gated_mlp as G
    except ModuleNotFoundError:
        ck.skipped.append("gated_mlp: lmbp_convert/ops/gated_mlp.py not present")
        return
    for act in G.ACT_KINDS:
        for dtype in dtypes:
            for rows, f, fused in GATED_CASES:
                if ck.out_of_time(f"gated {act} {DTYPE_NAMES[dtype]} {rows}x{f}"):
                    return
                if fused:  # g, u: the two halves of one gate_up output (strided views)
                    gu = _randn((rows, 2 * f), dtype, 2.0)
                    g, u = gu[:, :f], gu[:, f:]
                else:
                    g, u = _randn((rows, f), dtype, 2.0), _randn((rows, f), dtype)
                dh = _randn((rows, f), dtype)
                tag = f"gated_mlp {act} triton{' strided halves' if fused else ''}"

                def fwd(g=g, u=u):
                    return [("h", G._fwd_triton(g, u, act, g.dtype), G._fwd_torch(g, u, act, g.dtype))]

                ck.compare(f"{tag} fwd vs torch path", dtype, (rows, f), fwd)

                def bwd(g=g, u=u, dh=dh):
                    dg, du, h = G._bwd_triton(dh, g, u, act, g.dtype)
                    dg_r, du_r, h_r = G._bwd_torch(dh, g, u, act, g.dtype)
                    dh2 = dh.clone()
                    dg2, du2, none = G._bwd_triton(dh2, g, u, act, None, dg_into_dh=True)
                    if none is not None:
                        raise AssertionError("h returned although h_dtype is None")
                    return [("dg", dg, dg_r), ("du", du, du_r), ("h", h, h_r), ("dg in dh", dg2, dg_r),
                            ("du (in-place call)", du2, du_r)]

                ck.compare(f"{tag} bwd vs torch path", dtype, (rows, f), bwd, "bwd")

    # Public op end to end (fp32): fused gated MLP vs the eager module maths, values and all grads.
    import torch.nn.functional as F

    acts = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
    for act in G.ACT_KINDS:
        if ck.out_of_time(f"gated_mlp op {act}"):
            return

        def public(act=act):
            torch.backends.cuda.matmul.allow_tf32 = False
            g = _randn((64, 512), torch.float32, 2.0).requires_grad_(True)
            u = _randn((64, 512), torch.float32).requires_grad_(True)
            w = (_randn((128, 512), torch.float32) * 512 ** -0.5).requires_grad_(True)
            b = _randn((128,), torch.float32).requires_grad_(True)
            dy = _randn((64, 128), torch.float32)
            out = G.gated_mlp(g, u, w, b, act)
            grads = torch.autograd.grad(out, (g, u, w, b), dy)
            ref = F.linear(acts[act](g) * u, w, b)
            grads_r = torch.autograd.grad(ref, (g, u, w, b), dy)
            return [("out", out, ref)] + [(n, a, e) for n, a, e in zip(("dg", "du", "dW", "db"), grads, grads_r)]

        ck.compare(f"gated_mlp {act} op end to end vs eager", torch.float32, (64, 512), public, "bwd",
                   tol_override={"atol": 1e-4, "rtol": 1e-4})


def check_compile(ck: Checker, dtype: torch.dtype = torch.bfloat16) -> None:
    """Each op under ``torch.compile(fullgraph=True)`` (on CUDA: its custom ops, opaque to Dynamo, with fake
    kernels) against eager: values and input grads."""
    from lmbp_convert.ops import gated_mlp as G
    from lmbp_convert.ops import ms_norm as M

    A = _approx_act_module()
    w = _randn((256, 512), dtype) * 512 ** -0.5
    cases = {"ms_layer_norm": (lambda x: M.ms_layer_norm(x, 512), 1),
             "ms_rms_norm": (lambda x: M.ms_rms_norm(x, 512), 1),
             "gated_mlp": (lambda g, u: G.gated_mlp(g, u, w, None, "silu"), 2)}
    if A is not None:
        cases["approx_act"] = (lambda x: A.approx_act(x, "gelu", 2), 1)
    for name in COMPILE_OPS:
        if name not in cases:
            continue
        fn, n_in = cases[name]
        if ck.out_of_time(f"torch.compile {name}"):
            return

        def run(fn=fn, n_in=n_in):
            torch._dynamo.reset()
            xs = [_randn((64, 512), dtype, 2.0).requires_grad_(True) for _ in range(n_in)]
            y = fn(*xs)
            g = torch.randn_like(y)
            grads = torch.autograd.grad(y, xs, g)
            yc = torch.compile(fn, fullgraph=True)(*xs)
            grads_c = torch.autograd.grad(yc, xs, g)
            return [("y", yc, y)] + [(f"grad {i}", a, e) for i, (a, e) in enumerate(zip(grads_c, grads))]

        ck.compare(f"{name} torch.compile(fullgraph) vs eager", dtype, (64, 512), run, "bwd")


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
    for dtype in args.bench_dtype_list:
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
    specs = []
    act_mod = _approx_act_module()
    if act_mod is not None:
        for kind in act_mod.ACT_KINDS:
            specs.append((f"approx_act {kind} {args.bench_bits}-bit", _TORCH_ACT_NAME[kind],
                          lambda n, d, k=kind: act_kernels(n, args.row, d, k, args.bench_bits)))
    specs.append(("ms_layer_norm", "layer_norm +affine", lambda n, d: norm_kernels(n, args.row, d, False)))
    specs.append(("ms_rms_norm", "rms_norm +weight", lambda n, d: norm_kernels(n, args.row, d, True)))
    try:
        import lmbp_convert.ops.gated_mlp  # noqa: F401

        specs.append(("gated_mlp silu (elementwise)", "silu(g)*u eager",
                      lambda n, d: gated_kernels(n, args.row, d, "silu")))
    except ModuleNotFoundError:
        pass
    return specs


# ------------------------------------------------------------------------------------- approx_act parts
_TORCH_ACT_NAME = {"gelu": "gelu", "gelu_tanh": "gelu(tanh)", "silu": "silu",
                   "quick_gelu": "x*sigmoid(1.702x) eager"}


def _approx_act_module():
    try:
        from lmbp_convert.ops import approx_act
    except ModuleNotFoundError:
        return None
    return approx_act


def check_approx_act(ck: Checker, dtypes: Sequence[torch.dtype], bits_list: Sequence[int]) -> None:
    import torch.nn.functional as F

    from lmbp_convert.memory import SavedTensorLedger

    A = _approx_act_module()
    if A is None:
        ck.skipped.append("approx_act: lmbp_convert/ops/approx_act.py not present")
        return
    exact = {"atol": 0, "rtol": 0}
    torch_act = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu,
                 "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t)}
    for kind in A.ACT_KINDS:
        for bits in bits_list:
            for dtype in dtypes:
                for rows, cols, strided in ACT_CHECK_SHAPES:
                    if ck.out_of_time(f"approx_act {kind} {bits}-bit {DTYPE_NAMES[dtype]} {rows}x{cols}"):
                        return
                    if strided:  # a slice of a wider tensor (e.g. one half of gate_up): read in place
                        x = _randn((rows, cols + 29), dtype, 3.0)[:, 7:7 + cols]
                        g = _randn((rows, cols + 29), dtype)[:, 11:11 + cols]
                    else:
                        x, g = _randn((rows, cols), dtype, 3.0), _randn((rows, cols), dtype)
                    tag = f"approx_act {kind} {bits}-bit triton{' strided' if strided else ''}"

                    def fwd(x=x, kind=kind, bits=bits):
                        y, packed = A._fwd_triton(x, kind, bits)
                        y_ref, packed_ref = A._fwd_torch(x, kind, bits)
                        xf = x.float()
                        return [("y", y, y_ref), ("packed codes", packed, packed_ref, exact),
                                ("y vs torch's activation", y, torch_act[kind](xf).to(x.dtype))]

                    ck.compare(f"{tag} fwd vs torch path", dtype, (rows, cols), fwd)

                    def bwd(x=x, g=g, kind=kind, bits=bits):
                        _, packed = A._fwd_torch(x, kind, bits)
                        dx = A._bwd_triton(g, packed, bits, kind)
                        return [("dx", dx, A._bwd_torch(g, packed, bits, kind))]

                    ck.compare(f"{tag} bwd vs torch path", dtype, (rows, cols), bwd, "bwd")

    # Public op end to end (dispatch, autograd) against the same op on CPU (the PyTorch path), and its
    # saved bytes: the packed codes only.
    for kind in A.ACT_KINDS:
        for dtype in dtypes:
            if ck.out_of_time(f"approx_act {kind} op {DTYPE_NAMES[dtype]}"):
                return

            def public(kind=kind, dtype=dtype):
                x = _randn((64, 1000), dtype, 3.0).requires_grad_(True)
                g = _randn((64, 1000), dtype)
                if x.is_cuda and not A.use_triton(x):
                    raise AssertionError("the op did not dispatch to its Triton kernels")
                with SavedTensorLedger() as ledger:
                    y = A.approx_act(x, kind, 2)
                (dx,) = torch.autograd.grad(y, x, g)
                xc = x.detach().cpu().requires_grad_(True)
                yc = A.approx_act(xc, kind, 2)
                (dxc,) = torch.autograd.grad(yc, xc, g.cpu())
                nb = torch.tensor([float(ledger.bytes)])
                return [("y", y.cpu(), yc), ("dx", dx.cpu(), dxc),
                        ("saved bytes", nb, torch.tensor([float(A.packed_nbytes(x.numel(), 2))]), exact)]

            ck.compare(f"approx_act {kind} 2-bit op end to end vs PyTorch path", dtype, (64, 1000), public, "bwd")


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


# ------------------------------------------------------------------------------ pytest, copy, variants
def run_cuda_tests(timeout_s: float) -> CheckResult:
    """``pytest tests/ops/test_cuda.py`` in a fresh process with compiled kernels, as one check row."""
    res = CheckResult("pytest tests/ops/test_cuda.py", "-", "-")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "--tb=short",
           os.path.join(_ROOT, "tests", "ops", "test_cuda.py")]
    try:
        proc = subprocess.run(cmd, cwd=_ROOT, env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        res.detail = f"timed out after {timeout_s:.0f} s"
        return res
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = lines[-1] if lines else proc.stderr.strip()[-200:]
    res.ok = proc.returncode == 0 and "passed" in summary and "failed" not in summary
    res.detail = summary[:200]
    if not res.ok:
        print(proc.stdout[-6000:], proc.stderr[-2000:], sep="\n", flush=True)
    else:
        print(f"  pytest tests/ops/test_cuda.py: {summary}", flush=True)
    return res


def measure_copy_gbps(runs: int = 10) -> float:
    """Device-to-device copy bandwidth (read + write bytes / time) of a 1 GiB buffer: the practical ceiling."""
    src = torch.empty(2 ** 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    t = time_device(lambda: dst.copy_(src), runs, 2, None)
    src = dst = None  # free the buffers (the lambda keeps the cells, not the tensors)
    torch.cuda.empty_cache()
    return gbps(2 * 2 ** 30, t)


@dataclass
class VariantResult:
    direction: str
    variant: str
    dtype: str
    numel: int
    seconds: float
    nbytes: int


def bench_variants(args: argparse.Namespace, deadline: float, skipped: list) -> list:
    """Every approx_act forward / backward kernel variant (gelu, ``--bench-bits``), same data, same timing."""
    A = _approx_act_module()
    if A is None or not hasattr(A, "FWD_VARIANTS"):
        return []
    flush = torch.empty(256 * 2 ** 20, dtype=torch.int8, device=DEVICE) if torch.device(DEVICE).type == "cuda" \
        else None
    out = []
    bits = args.bench_bits
    for dtype in args.bench_dtype_list:
        for numel in args.size_list:
            if time.perf_counter() > deadline:
                skipped.append(f"approx_act variants {DTYPE_NAMES[dtype]} {size_label(numel)} (out of time)")
                continue
            x = _randn((numel // args.row, args.row), dtype, 3.0)
            g = _randn((numel // args.row, args.row), dtype)
            y, packed = A._fwd_triton(x, "gelu", bits)
            fwd_bytes, bwd_bytes = io_bytes([x], [y, packed]), io_bytes([g, packed], [y])
            del y
            for v in A.FWD_VARIANTS:
                t = time_device(lambda v=v: A._fwd_triton(x, "gelu", bits, variant=v), args.runs, args.warmup, flush)
                out.append(VariantResult("fwd", v, DTYPE_NAMES[dtype], numel, t, fwd_bytes))
            for v in A.BWD_VARIANTS:
                t = time_device(lambda v=v: A._bwd_triton(g, packed, bits, "gelu", variant=v), args.runs,
                                args.warmup, flush)
                out.append(VariantResult("bwd", v, DTYPE_NAMES[dtype], numel, t, bwd_bytes))
            x = g = packed = None  # free before the next size (the lambdas keep the cells)
            torch.cuda.empty_cache() if torch.device(DEVICE).type == "cuda" else None
            print(f"  approx_act variants {DTYPE_NAMES[dtype]} {size_label(numel)} done "
                  f"({time.perf_counter() - START:.0f} s)", flush=True)
    return out


def variant_report(results: Sequence[VariantResult], peak: float, copy_gbps: Optional[float],
                   defaults: tuple[str, str]) -> str:
    """Table of every variant and, per direction, the variant fastest in most (dtype, size) cells."""
    rows, lines = [], []
    for r in results:
        bw = gbps(r.nbytes, r.seconds)
        rows.append((r.direction, r.variant, r.dtype, size_label(r.numel), f"{r.seconds * 1e6:.1f}", _g(bw),
                     f"{pct_peak(bw, peak):.0f}%", f"{pct_peak(bw, copy_gbps):.0f}%" if copy_gbps else "-"))
    for direction, default in zip(("fwd", "bwd"), defaults):
        cells: dict = {}
        for r in results:
            if r.direction == direction:
                cells.setdefault((r.dtype, r.numel), []).append(r)
        wins: dict = {}
        for cell in cells.values():
            best = min(cell, key=lambda r: r.seconds)
            wins[best.variant] = wins.get(best.variant, 0) + 1
        if wins:
            best = max(wins, key=wins.get)
            var = "FWD_VARIANT" if direction == "fwd" else "BWD_VARIANT"
            advice = ("the default" if best == default else
                      f"differs from the default {default!r}: set {var} = {best!r} in lmbp_convert/ops/approx_act.py")
            lines.append(f"- fastest {direction} variant: **{best}** in {wins[best]} of {len(cells)} cells; {advice}")
    table = markdown_table(("dir", "variant", "dtype", "elements", "µs", "GB/s", "% peak", "% copy"), rows)
    return table + "\n\n" + "\n".join(lines)


def render(checks: Sequence[CheckResult], bench: Sequence[BenchResult], skipped: Sequence[str],
           args: argparse.Namespace, elapsed: float, full: bool, copy_gbps: Optional[float] = None,
           variants: Sequence[VariantResult] = (), defaults: tuple[str, str] = ("", "")) -> str:
    """The markdown report: every check (``full``) or only the failed ones, the bandwidth table, what was
    skipped, and a last line that says whether everything passed."""
    failed = [r for r in checks if not r.ok]
    body = []
    if checks:
        body += ["", f"## Correctness: {len(checks) - len(failed)}/{len(checks)} checks pass "
                 f"(tolerances: tests/ops/tolerances.py)"]
        shown = list(checks) if full else failed
        if shown:
            body += ["", check_table(shown)]
    if bench:
        copy_note = f"; measured device-to-device copy {copy_gbps:.0f} GB/s" if copy_gbps else ""
        body += ["", f"## Bandwidth (bytes moved / time; CUDA events, median of {args.runs}; norms row "
                 f"{args.row}; torch norms with a frozen affine; peak {args.peak_gbps:.0f} GB/s{copy_note})", "",
                 bench_table(bench, args.peak_gbps, copy_gbps)]
    if variants:
        body += ["", f"## approx_act kernel variants (gelu, {args.bench_bits}-bit; same timing as above)", "",
                 variant_report(variants, args.peak_gbps, copy_gbps, defaults)]
    if skipped:
        body += ["", "## Skipped", ""] + [f"- {s}" for s in skipped]
    verdict = ("ALL CHECKS PASS" if not failed else f"{len(failed)} CHECKS FAILED") if checks else "NO CHECKS RUN"
    if any("(time budget)" in s for s in skipped):
        verdict += " (INCOMPLETE: some checks were skipped for time)"
    body += ["", f"Total {elapsed:.0f} s. {verdict}."]
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
    from lmbp_convert.ops._common import HAS_TRITON

    if not HAS_TRITON:
        print("gpu_check: lmbp_convert sees no Triton (HAS_TRITON is False)", file=sys.stderr)
        return 2
    import triton

    deadline = START + args.budget_s
    torch.manual_seed(0)
    head = [
        "# lmbp gpu_check: Triton kernels vs the PyTorch path, and bandwidth",
        "",
        f"- device: {describe_device()}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
        f"triton {triton.__version__}",
        f"- HBM peak used for %: {args.peak_gbps:.0f} GB/s",
    ]
    print("\n".join(head), flush=True)

    ck = Checker(deadline - (0.0 if args.skip_bench else args.bench_reserve_s))
    copy_gbps = None
    if torch.device(DEVICE).type == "cuda" and not args.skip_bench:
        copy_gbps = measure_copy_gbps()
        print(f"  device-to-device copy: {copy_gbps:.0f} GB/s ({pct_peak(copy_gbps, args.peak_gbps):.0f}% of "
              f"the {args.peak_gbps:.0f} GB/s peak)", flush=True)
    if not args.skip_check:
        for section, run in (("approx_act", lambda: check_approx_act(ck, args.dtype_list, args.bits_list)),
                             ("ms_norm", lambda: check_norms(ck, args.dtype_list)),
                             ("gated_mlp", lambda: check_gated(ck, args.dtype_list)),
                             ("torch.compile", lambda: None if args.skip_compile else check_compile(ck))):
            t0 = time.perf_counter()
            try:
                run()
            except Exception as e:  # noqa: BLE001 - an import error in one op must not hide the others
                traceback.print_exc(limit=5)
                ck.results.append(CheckResult(f"{section} section", "-", "-", detail=f"{type(e).__name__}: {e}"))
            n_fail = sum(not r.ok for r in ck.results)
            print(f"  checks {section}: {time.perf_counter() - t0:.0f} s; {len(ck.results)} so far, "
                  f"{n_fail} failed", flush=True)

    bench, variants, defaults = [], [], ("", "")
    if not args.skip_bench:
        bench = run_bench(args, deadline, ck.skipped, bench_specs(args))
        if not args.skip_variants:
            variants = bench_variants(args, deadline, ck.skipped)
            A = _approx_act_module()
            defaults = (getattr(A, "FWD_VARIANT", ""), getattr(A, "BWD_VARIANT", ""))
    if not args.skip_pytest and torch.device(DEVICE).type == "cuda":  # after the bench: it compiles a lot
        t0 = time.perf_counter()
        ck.results.append(run_cuda_tests(args.pytest_timeout_s))
        print(f"  pytest: {time.perf_counter() - t0:.0f} s", flush=True)

    elapsed = time.perf_counter() - START
    failed = [r for r in ck.results if not r.ok]
    # stdout (whose tail is what a remote run shows) gets failures only; the file gets every check.
    extra = dict(copy_gbps=copy_gbps, variants=variants, defaults=defaults)
    print(render(ck.results, bench, ck.skipped, args, elapsed, full=False, **extra), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            fh.write("\n".join(head) + "\n" + render(ck.results, bench, ck.skipped, args, elapsed, full=True,
                                                      **extra))
        print(f"wrote {args.out}")
    if failed:
        return 1
    return 3 if ck.timed_out else 0


if __name__ == "__main__":
    sys.exit(main())
