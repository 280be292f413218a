"""Forward + backward time and saved-for-backward bytes of each lmbp op next to the torch op it replaces.

The ops exist to cut activation memory; this shows what that costs in time on the device you run it on
(the PyTorch path on CPU, the Triton kernels on CUDA) and what it saves in bytes (counted exactly with
`SavedTensorLedger`). Pairs:

    approx_act gelu / gelu_tanh / silu / quick_gelu   vs F.gelu / F.gelu(tanh) / F.silu / x·sigmoid(1.702x)
    ms_layer_norm, ms_rms_norm                        vs F.layer_norm / F.rms_norm with a (frozen) affine,
                                                      the op they replace, and without one
    gated_act (act(g)·u), gated_mlp (+ down Linear)   vs eager act(g)·u (and its Linear), when present

Timing: every run is forward (timed), then backward with ``torch.autograd.grad`` (timed) for the inputs and
any trainable parameter (gated_mlp's down weight); op and reference runs alternate so drift hits both alike;
the median of ``--runs`` runs after ``--warmup`` discarded ones. Clock (``--timer``): ``time.thread_time`` with
one thread (CPU time of this thread: other processes on the machine do not count), ``time.perf_counter``
otherwise. On CPU, ``--vs-torch-path`` adds the op's own PyTorch path (native kernels off) as a reference, so the
table shows the native kernels against both. Usage::

    python -m benchmarks.ops                 # default sizes, CPU
    python -m benchmarks.ops --quick         # tiny smoke run
    python -m benchmarks.ops --device cuda --dtypes bf16 --out bench.md
    python -m benchmarks.ops --shapes 64x197x768,8x512x4096 --threads 1 --ops act,norm --kinds gelu,silu \
        --vs-torch-path                         # the CPU targets of issue 13 (ViT-B / LLaMA-like activations)
    python -m benchmarks.ops --cpu-targets --json ops.json    # the same, as benchmarks.all runs it for docs/
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import common as C
from benchmarks.common import DTYPE_NAMES, DTYPES, fmt_bytes, markdown_table

#: The issue's budget: each op at most this many times the torch op's forward+backward time.
TARGET_RATIO = 1.2
#: CPU targets (issue 13), fwd+bwd against the op replaced: approx act ≤ torch's GELU/SiLU, MS norms ≤ 1.05×
#: torch's norm with its affine. ``--cpu-targets`` measures exactly these pairs.
CPU_TARGETS = {"approx_act": 1.0, "ms_layer_norm": 1.05, "ms_rms_norm": 1.05}
CPU_TARGET_ARGS = ["--shapes", "64x197x768,8x512x4096", "--threads", "1", "--ops", "act,norm", "--kinds", "gelu,silu",
                   "--dtypes", "fp32,bf16", "--runs", "9", "--warmup", "1"]
ACT_KINDS = ("gelu", "gelu_tanh", "silu", "quick_gelu")
OP_GROUPS = ("act", "norm", "gated")


# --------------------------------------------------------------------------------------------- cases
@dataclass
class Impl:
    """One side of a comparison: ``fn(*inputs) -> output``; ``params`` are skipped by the byte ledger."""

    name: str
    fn: Callable[..., torch.Tensor]
    params: list = field(default_factory=list)


@dataclass
class Case:
    op: Impl
    refs: list  # list[Impl]: the op it replaces first
    inputs: Callable[[], list]  # fresh leaf tensors requiring grad
    shape: str


@dataclass
class Row:
    op: str
    ref: str
    dtype: str
    shape: str
    op_fwd: float
    op_bwd: float
    ref_fwd: float
    ref_bwd: float
    op_saved: int
    ref_saved: int

    @property
    def op_total(self) -> float:
        return self.op_fwd + self.op_bwd

    @property
    def ref_total(self) -> float:
        return self.ref_fwd + self.ref_bwd

    @property
    def ratio(self) -> float:
        return self.op_total / self.ref_total if self.ref_total > 0 else float("inf")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """HF / CLIP QuickGELU exactly as those models write it (eager)."""
    return x * torch.sigmoid(1.702 * x)


_TORCH_ACT = {
    "gelu": ("F.gelu", F.gelu),
    "gelu_tanh": ("F.gelu(tanh)", lambda x: F.gelu(x, approximate="tanh")),
    "silu": ("F.silu", F.silu),
    "quick_gelu": ("x*sigmoid(1.702x)", _quick_gelu),
}


def _try_import(name: str):
    """The module, or None when it is not there (yet): a missing op is reported, not fatal."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and name.startswith(e.name):
            return None
        raise


