"""Benchmark ``lmbp-convert`` on a multi-GB LLaMA-layout sharded checkpoint: throughput vs a plain copy, peak RSS.

The checkpoint is random bf16 written straight with safetensors (no model is built), with a LlamaForCausalLM
config.json. Both contenders run with the source in the page cache (it is read once before each timing; with
--cold it is evicted instead), write fresh files into the same file system, and are timed end to end (the copy
also with an fsync of every file, as lmbp-convert makes DST durable before renaming it into place); the CLI runs
in a subprocess whose own peak RSS is read with ``os.wait4`` (through a tiny launcher process). The CLI reports how long planning and writing took,
so the streaming rate is shown apart from the fixed start-up (Python imports of torch and transformers).

    python -m benchmarks.checkpoint            # ~3.4 GB: hidden 4096, intermediate 11008, 7 layers, ~1 GB shards
    python -m benchmarks.checkpoint --small    # a quick smoke run (~60 MB)
    python -m benchmarks.checkpoint --cold     # SRC read from the device (the CLI prefetches it meanwhile)

Contenders run in interleaved rounds (copy, CLI[, baseline] per round); medians are reported.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from benchmarks import common as C


def llama_tensors(hidden: int, inter: int, layers: int, vocab: int, kv_heads: int, heads: int):
    """(name, shape) of every LlamaForCausalLM tensor, in the order save_pretrained writes them."""
    hd = hidden // heads
    yield "model.embed_tokens.weight", (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (hidden,)
        yield p + "self_attn.q_proj.weight", (hidden, hidden)
        yield p + "self_attn.k_proj.weight", (kv_heads * hd, hidden)
        yield p + "self_attn.v_proj.weight", (kv_heads * hd, hidden)
        yield p + "self_attn.o_proj.weight", (hidden, hidden)
        yield p + "post_attention_layernorm.weight", (hidden,)
        yield p + "mlp.gate_proj.weight", (inter, hidden)
        yield p + "mlp.up_proj.weight", (inter, hidden)
        yield p + "mlp.down_proj.weight", (hidden, inter)
    yield "model.norm.weight", (hidden,)
    yield "lm_head.weight", (vocab, hidden)


def make_checkpoint(root: Path, a: argparse.Namespace) -> None:
    root.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    specs = list(llama_tensors(a.hidden, a.intermediate, a.layers, a.vocab, a.heads, a.heads))
    limit = int(a.shard_mb * 2**20)
    groups, cur, size = [], [], 0
    for name, shape in specs:
        n = torch.Size(shape).numel() * 2
        if cur and size + n > limit:
            groups.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += n
    groups.append(cur)
    weight_map, total = {}, 0
    for gi, group in enumerate(groups):
        fname = f"model-{gi + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name, shape in group:
            if len(shape) == 1:  # norm weights around 1
                t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            else:
                t = torch.randn(shape, generator=gen) * 0.02
            tensors[name] = t.to(torch.bfloat16)
            weight_map[name] = fname
            total += tensors[name].numel() * 2
        save_file(tensors, str(root / fname), metadata={"format": "pt"})
        del tensors
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": a.hidden,
           "intermediate_size": a.intermediate, "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
           "num_key_value_heads": a.heads, "vocab_size": a.vocab, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "dtype": "bfloat16"}
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    (root / "tokenizer_config.json").write_text("{}")


def warm(root: Path) -> None:
    for p in sorted(root.iterdir()):
        with open(p, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


def evict(root: Path) -> None:
    """Drop SRC's pages from the page cache (clean pages only: call after os.sync), as for a checkpoint just
    downloaded or not read since boot: both contenders then read from the device."""
    for p in sorted(root.iterdir()):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def file_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.iterdir() if p.is_file())


def time_copy(src: Path, dst: Path) -> tuple[float, float]:
    """(seconds to copy, seconds to copy and fsync every file and the directory): lmbp-convert fsyncs DST before
    renaming it into place, so the durable copy is the like-for-like contender."""
    t0 = time.perf_counter()
    dst.mkdir()
    for p in sorted(src.iterdir()):
        shutil.copy(p, dst / p.name)
    t1 = time.perf_counter()
    for p in [*sorted(dst.iterdir()), dst]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return t1 - t0, time.perf_counter() - t0


# A tiny launcher measures the CLI's peak RSS: a child forked straight from this (large) process would start with
# this process's pages mapped, and ru_maxrss would report them (it is the high-water mark before exec, too).
_LAUNCHER = """
import os, subprocess, sys
p = subprocess.Popen(sys.argv[1:])
_, status, usage = os.wait4(p.pid, 0)
print("LAUNCHER", os.waitstatus_to_exitcode(status), usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024),
      usage.ru_utime + usage.ru_stime)
