"""Regenerate every benchmark figure and table in docs/ with one command.

    python -m benchmarks.all                          # CPU: memory + speed (~20 min on 2 cores), then render
    python -m benchmarks.all --render-only            # re-render docs/ from build/bench/*.json
    python -m benchmarks.all --gpu-json bench_gpu.json --render-only   # add a GPU run's results
    python -m benchmarks.all --tiny                   # smoke run, into build/bench-tiny/

Runs benchmarks/memory.py, host.py, ops.py (``--cpu-targets``) and speed.py (each in its own process, one after
the other so the timings do not compete), keeps their JSON in ``--results`` (default build/bench/), draws the PNG charts
and writes ``docs/benchmarks.md``. The GPU part (``python -m benchmarks.speed --gpu``) needs a CUDA machine; its JSON is
passed with ``--gpu-json`` and is kept, embedded in benchmarks.md, so later CPU-only regenerations keep the
last GPU figures (with the machine they were measured on) instead of dropping them.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time

from benchmarks import common as C
from benchmarks import host as H
from benchmarks import memory as M
from benchmarks import ops as O
from benchmarks import speed as S

GPU_MARK = "lmbp-bench-gpu"
GPU_RE = re.compile(r"<!-- " + GPU_MARK + r" (.*?) -->", re.S)


GPU_NOTES = [
    "Notes:",
    "- *ViT-B/16 LoRA*: peak is `torch.cuda.max_memory_allocated` over 10 training steps (forward, backward, "
    "AdamW), weights and optimizer state included, as in the paper; img/s from the median step.",
    "- *GPU busy*: GPU kernel time per step (the sum of the device-side durations `torch.profiler` records over "
    "3 steps) over the unprofiled step time. Well below 100 % means the step is bound by host time (Python "
    "launchers, dispatch), not by kernels; the section *Host time of the CUDA path* measures that host time "
    "per op on a CPU.",
    "- *reduce-overhead*: `torch.compile(mode=\"reduce-overhead\")` per block (CUDA graphs), "
    "`torch.compiler.cudagraph_mark_step_begin()` before each step; the optimizer step stays eager.",
    "- *LLaMA slice*: the bytes per block and the ledger column (held at the end of the forward) show the "
    "activation saving. The peak of a step moves little here because, with every parameter trained, backward "
    "allocates the full gradients (about 1.5 GiB for 4 bf16 blocks) while activations are being freed.",
    "- *ledger / allocator*: the ledger's count against `torch.cuda.memory_allocated` after the same forward "
    "(minus the output): equal within a few MiB (rotary tables, masks) in bf16, compiled models included. "
    "Under autocast the allocator also holds autocast's cached bf16 weight copies (up to 1.5 GiB here).",
    "- *Liger-Kernel*: liger-kernel 0.8.5, `apply_liger_kernel_to_llama(rope, rms_norm, swiglu)`; for ViT and "
    "BERT only its LayerNorm applies, and it keeps what torch's LayerNorm keeps.",
    "- *converted + compile*: the graph-break count comes from dynamo on that machine's torch; bytes are "
    "unchanged by compiling the converted model.",
]


def run_module(name: str, argv: list[str], log_path: str) -> None:
    """Run one benchmark (``python -m benchmarks.NAME``), echoing its output and keeping a log; raise if it fails."""
    cmd = [sys.executable, "-u", "-m", f"benchmarks.{name}"] + argv
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, cwd=C.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        for line in p.stdout:
            sys.stdout.write(line)
            log.write(line)
        rc = p.wait()
    if rc != 0:
        raise SystemExit(f"{name} failed with status {rc}; see {log_path}")


def embedded_gpu(md_path: str) -> dict | None:
    if not os.path.exists(md_path):
        return None
    with open(md_path) as f:
        m = GPU_RE.search(f.read())
    return json.loads(m.group(1).replace("-\\-", "--")) if m else None


KEPT_RE = re.compile(r"<!-- lmbp-kept-section (\S+) -->.*?<!-- /lmbp-kept-section \1 -->", re.S)


def kept_sections(md_path: str) -> list[str]:
    """Sections measured by their own benchmark module (``python -m benchmarks.moe``), written between
    ``<!-- lmbp-kept-section NAME -->`` and ``<!-- /lmbp-kept-section NAME -->``: carried over as they are when this
    module regenerates the file, since it does not rerun those modules."""
    if not os.path.exists(md_path):
        return []
    with open(md_path) as f:
        return [x for m in KEPT_RE.finditer(f.read()) for x in ("", m.group(0))]


def _slim_gpu(g: dict) -> dict:
    g = json.loads(json.dumps(g))
    g.get("kernels", {}).pop("stderr_tail", None)
    return g


def gpu_dated(gpu: dict, cpu_machine: str | None) -> list[str]:
    """When the GPU figures were measured, with what, and what has changed in the code since (``gpu["since"]``: a
    list a maintainer adds to the embedded results when the code moves on; a new GPU run has none)."""
    when = gpu.get("date") or "on a date its results do not record"
    line = f"**Measured {when}** on {gpu.get('machine', '?')}"
    if cpu_machine and cpu_machine != gpu.get("machine"):
        line += f"; this file's CPU sections: {cpu_machine}"
    out = [line + "."]
    since = gpu.get("since") or []
    if since:
        out += ["", "Changed since that run, not in its figures (rerun: `bash scripts/gpu_run.sh` on a CUDA machine, "
                "then `python -m benchmarks.all --render-only --gpu-json ...`):", *[f"- {s}" for s in since]]
    return out


def _img(out_dir: str, name: str) -> str:
    return f"![{name}]({name})" if os.path.exists(os.path.join(out_dir, name)) else ""


def gpu_headline(gpu: dict | None) -> list[str]:
    if not gpu:
        return []
    lines = []
    v = {r["variant"]: r for r in gpu.get("vit_lora", {}).get("rows", []) if "peak" in r}
    if S.V_ORIG in v and S.V_CONV in v:
        o, c = v[S.V_ORIG], v[S.V_CONV]
        lines.append(f"- **GPU, ViT-B/16 LoRA r4, batch 64** ({gpu['machine'].split(' (')[0]}): peak "
                     f"{o['peak'] / C.MiB:.0f} → {c['peak'] / C.MiB:.0f} MiB ({C.pct(c['peak'], o['peak'])}; paper "
                     f"3827 → 2717 MiB, −29.0 %), {o['img_s']:.0f} → {c['img_s']:.0f} img/s (paper 288 → 290)"
                     + "".join(f"; {label} {v[a]['img_s']:.0f} → {v[b]['img_s']:.0f} img/s"
                               for label, a, b in (("torch.compile", S.V_COMPILE, S.V_CONV_COMPILE),
                                                   ("reduce-overhead", S.V_COMPILE + " (reduce-overhead)",
                                                    S.V_CONV_COMPILE + " (reduce-overhead)"))
                               if "img_s" in v.get(a, {}) and "img_s" in v.get(b, {})))
    rows = {(r["mode"], r["variant"]): r for r in gpu.get("llama_slice", {}).get("rows", []) if "block_bytes" in r}
    for mode in ("bf16", "autocast"):
        o = rows.get((mode, S.V_ORIG))
        if not o:
            continue
        parts = [f"{name} {C.pct(rows[(mode, var)]['block_bytes'], o['block_bytes'])}"
                 for var, name in ((S.V_CONV, "converted"), (S.V_LIGER, "Liger-Kernel"),
                                   (S.V_COMPILE, "torch.compile")) if (mode, var) in rows]
        conv = rows.get((mode, S.V_CONV))
        speed = f"; tokens/s converted / original {conv['tokens_s'] / o['tokens_s']:.2f}×" if conv else ""
        speed += "".join(f", converted / {name} {conv['tokens_s'] / rows[(mode, var)]['tokens_s']:.2f}×"
                         for var, name in ((S.V_LIGER, "Liger-Kernel"), (S.V_COMPILE, "torch.compile"))
                         if conv and (mode, var) in rows)
        lines.append(f"- **GPU, LLaMA-7B slice, {C.MODE_LABEL[mode]}**, bytes per block: " + ", ".join(parts) + speed)
    return lines


def headline(mem: dict, speed: dict) -> list[str]:
    """One line per family: reduction in bf16 and autocast, and against torch.compile."""
    k = M.by_key(mem.get("blocks", []))
    lines = []
    for f in mem.get("families", []):
        parts = []
        for mode in mem["modes"]:
            o = (k.get((f["name"], mode, M.V_ORIG)) or {}).get("bytes")
            c = (k.get((f["name"], mode, M.V_CONV)) or {}).get("bytes")
            t = (k.get((f["name"], mode, M.V_COMPILE)) or {}).get("bytes")
            if o and c:
                s = f"{C.MODE_LABEL[mode]}: {C.pct(c, o)}"
                if t:
                    s += f" (torch.compile alone {C.pct(t, o)}; converted is {C.pct(c, t)} vs compile)"
                parts.append(s)
        if parts:
            lines.append(f"- **{f['label']} block**: " + "; ".join(parts))
    ratios = [r for r in speed.get("steps", []) if r["variant"] == S.V_CONV]
    if ratios:
        lines.append("- **CPU step time, converted / original**: " + ", ".join(
            f"{r['label']} {r['mode']} {r['ratio']:.2f}×" for r in ratios))
    return lines


def step_time_text(speed: dict) -> str:
    """How the CPU step times were taken (threads, clock, kernels), from the speed JSON."""
    threads, clock = speed.get("threads"), speed.get("clock")
    how = (f"{threads} thread{'s' if threads != 1 else ''}, `time.{clock}`" if threads else "torch's default threads, "
           "`time.perf_counter`")
    kernels = speed.get("cpu_kernels", "")
    where = ("the ops' native CPU kernels (`lmbp_convert/ops/backends/csrc/cpu_ops.cpp`)" if kernels.startswith("native")
             else "the ops' PyTorch path")
    return (f"Forward + loss + backward (no optimizer), {speed.get('repeats')} rounds (ViT and BERT: "
            f"{3 * (speed.get('repeats') or 0)}) after {speed.get('warmup')} warm-up, the variants interleaved in each "
            f"round (every run is in the results JSON), {how}; s/step is the median over rounds, a ratio the median "
            "over rounds of that round's ratio (drift cancels within a round), in brackets the quartiles of those "
            f"per-round ratios: the run-to-run spread on this machine. On CPU the converted model runs {where}. "
            f"Load average (1, 5, 15 min) at start {speed.get('loadavg_start')}, at end {speed.get('loadavg_end')}: "
            "this 2-core machine is shared with other jobs, which moves single rounds by several per cent (the "
            "quartiles) and the absolute times more; the GPU section has the speed that matters for training.")


def ops_section(ops: dict | None) -> list[str]:
    if not ops:
        return ["(not run)"]
    return [f"Each op against the torch op it replaces, forward + backward (`torch.autograd.grad` on the output), "
            f"median of {ops.get('runs')} interleaved runs after {ops.get('warmup')} warm-up, "
            f"{ops.get('threads')} thread, `time.{ops.get('clock')}`; `python -m benchmarks.ops --cpu-targets` "
            f"({ops.get('machine')}). CPU kernels: {ops.get('cpu_kernels')}. Both sides allocate the same outputs, "
            "and the first touch of fresh memory (page faults) is a large share of these figures: fp32 outputs of "
            "this size are always fresh `mmap`s, and whether a bf16 one is depends on glibc's dynamic trim "
            "threshold, which the approx act's extra code buffer can tip (a row where one side's backward pays "
            "faults and the other's does not). `MALLOC_TRIM_THRESHOLD_=4000000000 MALLOC_MMAP_THRESHOLD_=4000000000 "
            "python -m benchmarks.ops --cpu-targets` takes the allocator out and times the kernels alone.",
            "", O.cpu_targets_table(ops)]


def write_markdown(out_dir: str, mem: dict, speed: dict, gpu: dict | None, seconds: float,
                   host: dict | None = None, ops: dict | None = None) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    fams = "; ".join(f"{f['label']}: {f['describe']}" for f in mem.get("families", []))
    md = [
        "# Benchmarks",
        "",
        f"Generated by `python -m benchmarks.all` on {now} (CPU part: {seconds / 60:.0f} min). "
        "Bytes are exact saved-for-backward bytes per block (`SavedTensorLedger`: unique storages kept between "
        "forward and backward; parameters and autocast weight copies excluded), measured as the model with 2 "
        "blocks minus the same model cut to 1 block, so embedding, final norm and head cancel out. Weights are "
        "random (no network); dropout is off in every model.",
        "",
        f"CPU machine: {mem.get('machine')}.",
        f"Shapes: {fams}.",
        "",
        "## Headline",
        "",
        *headline(mem, speed),
        *gpu_headline(gpu),
        "",
        "## Activation memory per block",
        "",
        M.summary_table(mem, gpu),
        "",
        _img(out_dir, "bench_memory.png"),
        "",
        "Notes:",
        "- *paper (analytic)*: the reduction the paper computes for ViT (ReGELU2 + MS-LN) and LLaMA (ReSiLU2 + "
        "MS-RMSNorm). For LLaMA the table also shows ours with only those two rewrites "
        "(`convert(model, gated_mlp=False)`); the default adds the memory-sharing gated MLP.",
        "- Attention is SDPA (`attn_implementation=\"sdpa\"`, timm's fused attention). On this CPU, with no mask "
        "and no dropout, SDPA runs its flash kernel (`_scaled_dot_product_flash_attention_for_cpu`), which keeps "
        "q, k, v, the output and the log-sum-exp, as the GPU kernels do; so these per-block figures hold for a "
        "GPU too. The `eager attn` rows below keep the seq × seq fp32 softmax and show how an attention that "
        "stores it dilutes the reduction.",
        "- *torch.compile*: each block compiled with inductor; the ledger sees what the compiled graph saves "
        "(AOTAutograd saves with `ctx.save_for_backward`, which saved-tensor hooks see; bf16 weight casts it "
        "saves under autocast are not counted). The GPU run below cross-checks the ledger against "
        "`torch.cuda.memory_allocated`.",
        "- *converted + compile*: no saved-tensor hook runs inside a compiled graph, so the exact norms' y is "
        "rebuilt from x̂ only where the partitioner may recompute it. Where only Linears read y as it is (a pre-LN "
        "block's norms) the norm emits y in the autocast dtype under compile (`MSExactNorm.autocast_readers`: the "
        "values the Linears' own casts make), and the compiled block keeps the eager bytes. BERT's post-LN norms "
        "are also read by a residual add: under autocast each Linear's bf16 cast of y is a node its backward "
        "reads, which inductor saves beside x̂, and the block's final norm output leaves its graph, so the next "
        "block's graph saves it as an input.",
        "- *checkpointing*: per-block, non-reentrant activation checkpointing of the original: only the block "
        "input is kept, at the price of a second forward in backward (see the step times).",
        "- *Liger-Kernel* is Triton/CUDA-only and cannot run on this CPU; its column shows the GPU run's "
        "per-block change (same shapes, batch 4 for LLaMA; see the GPU section), `n/a` without one.",
        "",
        "<details><summary>All variants</summary>",
        "",
        M.full_table(mem),
        "",
        "</details>",
        "",
        "## How activation memory grows",
        "",
        _img(out_dir, "bench_scaling.png"),
        "",
        M.scaling_table(mem) if mem.get("scaling") else "(not run)",
        "",
        "## Step time on CPU",
        "",
        step_time_text(speed),
        "",
        S.cpu_table(speed) if speed.get("steps") else "(not run)",
        "",
        _img(out_dir, "bench_speed.png"),
        "",
        "## Op time on CPU",
        "",
        *ops_section(ops),
        "",
        "## Host time of the CUDA path (CPU proxy)",
        "",
        "What a GPU step pays on the host for each op, measured on this CPU: the ops' Triton path with the "
        "kernels compiled for the GPU and every launch a no-op (Triton's real launcher on a stub driver; "
        "`testsupport/triton_stub.py`), tiny tensors, against the native op it replaces on the same tiny tensors "
        "(their CPU kernels there cost little more than their dispatch). The step proxies run ViT-B/16's, a LLaMA "
        "decoder's and BERT-base's (post-LN) modules at tiny width: their ratios are the host-bound limit of the "
        "GPU ratios.",
        "",
        H.host_tables(host) if host else "(not run)",
        "",
        "## convert() time vs model size",
        "",
        S.convert_table(speed) if speed.get("convert") else "(not run)",
        "",
        _img(out_dir, "bench_convert_time.png"),
        "",
        "## GPU",
        "",
    ]
    if gpu:
        blob = json.dumps(_slim_gpu(gpu)).replace("--", "-\\-")  # "--" may not appear inside an HTML comment
        md += [*gpu_dated(gpu, mem.get("machine")), "",
               f"`python -m benchmarks.speed --gpu` (one command, budgeted to finish within 8 minutes; this run "
               f"took {gpu.get('elapsed_s', '?')} s).", "", S.gpu_tables(gpu), "", _img(out_dir, "bench_gpu.png"), "",
               *GPU_NOTES, "", f"<!-- {GPU_MARK} {blob} -->"]
    else:
        md += ["Not run yet: `bash scripts/gpu_run.sh` on a CUDA machine (or `python -m benchmarks.speed --gpu "
               "--json bench_gpu.json`), then `python -m benchmarks.all --render-only --gpu-json bench_gpu.json "
               "--qlora-json bench_qlora.json`."]
    md += kept_sections(os.path.join(out_dir, "benchmarks.md"))
    md += ["", "## Reproduce", "", "```bash", "pip install -e '.[bench]'   # matplotlib",
           "python -m benchmarks.all                    # everything on CPU, then docs/",
           "python -m benchmarks.memory --help          # one part at a time",
           "python -m benchmarks.host                   # host time of the CUDA path, on any CPU",
           "python -m benchmarks.moe                    # MoE blocks (its section above is kept by benchmarks.all)",
           "python -m benchmarks.checkpoint             # lmbp-convert on a 3 GB checkpoint against a plain copy",
           "python -m benchmarks.step_peak --help       # whole-step peak (its section above is kept)",
           "python -m benchmarks.budget_curve           # peak vs step time, layers checkpointed by budget",
           "python -m benchmarks.speed --gpu            # on a CUDA machine",
           "bash scripts/gpu_run.sh                     # a CUDA machine: CUDA tests, kernels, GPU speed, QLoRA flow",
           "```", ""]
    text = "\n".join(md)
    with open(os.path.join(out_dir, "benchmarks.md"), "w") as f:
        f.write(text)
    return text


def readme_section(mem: dict, speed: dict, gpu: dict | None, docs_prefix: str = "docs/") -> str:
    """The short version for the README: headline, the summary table, the memory chart."""
    return "\n".join([
        "## Benchmarks", "",
        f"Exact saved-for-backward bytes per block ({mem.get('machine')}); full tables, scaling, step time, "
        f"GPU figures and how to regenerate them: [{docs_prefix}benchmarks.md]({docs_prefix}benchmarks.md).", "",
        M.summary_table(mem, gpu), "",
        f"![activation memory per block]({docs_prefix}bench_memory.png)", "",
        *headline(mem, speed), *gpu_headline(gpu), ""])


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (smoke run)")
    ap.add_argument("--out-dir", default=None, help="where benchmarks.md and PNGs go (default docs/; with --tiny "
                    "build/bench-tiny/, so a smoke run never overwrites the real figures)")
    ap.add_argument("--results", default=None, help="JSON results folder (default build/bench/, "
                    "with --tiny build/bench-tiny/)")
    ap.add_argument("--render-only", action="store_true", help="do not measure; render the JSON in --results")
    ap.add_argument("--gpu-json", default=None, help="results of benchmarks.speed --gpu to include")
    ap.add_argument("--qlora-json", default=None, help="results of benchmarks.qlora to include in the GPU section")
    ap.add_argument("--families", default=None, help="pass-through: a subset of llama,vit,bert")
    ap.add_argument("--modes", default=None, help="pass-through: a subset of bf16,autocast")
    ap.add_argument("--no-compile", action="store_true", help="pass-through: skip torch.compile rows")
    ap.add_argument("--no-scaling", action="store_true", help="pass-through: skip the scaling sweeps")
    ap.add_argument("--repeats", type=int, default=None, help="pass-through: timed runs per step time")
    ap.add_argument("--warmup", type=int, default=None, help="pass-through: warm-up runs")
    ap.add_argument("--no-convert-scaling", action="store_true", help="pass-through")
    a = ap.parse_args(argv)
    tiny_dir = os.path.join(C.ROOT, "build", "bench-tiny")
    a.out_dir = a.out_dir or (tiny_dir if a.tiny else os.path.join(C.ROOT, "docs"))
    a.results = a.results or (tiny_dir if a.tiny else os.path.join(C.ROOT, "build", "bench"))
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    os.makedirs(a.results, exist_ok=True)
    os.makedirs(a.out_dir, exist_ok=True)
    mem_json, speed_json = os.path.join(a.results, "memory.json"), os.path.join(a.results, "speed.json")
    gpu_json = os.path.join(a.results, "gpu.json")
    host_json = os.path.join(a.results, "host.json")
    ops_json = os.path.join(a.results, "ops.json")
    t0 = time.perf_counter()
    if not a.render_only:
        common = (["--tiny"] if a.tiny else []) + (["--families", a.families] if a.families else []) + (
            ["--modes", a.modes] if a.modes else [])
        run_module("memory", common + ["--json", mem_json] + (["--no-compile"] if a.no_compile else [])
                   + (["--no-scaling"] if a.no_scaling else []), os.path.join(a.results, "memory.log"))
        run_module("host", ["--json", host_json] + (["--quick"] if a.tiny else []),
                   os.path.join(a.results, "host.log"))
        run_module("ops", ["--cpu-targets", "--json", ops_json] + (["--quick"] if a.tiny else []),
                   os.path.join(a.results, "ops.log"))
        run_module("speed", common + ["--json", speed_json]
                   + (["--repeats", str(a.repeats)] if a.repeats is not None else [])
                   + (["--warmup", str(a.warmup)] if a.warmup is not None else [])
                   + (["--no-convert-scaling"] if a.no_convert_scaling else []),
                   os.path.join(a.results, "speed.log"))
    mem, speed = C.read_json(mem_json), C.read_json(speed_json)
    seconds = mem.get("elapsed_s", 0) + speed.get("elapsed_s", 0)
    gpu = None
    if a.gpu_json:
        gpu = C.read_json(a.gpu_json)
        if a.qlora_json:
            gpu["qlora"] = C.read_json(a.qlora_json)
        C.write_json(gpu_json, gpu)
    elif os.path.exists(gpu_json):
        gpu = C.read_json(gpu_json)
    else:
        gpu = embedded_gpu(os.path.join(a.out_dir, "benchmarks.md"))
    paths = M.render(mem, a.out_dir) + S.render(speed, a.out_dir)
    gpu_png = os.path.join(a.out_dir, "bench_gpu.png")
    if gpu and S.plot_gpu(gpu, gpu_png):
        paths.append(gpu_png)
    host = C.read_json(host_json) if os.path.exists(host_json) else None
    ops = C.read_json(ops_json) if os.path.exists(ops_json) else None
    write_markdown(a.out_dir, mem, speed, gpu, seconds, host, ops)
    paths.append(os.path.join(a.out_dir, "benchmarks.md"))
    snippet = os.path.join(a.results, "README_section.md")  # for pasting into the README
    with open(snippet, "w") as f:
        prefix = os.path.relpath(a.out_dir, C.ROOT).replace(os.sep, "/") + "/"
        f.write(readme_section(mem, speed, gpu, "" if prefix.startswith("..") else prefix))
    paths.append(snippet)
    print("\n" + "\n".join(headline(mem, speed) + gpu_headline(gpu)))
    print("\nwrote:\n  " + "\n  ".join(paths))
    print(f"\nbenchmarks.all: {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