def _torch_path(impl: "Impl") -> "Impl":
    """The same op with the native CPU kernels off: its PyTorch path."""
    from lmbp_convert.ops.backends import cpu_native

    def fn(*xs):
        with cpu_native.disabled():
            return impl.fn(*xs)

    return Impl(f"{impl.name.split(' (')[0]} PyTorch path", fn, impl.params)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _leaf(shape: Sequence[int], dtype: torch.dtype, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype).requires_grad_(True)


def act_cases(numel: int, row: int, dtype: torch.dtype, device: torch.device, bits: int,
              kinds: Sequence[str], shape: Optional[tuple] = None) -> tuple[list, list]:
    mod = _try_import("lmbp_convert.ops.approx_act")
    if mod is None:
        return [], ["approx_act: lmbp_convert/ops/approx_act.py not found, activations skipped"]
    shape = shape or (numel // row, row)
    cases = []
    for kind in kinds:
        ref_name, ref_fn = _TORCH_ACT[kind]
        op = Impl(f"approx_act {kind} ({bits}-bit)", lambda x, k=kind: mod.approx_act(x, kind=k, bits=bits))
        cases.append(Case(op, [Impl(ref_name, ref_fn)], lambda: [_leaf(shape, dtype, device, 3.0)],
                          "x".join(map(str, shape))))
    return cases, []


def norm_cases(numel: int, row: int, dtype: torch.dtype, device: torch.device,
               shape: Optional[tuple] = None) -> tuple[list, list]:
    from lmbp_convert.ops.ms_norm import ms_layer_norm, ms_rms_norm

    shape = shape or (numel // row, row)
    w = _frozen(torch.randn(row, device=device).to(dtype))
    b = _frozen(torch.randn(row, device=device).to(dtype))
    ln_op = Impl("ms_layer_norm", lambda x: ms_layer_norm(x, row, 1e-5))
    ln_refs = [Impl("F.layer_norm +affine", lambda x: F.layer_norm(x, (row,), w, b, 1e-5), [w, b]),
               Impl("F.layer_norm", lambda x: F.layer_norm(x, (row,), None, None, 1e-5))]
    rms_op = Impl("ms_rms_norm", lambda x: ms_rms_norm(x, row, 1e-6))
    rms_refs = [Impl("F.rms_norm +weight", lambda x: F.rms_norm(x, (row,), w, 1e-6), [w]),
                Impl("F.rms_norm", lambda x: F.rms_norm(x, (row,), None, 1e-6))]
    inputs = lambda: [_leaf(shape, dtype, device, 2.0)]  # noqa: E731
    s = "x".join(map(str, shape))
    return [Case(ln_op, ln_refs, inputs, s), Case(rms_op, rms_refs, inputs, s)], []


def gated_cases(numel: int, row: int, dtype: torch.dtype, device: torch.device, mlp_out: int,
                act: str = "silu") -> tuple[list, list]:
    mod = _try_import("lmbp_convert.ops.gated_mlp")
    if mod is None:
        return [], ["gated_mlp: lmbp_convert/ops/gated_mlp.py not found, gated MLP skipped"]
    shape = (numel // row, row)
    act_fn = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act]
    # A trainable down projection, as in full fine-tuning (or LoRA's A): its Linear saves its input h.
    wd = nn.Parameter(torch.randn(mlp_out, row, device=device).to(dtype) * row ** -0.5)
    inputs = lambda: [_leaf(shape, dtype, device, 2.0), _leaf(shape, dtype, device)]  # noqa: E731
    s = f"g,u {shape[0]}x{shape[1]}"
    act_case = Case(Impl(f"gated_act {act}", lambda g, u: mod.gated_act(g, u, act)),
                    [Impl(f"{act}(g)*u eager", lambda g, u: act_fn(g) * u)], inputs, s)
    mlp_case = Case(Impl(f"gated_mlp {act}", lambda g, u: mod.gated_mlp(g, u, wd, None, act), [wd]),
                    [Impl(f"Linear({act}(g)*u) eager", lambda g, u: F.linear(act_fn(g) * u, wd), [wd])],
                    inputs, f"{s}, W {mlp_out}x{row}")
    return [act_case, mlp_case], []


# -------------------------------------------------------------------------------------------- timing
CLOCK = time.perf_counter  # set by main(): thread_time with one CPU thread


def _one_run(impl: Impl, xs: list, g: torch.Tensor, device: torch.device) -> tuple[float, float]:
    # Under autograd the backward of a CPU graph runs in this thread, so thread_time sees all of it.
    C.sync(str(device))
    t0 = CLOCK()
    y = impl.fn(*xs)
    C.sync(str(device))
    t1 = CLOCK()
    # Trainable parameters too: a training step needs their grads, and autograd would skip them otherwise.
    grads = torch.autograd.grad(y, list(xs) + [p for p in impl.params if p.requires_grad], g)
    C.sync(str(device))
    t2 = CLOCK()
    del y, grads
    return t1 - t0, t2 - t1


def saved_bytes(impl: Impl, xs: list) -> int:
    return C.ledger_bytes(lambda: impl.fn(*xs), impl.params)


def measure(case: Case, device: torch.device, warmup: int, runs: int) -> list:
    """[(fwd_s, bwd_s, saved_bytes)] medians for the op, then each reference, runs interleaved."""
    impls = [case.op] + list(case.refs)
    xs = case.inputs()
    with torch.no_grad():
        y0 = case.op.fn(*[x.detach() for x in xs])
    g = torch.randn(y0.shape, device=device, dtype=torch.float32).to(y0.dtype)
    del y0
    times = [([], []) for _ in impls]
    for i in range(warmup + runs):
        for k, impl in enumerate(impls):
            f, b = _one_run(impl, xs, g, device)
            if i >= warmup:
                times[k][0].append(f)
                times[k][1].append(b)
    return [(statistics.median(f), statistics.median(b), saved_bytes(impl, xs))
            for impl, (f, b) in zip(impls, times)]


def norm_pair_bytes(numel: int, row: int, dtype: torch.dtype, device: torch.device) -> list:
    """Saved bytes of norm → next Linear (trainable, so it saves its input): where MS-BP's sharing shows."""
    from lmbp_convert.ops.ms_norm import ms_layer_norm, ms_rms_norm

    shape = (numel // row, row)
    w = _frozen(torch.randn(row, device=device).to(dtype))
    b = _frozen(torch.randn(row, device=device).to(dtype))
    lin = nn.Linear(row, 64, device=device, dtype=dtype)
    pairs = [
        ("LayerNorm +affine → Linear", lambda x: lin(F.layer_norm(x, (row,), w, b, 1e-5)),
         "ms_layer_norm → folded Linear", lambda x: lin(ms_layer_norm(x, row, 1e-5))),
        ("RMSNorm +weight → Linear", lambda x: lin(F.rms_norm(x, (row,), w, 1e-6)),
         "ms_rms_norm → folded Linear", lambda x: lin(ms_rms_norm(x, row, 1e-6))),
    ]
    out = []
    for ref_name, ref_fn, op_name, op_fn in pairs:
        x = _leaf(shape, dtype, device)
        params = [w, b] + list(lin.parameters())
        out.append((op_name, ref_name, DTYPE_NAMES.get(dtype, str(dtype)), f"{shape[0]}x{shape[1]}",
                    saved_bytes(Impl(op_name, op_fn, params), [x]),
                    saved_bytes(Impl(ref_name, ref_fn, params), [x])))
    return out


# -------------------------------------------------------------------------------------------- report
def machine_line(device: torch.device) -> str:
    parts = [f"CPU: {C.cpu_name()}", f"{os.cpu_count()} cores", f"torch threads {torch.get_num_threads()}",
             f"torch {torch.__version__}", f"python {platform.python_version()}"]
    if hasattr(os, "getloadavg"):  # other work on the cores skews CPU timings; say how much there was
        parts.append("load avg %.1f/%.1f/%.1f" % os.getloadavg())
    if device.type == "cuda":
        parts.insert(0, f"GPU: {torch.cuda.get_device_name(device)}")
    return ", ".join(parts)


def fmt_ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


TIME_HEADER = ("op", "vs torch op", "dtype", "shape", "fwd ms op / torch", "bwd ms op / torch",
               "fwd+bwd ms op / torch", "ratio", f"≤{TARGET_RATIO}×", "saved op / torch")


def time_rows(rows: Sequence[Row]) -> list:
    out = []
    for r in rows:
        out.append((r.op, r.ref, r.dtype, r.shape, f"{fmt_ms(r.op_fwd)} / {fmt_ms(r.ref_fwd)}",
                    f"{fmt_ms(r.op_bwd)} / {fmt_ms(r.ref_bwd)}", f"{fmt_ms(r.op_total)} / {fmt_ms(r.ref_total)}",
                    f"{r.ratio:.2f}×", "yes" if r.ratio <= TARGET_RATIO else "**no**",
                    f"{fmt_bytes(r.op_saved)} / {fmt_bytes(r.ref_saved)}"))
    return out


def cpu_targets_table(data: dict) -> str:
    """The docs' op table from a ``--json`` file: each op against the torch op it replaces (for the norms, the one
    with its affine), fwd+bwd, and whether the op meets its CPU target."""
    out = []
    for r in data.get("rows", []):
        base = r["op"].split(" ")[0]
        target = CPU_TARGETS.get(base)
        if target is None or ("norm" in base and "+" not in r["ref"]) or "PyTorch path" in r["ref"]:
            continue
        op_t, ref_t = r["op_fwd"] + r["op_bwd"], r["ref_fwd"] + r["ref_bwd"]
        ratio = op_t / ref_t if ref_t > 0 else float("inf")
        out.append((r["op"], r["ref"], r["dtype"], r["shape"], f"{fmt_ms(r['op_fwd'])} / {fmt_ms(r['ref_fwd'])}",
                    f"{fmt_ms(r['op_bwd'])} / {fmt_ms(r['ref_bwd'])}", f"{fmt_ms(op_t)} / {fmt_ms(ref_t)}",
                    f"**{ratio:.2f}×**", f"≤ {target:.2f}×: {'yes' if ratio <= target else 'no'}"))
    return markdown_table(("op", "vs torch op", "dtype", "shape", "fwd ms ours / torch", "bwd ms ours / torch",
                           "fwd+bwd ms ours / torch", "ratio", "target"), out)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    p.add_argument("--sizes", default="4M,16M", help="elements per activation, comma separated (K/M/G suffix)")
    p.add_argument("--dtypes", default="fp32,bf16", help=f"comma separated, from {','.join(DTYPES)}")
    p.add_argument("--row", type=int, default=4096, help="row length (the normalised / feature dim)")
    p.add_argument("--shapes", default=None,
                   help="activation shapes instead of --sizes/--row, e.g. 64x197x768,8x512x4096 (act and norm ops; "
                        "the last dim is the row)")
    p.add_argument("--timer", choices=("auto", "thread", "wall"), default="auto",
                   help="auto: time.thread_time with one thread, time.perf_counter otherwise")
    p.add_argument("--vs-torch-path", action="store_true",
                   help="CPU: also time each op's PyTorch path (native CPU kernels off)")
    p.add_argument("--bits", type=int, default=2, help="approx_act bits")
    p.add_argument("--kinds", default=",".join(ACT_KINDS), help="approx_act kinds")
    p.add_argument("--ops", default=",".join(OP_GROUPS), help=f"op groups, from {','.join(OP_GROUPS)}")
    p.add_argument("--mlp-out", type=int, default=1024, help="gated_mlp down projection output features")
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="tiny smoke run: 64K elements, fp32, 2 runs")
    p.add_argument("--out", default=None, help="also write the markdown report to this file")
    p.add_argument("--json", default=None, help="also write the rows (and the run's settings) to this JSON file")
    p.add_argument("--cpu-targets", action="store_true",
                   help=f"the CPU targets of issue 13: {' '.join(CPU_TARGET_ARGS)} (later flags override)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--cpu-targets" in argv:
        argv = CPU_TARGET_ARGS + argv
    a = p.parse_args(argv)
    if a.quick:
        a.sizes, a.dtypes, a.runs, a.warmup, a.row, a.mlp_out = "64K", "fp32", 2, 1, 1024, 64
    try:
        a.size_list = [C.parse_size(s) for s in a.sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes: cannot parse {a.sizes!r}")
    a.dtype_list = C.parse_dtypes(p, a.dtypes)
    a.shape_list = []
    if a.shapes:
        try:
            a.shape_list = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes.split(",") if s.strip()]
        except ValueError:
            p.error(f"--shapes: cannot parse {a.shapes!r}")
        if any(not s or min(s) <= 0 for s in a.shape_list):
            p.error("--shapes: dims must be positive")
    a.kind_list = [k.strip() for k in a.kinds.split(",") if k.strip()]
    if any(k not in ACT_KINDS for k in a.kind_list):
        p.error(f"--kinds: choose from {ACT_KINDS}")
    a.op_list = [o.strip() for o in a.ops.split(",") if o.strip()]
    if any(o not in OP_GROUPS for o in a.op_list):
        p.error(f"--ops: choose from {OP_GROUPS}")
    if a.row <= 0 or any(s < a.row or s % a.row for s in a.size_list):
        p.error(f"--sizes must be positive multiples of --row ({a.row})")
    if a.runs < 1 or a.warmup < 0:
        p.error("--runs must be >= 1 and --warmup >= 0")
    return a


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    global CLOCK
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    use_thread = a.timer == "thread" or (a.timer == "auto" and device.type == "cpu" and torch.get_num_threads() == 1)
    CLOCK = time.thread_time if use_thread else time.perf_counter
    if device.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks.ops: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    rows: list = []
    notes: list = []
    t_start = time.perf_counter()
    # (numel, row, explicit shape or None) per size
    sizes = [(math.prod(s), s[-1], s) for s in a.shape_list] or [(n, a.row, None) for n in a.size_list]
    for dtype in a.dtype_list:
        for numel, row, shape in sizes:
            cases = []
            if "act" in a.op_list:
                c, n = act_cases(numel, row, dtype, device, a.bits, a.kind_list, shape)
                cases += c
                notes += n
            if "norm" in a.op_list:
                c, n = norm_cases(numel, row, dtype, device, shape)
                cases += c
                notes += n
            if a.vs_torch_path and device.type == "cpu":
                for case in cases:
                    case.refs.append(_torch_path(case.op))
            if "gated" in a.op_list and shape is None:
                c, n = gated_cases(numel, row, dtype, device, a.mlp_out)
                cases += c
                notes += n
            for case in cases:
                res = measure(case, device, a.warmup, a.runs)
                (of, ob, os_), refs = res[0], res[1:]
                for ref, (rf, rb, rs) in zip(case.refs, refs):
                    rows.append(Row(case.op.name, ref.name, DTYPE_NAMES[dtype], case.shape, of, ob, rf, rb,
                                    os_, rs))
                print(f"  measured {case.op.name} [{DTYPE_NAMES[dtype]}, {case.shape}]", file=sys.stderr,
                      flush=True)
    pair_rows = []
    if "norm" in a.op_list:
        numel, row, _ = sizes[-1]
        for dtype in a.dtype_list:
            for op_name, ref_name, dt, shape, ob, rb in norm_pair_bytes(numel, row, dtype, device):
                pair_rows.append((op_name, ref_name, dt, shape, fmt_bytes(ob), fmt_bytes(rb), f"{rb / ob:.2f}×"))

    notes = list(dict.fromkeys(notes))
    report = [
        "# lmbp op benchmark: forward + backward vs the torch op replaced",
        "",
        f"- machine: {machine_line(device)}",
        f"- device: {device}; dtypes: {', '.join(DTYPE_NAMES[d] for d in a.dtype_list)}; "
        + (f"shapes: {a.shapes}; " if a.shape_list else
           f"elements per activation: {', '.join(str(s) for s in a.size_list)}; row length {a.row}; ")
        + f"approx_act bits {a.bits}",
        f"- timing: median of {a.runs} runs after {a.warmup} warm-up, op and torch runs interleaved, "
        f"{'time.thread_time' if CLOCK is time.thread_time else 'time.perf_counter'}; "
        f"backward = torch.autograd.grad on the output; target ≤ {TARGET_RATIO}× the torch op's fwd+bwd",
        "- saved: bytes autograd keeps for backward (SavedTensorLedger; parameters excluded); norm affines are "
        "frozen",
    ]
    if device.type == "cpu":
        from lmbp_convert.ops.backends import cpu_native

        report.append(f"- CPU kernels: {cpu_native.status()}")
    report += [f"- note: {n}" for n in notes]
    report += ["", markdown_table(TIME_HEADER, time_rows(rows))]
    if pair_rows:
        report += ["", "Saved bytes of a norm followed by its (trainable) Linear: the MS op's output is the "
                   "Linear's input, one storage.", "",
                   markdown_table(("pair", "vs torch", "dtype", "shape", "saved MS", "saved torch", "torch / MS"),
                                  pair_rows)]
    slow = [r for r in rows if r.ratio > TARGET_RATIO]
    report += ["", f"{len(rows) - len(slow)}/{len(rows)} comparisons within {TARGET_RATIO}× "
               f"(wall {time.perf_counter() - t_start:.0f} s)."]
    text = "\n".join(report) + "\n"
    print(text)
    if a.json:
        kernels = None
        if device.type == "cpu":
            from lmbp_convert.ops.backends import cpu_native

            kernels = cpu_native.status()
        C.write_json(a.json, {"kind": "ops", "machine": machine_line(device), "device": str(device),
                              "threads": torch.get_num_threads(), "clock": CLOCK.__name__,
                              "cpu_kernels": kernels,
                              "shapes": a.shapes, "runs": a.runs, "warmup": a.warmup, "bits": a.bits,
                              "rows": [dict(vars(r)) for r in rows],
                              "elapsed_s": round(time.perf_counter() - t_start, 1)})
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