"""


def run_cli(args: list[str], repo: Path | None = None) -> tuple[float, int, int, float, str, str]:
    """(seconds, exit code, peak RSS in bytes, CPU seconds of all its threads, stdout, stderr) of ``python -m
    lmbp_convert ARGS`` in a child process, from this checkout or ``repo``. The CPU seconds hardly depend on what
    else the machine runs: on a shared machine they compare two checkouts where wall time cannot."""
    repo = repo or Path(C.ROOT)
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _LAUNCHER, sys.executable, "-m", "lmbp_convert", *args],
                          capture_output=True, text=True, env=env, cwd=repo)  # (-m imports from the cwd first)
    dt = time.perf_counter() - t0
    out, _, last = proc.stdout.rstrip().rpartition("\n")
    _, rc, rss, cpu = last.split()
    return dt, int(rc), int(rss), float(cpu), out, proc.stderr


def spot_check(src: Path, dst: Path) -> float:
    """Largest |DST - fold(SRC)| over a few rows of a folded weight (0.0: bit-identical)."""
    from lmbp_convert.fold import fold_affine

    idx = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    worst = 0.0
    for w, g in [("model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight"),
                 ("lm_head.weight", "model.norm.weight")]:
        with safe_open(src / idx[w], "pt") as f:
            rows = f.get_slice(w)[:64]
        with safe_open(src / idx[g], "pt") as f:
            gamma = f.get_tensor(g)
        with safe_open(dst / idx[w], "pt") as f:
            got = f.get_slice(w)[:64]
        with safe_open(dst / idx[g], "pt") as f:
            ident = f.get_tensor(g)
        want = fold_affine(rows, None, gamma.float(), None)[0]
        worst = max(worst, (got.float() - want.float()).abs().max().item(), (ident.float() - 1).abs().max().item())
    return worst


def machine() -> list[tuple[str, str]]:
    mem = C.ram_gib()
    return [("cpu", f"{C.cpu_name()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"),
            ("memory", f"{mem:.1f} GiB" if mem else "?"), ("os", platform.platform()),
            ("python / torch", f"{platform.python_version()} / {torch.__version__}")]


def main() -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="quick smoke run (~60 MB)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-mb", type=float, default=1024)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds (medians are reported)")
    ap.add_argument("--dir", default=None, help="work directory (default: a new one under $TMPDIR)")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout of lmbp-convert, timed in the "
                    "same rounds (e.g. the main branch: git worktree add /tmp/base main)")
    ap.add_argument("--cold", action="store_true", help="SRC not in the page cache: evicted before each timing "
                    "(default: read once before each timing, so it is cached)")
    a = ap.parse_args()
    if a.small:
        a.hidden, a.intermediate, a.layers, a.heads, a.vocab, a.shard_mb = 512, 1376, 4, 8, 4000, 16
    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="lmbp-bench-"))
    made_work = not work.exists() or not a.dir
    work.mkdir(parents=True, exist_ok=True)
    src, copy_dst, cli_dst = work / "src", work / "copy", work / "folded"
    if any(p.exists() for p in (src, copy_dst, cli_dst)):
        print(f"{work} already holds src/, copy/ or folded/; choose another --dir", file=sys.stderr)
        return 1
    try:
        t0 = time.perf_counter()
        make_checkpoint(src, a)
        gen_s = time.perf_counter() - t0
        total = file_bytes(src)
        largest = max(p.stat().st_size for p in src.glob("*.safetensors"))
        copies, synced, clis, rsss, plans, writes, bases, phases = [], [], [], [], [], [], [], []
        torches, base_fixed, err_max, cpus, base_cpus = [], [], 0.0, [], []
        for i in range(a.repeat):
            os.sync()  # both contenders start with no dirty pages to flush and SRC in the page cache (or evicted)
            evict(src) if a.cold else warm(src)
            c, cs = time_copy(src, copy_dst)
            copies.append(c)
            synced.append(cs)
            shutil.rmtree(copy_dst)
            # this checkout and the baseline take turns going first: each run leaves 3 GB of freed blocks and
            # writeback behind, which the next one may pay for
            order = ["cli", "base"] if a.baseline is None or i % 2 == 0 else ["base", "cli"]
            for who in order:
                if who == "base" and a.baseline is None:
                    continue
                if cli_dst.exists():  # the first contender's
                    shutil.rmtree(cli_dst)
                os.sync()
                evict(src) if a.cold else warm(src)
                dt, rc, rss, cpu, out, err = run_cli([str(src), str(cli_dst), "--no-progress"],
                                                a.baseline if who == "base" else None)
                if rc != 0:
                    print(f"{'baseline ' if who == 'base' else ''}lmbp-convert failed ({rc}): {err.strip()}",
                          file=sys.stderr)
                    return 1
                m = re.search(r"plan ([\d.]+) s, write ([\d.]+) s", out)
                if who == "base":
                    bases.append(dt)
                    base_cpus.append(cpu)
                    base_fixed.append(dt - float(m.group(2)))
                    continue
                clis.append(dt)
                rsss.append(rss)
                cpus.append(cpu)
                err_max = max(err_max, spot_check(src, cli_dst))
                plans.append(float(m.group(1)))
                writes.append(float(m.group(2)))
                m = re.search(r"torch import ([\d.]+) s", out)
                torches.append(float(m.group(1)) if m else 0.0)
                m = re.search(r"^plan: (.*)$", out, re.M)
                if m:
                    phases.append({k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) s", m.group(1))})
            # every round starts as the first did: a 3 GB DST left over slowed the next copy 10x on a 2-core VM
            shutil.rmtree(cli_dst)
        med = C.median
        copy_s, sync_s, cli_s, write_s, plan_s = med(copies), med(synced), med(clis), med(writes), med(plans)
        phase_s = {k: med([p[k] for p in phases if k in p]) for k in (phases[0] if phases else {})}
        gib = 2**30
        rows = machine() + [
            ("checkpoint", f"{total / gib:.2f} GiB bf16 in {len(list(src.glob('*.safetensors')))} shards "
                           f"(largest {largest / gib:.2f} GiB); hidden {a.hidden}, intermediate {a.intermediate}, "
                           f"{a.layers} layers, vocab {a.vocab}; generated in {gen_s:.1f} s"),
            ("file system", f"{work} ({shutil.disk_usage(work).free / gib:.0f} GiB free); SRC "
                            f"{'evicted from (cold)' if a.cold else 'in (warm)'} the page cache before each timing"),
            ("plain copy (shutil.copy)", f"{copy_s:.2f} s  {total / copy_s / gib:.2f} GiB/s  (runs: "
                                         f"{', '.join(f'{c:.2f}' for c in copies)})"),
            ("plain copy + fsync (durable)", f"{sync_s:.2f} s  {total / sync_s / gib:.2f} GiB/s  (runs: "
                                             f"{', '.join(f'{c:.2f}' for c in synced)})"),
            ("lmbp-convert end to end", f"{cli_s:.2f} s  {total / cli_s / gib:.2f} GiB/s  (runs: "
                                        f"{', '.join(f'{c:.2f}' for c in clis)})"),
            ("  fixed cost (all but the write)", f"{med([c - w for c, w in zip(clis, writes)]):.2f} s"),
            ("  CPU time (user + sys, all threads)", f"{med(cpus):.2f} s  (runs: {', '.join(f'{c:.2f}' for c in cpus)})"
                                                     + (f"; baseline {med(base_cpus):.2f} s (runs: "
                                                        f"{', '.join(f'{c:.2f}' for c in base_cpus)}), this checkout / "
                                                        f"baseline {med(cpus) / med(base_cpus):.2f}x"
                                                        if base_cpus else "")),
            ("  Python start, path checks, exit", f"{med([c - t - p - w for c, t, p, w in zip(clis, torches, plans, writes)]):.2f} s"),
            ("  torch import", f"{med(torches):.2f} s  (runs: {', '.join(f'{c:.2f}' for c in torches)})"),
            ("  plan (transformers import, meta model, trace)", f"{plan_s:.2f} s  (runs: "
                                                               f"{', '.join(f'{c:.2f}' for c in plans)})"),
            *([("    of which", ", ".join(f"{k} {v:.2f} s" for k, v in phase_s.items()))] if phase_s else []),
            ("  streaming write (+ fsync)", f"{write_s:.2f} s  {total / write_s / gib:.2f} GiB/s  (runs: "
                                  f"{', '.join(f'{c:.2f}' for c in writes)})"),
            ("throughput vs copy", f"{copy_s / write_s:.2f}x streaming, {copy_s / cli_s:.2f}x end to end "
                                   f"(aim >= 0.5x; per round: {', '.join(f'{c / t:.2f}' for c, t in zip(copies, clis))}); "
                                   f"{sync_s / cli_s:.2f}x end to end vs the durable copy"),
            *([("baseline end to end", f"{med(bases):.2f} s  ({a.baseline}; runs: "
                                        f"{', '.join(f'{c:.2f}' for c in bases)}); this checkout / baseline: "
                                        f"{cli_s / med(bases):.2f}x the time; copy / baseline end to end "
                                        f"{copy_s / med(bases):.2f}x; baseline fixed cost (all but the write) "
                                        f"{med(base_fixed):.2f} s")] if bases else []),
            ("lmbp-convert peak RSS", f"{max(rsss) / 2**20:.0f} MiB = largest shard "
                                      f"{'+' if max(rsss) >= largest else '-'} "
                                      f"{abs(max(rsss) - largest) / 2**20:.0f} MiB (aim <= largest shard + 512 MiB)"),
            ("spot check", f"max |DST - fold(SRC)| = {err_max:g} (0 means bit-identical)"),
        ]
        width = max(len(k) for k, _ in rows)
        print("lmbp-convert checkpoint benchmark")
        for k, v in rows:
            print(f"  {k:<{width}}  {v}")
        return 0
    finally:
        if not a.keep:  # only what this run created
            for p in (src, copy_dst, cli_dst):
                shutil.rmtree(p, ignore_errors=True)
            if made_work:
                shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
