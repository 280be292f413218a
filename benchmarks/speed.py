"""Step time of converted vs original models, convert() time vs model size, and a GPU mode.

    python -m benchmarks.speed                  # CPU: step time + convert() scaling, ~5 min on 2 cores
    python -m benchmarks.speed --tiny           # smoke run
    python -m benchmarks.speed --gpu            # CUDA machine, one command, <= 8 min on one H200

CPU step time: forward + loss + backward (no optimizer), median of ``--repeats`` runs after ``--warmup``
discarded ones, variants interleaved so drift hits all alike: original, converted (the ops' native CPU kernels,
or their PyTorch path where those cannot be built), and per-block checkpointing of the original. Two blocks of
each family (shapes in common.py; LLaMA at seq 256 here to keep the run short); ViT and BERT in fp32, bf16
weights and bf16 autocast, LLaMA in the last two (``--modes`` picks for all). ``--threads`` (default 1):
torch's CPU threads; with one thread the clock is ``time.thread_time`` (this thread's CPU time: other
processes on a shared machine do not count), with more ``time.perf_counter``.

convert() scaling: LLaMA-shaped causal LMs from ~60 M to ~1.1 B parameters (fp32, random weights): trace +
plan alone and the whole convert() (trace, plan, rewrite, verify).

GPU mode (``--gpu``; exits with status 2 at once when CUDA is not available; ``scripts/gpu_run.sh`` runs it
together with the CUDA tests, the kernel bandwidth and the QLoRA flow):
  1. ViT-B/16 LoRA r4 (qkv; head trained), batch 64, 224 px, bf16 autocast, AdamW: img/s,
     torch.cuda.max_memory_allocated and the GPU's busy fraction (kernel time from torch.profiler over the
     unprofiled step time), original vs converted, eager, torch.compile (per block) and
     torch.compile(mode="reduce-overhead") (CUDA graphs), next to the paper (3827 → 2717 MiB, 288 → 290 img/s).
  2. LLaMA-7B-shaped slice (4 blocks, batch 4 x seq 512 by default: --llama-seq / --llama-batch), bf16 weights
     (and bf16 autocast): tokens/s, peak memory, busy fraction and exact per-block saved bytes for original
     eager, torch.compile, Liger-Kernel (its apply_liger_kernel_to_llama: RMSNorm, SwiGLU, RoPE; carried as a
     wheel when not installed), converted (Triton kernels), converted + compile, and checkpointing; plus a
     cross-check of the byte ledger against torch.cuda.memory_allocated.
  3. ViT-B/16 and BERT-base blocks: per-block bytes, original / converted / Liger LayerNorm.
  4. Per-kernel bandwidth: benchmarks/kernels.py, if time is left.
``--sections`` picks and orders the sections. The eager rows of 1 and 2 run first, then their compiled rows,
then CUDA graphs, so a time budget (``--budget-s``) that runs out skips the least essential rows. Every row is
guarded: a failure is recorded with its error and the run goes on. Results: JSON (``--json``, default
$OUT/bench_gpu.json when OUT is set), rewritten after every row, and a markdown summary on stdout.

Files: this one holds the CPU part and the command line; the GPU mode is `benchmarks.speed_gpu`, the tables and
charts `benchmarks.speed_report`.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from typing import Callable, Optional

import torch
from torch import nn

from benchmarks import common as C
# The GPU mode and the report, re-exported: ``python -m benchmarks.speed`` is the one entry point.
from benchmarks.speed_gpu import (LLAMA_PHASES, NO_CUDA, VIT_PHASES, VIT_VARIANTS, Budget,  # noqa: F401
                                  _vit_lora_variant, gpu_problem, gpu_run, llama_slice, vit_lora)
from benchmarks.speed_report import (V_CKPT, V_COMPILE, V_CONV, V_CONV_COMPILE, V_LIGER, V_ORIG,  # noqa: F401
                                     convert_table, cpu_table, gpu_tables, plot_gpu, render)

#: CPU step-time shapes: LLaMA at seq 256 (two 7B-shaped blocks take ~1-2 s a step on 2 cores), ViT batch 4.
CPU_SPEED = {"llama": {"seq": 256}, "vit": {"batch": 4}, "bert": {}}
#: Default step-time modes per family (``--modes`` overrides): a fp32 LLaMA-7B step on one thread takes ~20 s.
CPU_MODES = {"llama": ("bf16", "autocast"), "vit": ("fp32", "bf16", "autocast"), "bert": ("fp32", "bf16", "autocast")}
#: The ViT and BERT steps are short (~0.2 s), so one preemption by another process weighs more: time more runs.
CPU_REPEAT_X = {"llama": 1, "vit": 3, "bert": 3}
#: convert() scaling sizes: (hidden, intermediate, layers, vocab); the last is TinyLlama-1.1B's shape.
CONVERT_SIZES = [(512, 1376, 8, 32000), (1024, 2752, 16, 32000), (1536, 4096, 20, 32000), (2048, 5632, 22, 32000)]
CONVERT_SIZES_TINY = [(64, 172, 2, 256), (128, 344, 2, 256)]


# ============================================================================================ CPU
def cpu_step_times(fam: C.Family, mode: str, repeats: int, warmup: int, log=print,
                   clock: Callable[[], float] = time.perf_counter) -> list[dict]:
    from lmbp_convert import convert

    dtype, ac = C.mode_dtype(mode), mode == "autocast"
    orig = C.build(fam, dtype)
    conv = convert(copy.deepcopy(orig))
    ckpt = copy.deepcopy(orig)
    C.set_checkpointing(ckpt, True)
    x = C.make_input(fam, dtype)
    steps = {V_ORIG: C.step_fn(fam, orig, x, ac), V_CONV: C.step_fn(fam, conv, x, ac),
             V_CKPT: C.step_fn(fam, ckpt, x, ac)}
    times = C.time_interleaved(steps, repeats, warmup, clock=clock)
    t0, b0 = C.median(times[V_ORIG]), min(times[V_ORIG])
    rows = []
    for v, ts in times.items():
        m = C.median(ts)
        paired = sorted(a / b for a, b in zip(ts, times[V_ORIG]))  # per round: drift cancels within a round
        ratio, q1, q3 = C.median(paired), paired[len(paired) // 4], paired[(3 * len(paired)) // 4]
        rows.append({"family": fam.name, "label": fam.label, "mode": mode, "variant": v, "median_s": m,
                     "min_s": min(ts), "runs_s": [round(t, 4) for t in ts], "ratio": ratio, "ratio_q1": q1,
                     "ratio_q3": q3, "ratio_of_medians": m / t0, "ratio_min": min(ts) / b0, "shape": fam.describe()})
        log(f"  {fam.label:<10} {mode:<8} {v:<14} {m:8.3f} s/step (best {min(ts):.3f})  ×{ratio:.3f} "
            f"(rounds' quartiles ×{q1:.3f}–{q3:.3f})")
    del orig, conv, ckpt
    C.free()
    return rows


def build_causal_lm(hidden: int, inter: int, layers: int, vocab: int, dtype=torch.float32) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    C.quiet()
    cfg = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                               num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 256),
                               vocab_size=vocab, tie_word_embeddings=False)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    m = C.cheap_init(m.to_empty(device="cpu"))
    m.model.rotary_emb.__init__(config=cfg)
    return m


def time_convert(model: nn.Module):
    """(seconds for trace + plan alone, seconds for the whole convert(), its report); converts in place."""
    from lmbp_convert import convert, plan_conversion

    t0 = time.perf_counter()
    plan_conversion(model, measure=False)
    t_plan = time.perf_counter() - t0
    t0 = time.perf_counter()
    rep = convert(model).lmbp_report
    return t_plan, time.perf_counter() - t0, rep


def convert_scaling(sizes, log=print) -> list[dict]:
    rows = []
    for h, i, n, v in sizes:
        m = build_causal_lm(h, i, n, v)
        params = sum(p.numel() for p in m.parameters())
        t_plan, t_conv, rep = time_convert(m)
        rows.append({"hidden": h, "intermediate": i, "layers": n, "vocab": v, "params": params,
                     "plan_s": round(t_plan, 2), "convert_s": round(t_conv, 2), "verified": rep.verified})
        log(f"  convert() LLaMA h{h} i{i} L{n}: {params / 1e6:7.0f} M params  trace+plan {t_plan:5.2f} s  "
            f"convert {t_conv:5.2f} s  verified {rep.verified}")
        del m, rep
        C.free()
    return rows


# ============================================================================================ main
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (smoke run)")
    ap.add_argument("--families", default="llama,vit,bert")
    ap.add_argument("--modes", default=None,
                    help="CPU steps: ViT/BERT fp32,bf16,autocast and LLaMA bf16,autocast by default; GPU: bf16,autocast")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU steps: torch threads (1: time.thread_time, more: time.perf_counter)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs (CPU default 5, GPU default 10)")
    ap.add_argument("--warmup", type=int, default=None, help="discarded runs (CPU default 1, GPU default 3)")
    ap.add_argument("--no-convert-scaling", action="store_true")
    ap.add_argument("--no-steps", action="store_true", help="skip the CPU step-time part")
    ap.add_argument("--gpu", action="store_true", help="the GPU benchmark (needs CUDA)")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # tests run the GPU mode's code on CPU
    ap.add_argument("--budget-s", type=float, default=420.0, help="GPU mode: skip work past this many seconds")
    ap.add_argument("--no-compile", action="store_true", help="GPU mode: skip the torch.compile rows")
    ap.add_argument("--skip-kernels", action="store_true", help="GPU mode: skip the per-kernel bandwidth")
    ap.add_argument("--sections", default="vit_lora,llama_slice,blocks,kernels",
                    help="GPU mode: which sections to run, in this order")
    ap.add_argument("--llama-seq", type=int, default=None, help="GPU mode: LLaMA slice sequence length (512)")
    ap.add_argument("--llama-batch", type=int, default=None, help="GPU mode: LLaMA slice batch (4)")
    ap.add_argument("--no-checkpointing", action="store_true", help="GPU mode: skip the checkpointing row")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--plot", default=None, help="write the PNG charts into this folder")
    a = ap.parse_args(argv)
    a.family_list = [s.strip() for s in a.families.split(",") if s.strip()]
    a.mode_list = [s.strip() for s in (a.modes or "bf16,autocast").split(",") if s.strip()]
    if not a.family_list or not set(a.family_list) <= set(C.FULL):
        ap.error(f"--families: choose from {list(C.FULL)}")
    if not a.mode_list or not set(a.mode_list) <= set(C.MODES):
        ap.error(f"--modes: choose from {list(C.MODES)}")
    a.steps = a.repeats if a.repeats is not None else (10 if a.gpu else 5)
    a.repeats = a.steps
    a.warmup = a.warmup if a.warmup is not None else (3 if a.gpu else 1)
    if a.threads < 1:
        ap.error("--threads must be >= 1")
    if a.steps < 1 or a.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    if a.gpu and a.json is None and os.environ.get("OUT"):
        a.json = os.path.join(os.environ["OUT"], "bench_gpu.json")
    return a


def cpu_run(args, log=print) -> dict:
    t0 = time.perf_counter()
    data = {"kind": "speed", "machine": C.machine("cpu"), "device": "cpu", "tiny": args.tiny,
            "repeats": args.repeats, "warmup": args.warmup, "steps": [], "convert": [],
            "loadavg_start": _loadavg()}
    if not args.no_steps:
        from lmbp_convert.ops.backends import cpu_native

        threads = torch.get_num_threads()
        torch.set_num_threads(args.threads)
        clock = time.thread_time if args.threads == 1 else time.perf_counter
        data.update(threads=args.threads, clock=clock.__name__, cpu_kernels=cpu_native.status())
        log(f"# CPU step time on {data['machine']}; {args.threads} thread(s), time.{clock.__name__}; "
            f"CPU kernels: {data['cpu_kernels']}")
        try:
            for fam in C.families(args.tiny, args.family_list):
                if not args.tiny:
                    fam = fam.with_(**CPU_SPEED[fam.name])
                for mode in (args.mode_list if args.modes else CPU_MODES[fam.name]):
                    reps = args.repeats * (1 if args.tiny else CPU_REPEAT_X[fam.name])
                    data["steps"] += cpu_step_times(fam, mode, reps, args.warmup, log, clock)
                    C.save_json(args.json, data)
        finally:
            torch.set_num_threads(threads)
    if not args.no_convert_scaling:
        log("# convert() time vs parameters")
        data["convert"] = convert_scaling(CONVERT_SIZES_TINY if args.tiny else CONVERT_SIZES, log)
    data["loadavg_end"] = _loadavg()
    return C.finish(data, t0, args.json)


def _loadavg() -> Optional[list]:
    """1/5/15-minute load averages: on a shared machine, other work slows the timed steps."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _render_gpu(data: dict, out_dir: str) -> list[str]:
    path = os.path.join(out_dir, "bench_gpu.png")
    return [path] if plot_gpu(data, path) else []


def main(argv=None) -> int:
    args = parse_args(argv)
    C.quiet()
    if args.gpu:
        problem = gpu_problem(args.device)
        if problem:
            print(problem, file=sys.stderr)
            return 2
        data = gpu_run(args)
        print("\n" + gpu_tables(data))
        return C.print_end(data, _render_gpu, args.plot)
    data = cpu_run(args)
    if data["steps"]:
        print("\n" + cpu_table(data))
    if data["convert"]:
        print("\n" + convert_table(data))
    return C.print_end(data, render, args.plot)


if __name__ == "__main__":
    sys.exit(main())
