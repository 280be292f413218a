"""Saved-for-backward bytes per transformer block, converted next to the alternatives, and how they grow.

    python -m benchmarks.memory                      # full shapes, CPU, ~10 min on 2 cores
    python -m benchmarks.memory --tiny --no-compile  # smoke run, seconds
    python -m benchmarks.memory --json build/bench/memory.json --plot docs

Blocks (shapes in common.py): a LLaMA-7B decoder block (seq 512), a ViT-B/16 block at 224 px
(197 tokens), a BERT-base encoder block (seq 512), batch 1, each in bf16 weights and in bf16 autocast with
fp32 weights. For each, the bytes one block keeps between forward and backward (exact: SavedTensorLedger,
unique storages, parameters and autocast weight copies excluded; per block = L blocks minus L - 1), for:

    original                 the model as built (SDPA attention: on CPU and GPU its flash kernel, which
                             keeps q, k, v, out and the log-sum-exp, no seq x seq matrix)
    converted                convert(model): approx-BP GELU/SiLU, MS norms, MS gated MLP
    converted, paper ops     convert(model, gated_mlp=False): only the paper's two rewrites (LLaMA)
    checkpointing            per-block activation checkpointing of the original (non-reentrant)
    torch.compile            each block compiled (inductor); the min-cut partitioner picks what to save
    converted + compile      the converted model, each block compiled
    eager attention          HF models with attn_implementation="eager" (keeps the fp32 softmax matrix)
    Liger-Kernel             Triton/CUDA only: measured by ``python -m benchmarks.speed --gpu`` on a CUDA machine

Do compiled graphs show their saved tensors to the ledger? Yes: AOTAutograd's compiled function saves its
activations with ``ctx.save_for_backward``, which ``saved_tensors_hooks`` see (the ledger also skips the
bf16 weight copies a compiled autocast graph saves). ``python -m benchmarks.speed --gpu`` cross-checks the ledger
against ``torch.cuda.memory_allocated`` for eager and compiled models.

Scaling: per-block bytes of original and converted against sequence length (LLaMA-7B block, BERT-base block,
the latter also with eager attention) and batch (LLaMA-7B block, ViT-B/16 block), bf16 weights.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from typing import Optional

import torch

from benchmarks import common as C

V_ORIG = "original"
V_CONV = "converted"
V_PAPER = "converted, paper ops"
V_CKPT = "checkpointing"
V_COMPILE = "torch.compile"
V_CONV_COMPILE = "converted + compile"
V_EAGER = "original, eager attn"
V_EAGER_CONV = "converted, eager attn"
V_LIGER = "Liger-Kernel"
VARIANTS = (V_ORIG, V_CONV, V_PAPER, V_CKPT, V_COMPILE, V_CONV_COMPILE, V_EAGER, V_EAGER_CONV, V_LIGER)
LIGER_CPU_NOTE = "not run: Liger-Kernel is Triton/CUDA-only (see the GPU table)"

SEQS_FULL = {"llama": (128, 256, 512, 1024, 2048), "bert": (128, 256, 512, 1024)}
BATCHES_FULL = {"llama": (1, 2, 4, 8), "vit": (1, 2, 4, 8, 16)}
SEQS_TINY = {"llama": (16, 32, 64), "bert": (16, 32, 64)}
BATCHES_TINY = {"llama": (1, 2, 4), "vit": (1, 2, 4)}
#: Sequence length of the LLaMA batch sweep at full shapes (keeps it to about half a minute on 2 cores).
BATCH_SWEEP_SEQ = 256


def _compiled_bytes(fam, model, x, autocast: bool) -> tuple[int, dict]:
    """Per-block bytes of ``model`` with each block compiled; compilation happens outside the ledger."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    dynamo.reset()  # every Module._call_impl shares one code object: keep the recompile limit far away
    counters.clear()
    C.compile_blocks(model)
    t0 = time.perf_counter()
    C.warm_up(fam, model, x, autocast, backward=False)
    info = {"compile_s": round(time.perf_counter() - t0, 1),
            "graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values()))}
    if info["graphs"] == 0:
        raise RuntimeError("torch.compile produced no graph (it fell back to eager)")
    return C.per_block_bytes(fam, model, x, autocast), info


def _norm_count(plan) -> int:
    """Norms the plan rewrites, whatever the rewrite (exact, folded, kept affine, affine-free)."""
    from lmbp_convert.match.plan import AffineNormItem, NormSwap

    return sum(isinstance(it, (AffineNormItem, NormSwap)) for it in plan.items)


def measure_blocks(fam: C.Family, mode: str, device: str = "cpu", compile_: bool = True,
                   log=print) -> list[dict]:
    """One row per variant: per-block saved bytes of ``fam`` in ``mode``."""
    from lmbp_convert import convert

    dtype, ac = C.mode_dtype(mode), mode == "autocast"
    x = C.make_input(fam, dtype, device)
    rows: list[dict] = []

    def add(variant: str, fn) -> None:
        t0 = time.perf_counter()
        row = {"family": fam.name, "label": fam.label, "mode": mode, "variant": variant, "bytes": None}
        try:
            out = fn()
            row["bytes"], extra = out if isinstance(out, tuple) else (out, {})
            row.update(extra)
        except Exception as e:  # a failing variant is reported, the others still run
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        b = row["bytes"]
        log(f"  {fam.label:<10} {mode:<8} {variant:<24} "
            + (f"{b / C.MiB:9.2f} MiB" if b is not None else row.get("error", row.get("note", ""))))

    # At most two models alive at a time (a 2-block LLaMA-7B in fp32 is 1.6 GB; the machine is shared).
    base = C.build(fam, dtype, device)
    add(V_ORIG, lambda: C.per_block_bytes(fam, base, x, ac))

    def ckpt():
        C.set_checkpointing(base, True)
        try:
            return C.per_block_bytes(fam, base, x, ac)
        finally:
            C.set_checkpointing(base, False)

    add(V_CKPT, ckpt)
    conv = {}

    def converted():
        m = convert(copy.deepcopy(base))
        rep = m.lmbp_report
        conv["m"] = m
        p = rep.plan
        return C.per_block_bytes(fam, m, x, ac), {
            "converted": f"{len(p.act_swaps)} act, {_norm_count(p)} norm, {len(p.gated_mlps)} gated MLP"}

    add(V_CONV, converted)
    if compile_ and "m" in conv:
        add(V_CONV_COMPILE, lambda: _compiled_bytes(fam, conv["m"], x, ac))
    conv.clear()
    C.free(reset_dynamo=True)
    if fam.name == "llama":
        def paper():
            m = convert(copy.deepcopy(base), gated_mlp=False)
            return C.per_block_bytes(fam, m, x, ac)

        add(V_PAPER, paper)
        C.free(reset_dynamo=True)
    if compile_:
        add(V_COMPILE, lambda: _compiled_bytes(fam, base, x, ac))
    base = None  # free it before the eager-attention models are built
    C.free(reset_dynamo=True)
    if fam.hf:
        eager = {}

        def eager_orig():
            eager["m"] = C.build(fam, dtype, device, attn="eager")
            return C.per_block_bytes(fam, eager["m"], x, ac)

        def eager_conv():
            return C.per_block_bytes(fam, convert(eager.pop("m")), x, ac)

        add(V_EAGER, eager_orig)
        add(V_EAGER_CONV, eager_conv)
        eager.clear()
        C.free(reset_dynamo=True)
    if device == "cpu":
        rows.append({"family": fam.name, "label": fam.label, "mode": mode, "variant": V_LIGER, "bytes": None,
                     "note": LIGER_CPU_NOTE})
    order = {v: i for i, v in enumerate(VARIANTS)}
    rows.sort(key=lambda r: order[r["variant"]])
    return rows


def measure_scaling(tiny: bool, device: str = "cpu", log=print) -> list[dict]:
    """Per-block bytes (bf16 weights) of original and converted against sequence length and batch."""
    from lmbp_convert import convert

    seqs, batches = (SEQS_TINY, BATCHES_TINY) if tiny else (SEQS_FULL, BATCHES_FULL)
    rows = []
    for name in ("llama", "bert", "vit"):
        fam0 = C.families(tiny, [name])[0]
        sweeps = [("seq", s) for s in seqs.get(name, ())] + [("batch", b) for b in batches.get(name, ())]
        if not sweeps:
            continue
        attns = ("sdpa", "eager") if name == "bert" else ("sdpa",)
        for attn in attns:
            longest = max([s for a, s in sweeps if a == "seq"] + [fam0.seq])
            orig = C.build(fam0.with_(seq=longest), torch.bfloat16, device, attn=attn)
            conv = convert(copy.deepcopy(orig))
            for axis, v in sweeps:
                if attn == "eager" and axis == "batch":
                    continue
                if axis == "seq":
                    fam = fam0.with_(seq=v)
                else:
                    fam = fam0.with_(batch=v, seq=fam0.seq if tiny else min(fam0.seq, BATCH_SWEEP_SEQ))
                x = C.make_input(fam, torch.bfloat16, device)
                b0 = C.per_block_bytes(fam, orig, x, False)
                b1 = C.per_block_bytes(fam, conv, x, False)
                rows.append({"family": name, "label": fam0.label, "attn": attn, "axis": axis, "value": v,
                             "seq": fam.tokens, "batch": fam.batch, "original": b0, "converted": b1})
                log(f"  scaling {fam0.label:<10} {attn:<5} {axis}={v:<5} {b0 / C.MiB:9.2f} → {b1 / C.MiB:9.2f} MiB"
                    f"  ({C.pct(b1, b0)})")
            del orig, conv
            C.free(reset_dynamo=True)
    return rows


# ------------------------------------------------------------------------------------------- report
def by_key(rows: list[dict]) -> dict:
    return {(r["family"], r["mode"], r["variant"]): r for r in rows}


def cell(r: Optional[dict], ref: Optional[int]) -> str:
    if r is None:
        return "—"
    if r.get("bytes") is None:
        return "n/a" if "note" in r else "failed"
    return f"{C.mib(r['bytes'])} ({C.pct(r['bytes'], ref)})" if ref else C.mib(r["bytes"])


def liger_cells(gpu: Optional[dict]) -> dict:
    """(family, mode) -> Liger-Kernel's per-block change against the original, from a GPU run's results."""
    if not gpu:
        return {}
    cells, rows = {}, []
    rows += [dict(r, family="llama") for r in gpu.get("llama_slice", {}).get("rows", [])]
    rows += gpu.get("blocks", {}).get("rows", [])
    ref = {(r["family"], r["mode"]): r.get("block_bytes") for r in rows if r.get("variant") == V_ORIG}
    for r in rows:
        if r.get("variant") == V_LIGER and r.get("block_bytes") and ref.get((r["family"], r["mode"])):
            cells[(r["family"], r["mode"])] = f"{C.pct(r['block_bytes'], ref[(r['family'], r['mode'])])} (GPU)"
    return cells


def summary_table(data: dict, gpu: Optional[dict] = None) -> str:
    """Compact table: one row per block and dtype mode (Liger-Kernel from the GPU run when there is one)."""
    liger = liger_cells(gpu)
    k = by_key(data["blocks"])
    fams = {f["name"]: f for f in data["families"]}
    header = ("block", "dtype", "original MiB", "converted MiB", "reduction", "paper (analytic)",
              "torch.compile", "converted + compile", "checkpointing", "Liger-Kernel")
    rows = []
    for name, f in fams.items():
        for mode in data["modes"]:
            o = k.get((name, mode, V_ORIG))
            ref = o["bytes"] if o else None
            c = k.get((name, mode, V_CONV))
            paper = f"−{C.PAPER_REDUCTION[name]:.2f} %" if name in C.PAPER_REDUCTION else "—"
            if name == "llama" and (name, mode, V_PAPER) in k and k[(name, mode, V_PAPER)].get("bytes"):
                paper += f" (ours, paper ops only: {C.pct(k[(name, mode, V_PAPER)]['bytes'], ref)})"
            rows.append((f["label"], C.MODE_LABEL[mode], C.mib(ref), C.mib(c["bytes"]) if c else "—",
                         f"**{C.pct(c['bytes'], ref)}**" if c and c.get("bytes") else "—", paper,
                         cell(k.get((name, mode, V_COMPILE)), ref), cell(k.get((name, mode, V_CONV_COMPILE)), ref),
                         cell(k.get((name, mode, V_CKPT)), ref),
                         liger.get((name, mode)) or cell(k.get((name, mode, V_LIGER)), ref)))
    return C.markdown_table(header, rows)


def full_table(data: dict) -> str:
    rows = []
    k = by_key(data["blocks"])
    for r in data["blocks"]:
        eager = r["variant"] == V_EAGER_CONV  # compared with the original that also uses eager attention
        ref = k.get((r["family"], r["mode"], V_EAGER if eager else V_ORIG), {}).get("bytes")
        cmp_ = None if r["variant"] in (V_EAGER, V_EAGER_CONV) else k.get((r["family"], r["mode"], V_COMPILE), {}).get("bytes")
        note = r.get("error") or r.get("note") or r.get("converted") or ""
        if "compile_s" in r:
            note = f"compiled in {r['compile_s']} s, {r['graphs']} graph(s), {r['graph_breaks']} break(s)"
        rows.append((r["label"], C.MODE_LABEL[r["mode"]], r["variant"], C.mib(r.get("bytes")),
                     C.pct(r.get("bytes"), ref), C.pct(r.get("bytes"), cmp_), note))
    return C.markdown_table(("block", "dtype", "variant", "MiB per block", "vs original (eager attn: vs original, "
                             "eager attn)", "vs torch.compile", "notes"), rows)


def scaling_table(data: dict) -> str:
    rows = [(r["label"], r["attn"], r["seq"], r["batch"], C.mib(r["original"]), C.mib(r["converted"]),
             C.pct(r["converted"], r["original"])) for r in data.get("scaling", [])]
    return C.markdown_table(("block (bf16)", "attention", "tokens", "batch", "original MiB", "converted MiB",
                             "change"), rows)


def plot_blocks(data: dict, path: str) -> None:
    plt = C.plt()
    k = by_key(data["blocks"])
    fams = data["families"]
    show = [V_ORIG, V_CONV, V_COMPILE, V_CONV_COMPILE, V_CKPT]
    colors = {V_ORIG: "#888888", V_CONV: "#1f77b4", V_COMPILE: "#ff7f0e", V_CONV_COMPILE: "#2ca02c",
              V_CKPT: "#d62728"}
    fig, axes = plt.subplots(1, len(fams), figsize=(5.2 * len(fams), 4.9), squeeze=False)
    for ax, f in zip(axes[0], fams):
        modes = data["modes"]
        width = 0.8 / len(show)
        for i, v in enumerate(show):
            vals = [(k.get((f["name"], m, v)) or {}).get("bytes") for m in modes]
            xs = [j + (i - (len(show) - 1) / 2) * width for j in range(len(modes))]
            bars = ax.bar(xs, [(b or 0) / C.MiB for b in vals], width, label=v, color=colors[v])
            for j, (bar, b) in enumerate(zip(bars, vals)):
                ref = (k.get((f["name"], modes[j], V_ORIG)) or {}).get("bytes")
                if b is None:
                    ax.text(bar.get_x() + width / 2, 0, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
                elif v != V_ORIG and ref:
                    ax.text(bar.get_x() + width / 2, b / C.MiB, f"{100 * (b / ref - 1):+.0f}%", ha="center",
                            va="bottom", fontsize=7, rotation=90)
        ax.set_xticks(range(len(modes)))
        ax.set_xticklabels([C.MODE_LABEL[m].replace(", ", ",\n") for m in modes], fontsize=8)
        ax.set_ylabel("saved for backward, MiB per block")
        ax.set_title(f"{f['label']} block\n{f['describe']}", fontsize=9)
        ax.margins(y=0.22)
        if f["name"] in C.PAPER_REDUCTION:
            ax.text(0.02, 0.97, f"paper (analytic): −{C.PAPER_REDUCTION[f['name']]:.2f} %", transform=ax.transAxes,
                    fontsize=8, va="top")
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"Activation memory per block, exact saved-for-backward bytes (SavedTensorLedger)\n"
                 f"{data['machine']}", fontsize=9)
    C.save_figure(fig, path)


def plot_scaling(data: dict, path: str) -> None:
    plt = C.plt()
    from matplotlib.ticker import FuncFormatter

    rows = data.get("scaling", [])
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.8))
    color = {"llama": "#2ca02c", "bert": "#ff7f0e", "vit": "#1f77b4"}
    series: dict = {}
    for r in rows:
        series.setdefault((r["axis"], r["family"], r["label"], r["attn"]), []).append(r)
    for (axis, fam, label, attn), rs in sorted(series.items()):
        col = 0 if axis == "seq" else 1
        xs = [r["seq"] if axis == "seq" else r["batch"] for r in rs]
        name = label + (" (eager attention)" if attn == "eager" else "")
        ls = "--" if attn == "eager" else "-"
        axes[0][col].plot(xs, [r["original"] / C.MiB for r in rs], ls, marker="o", color=color[fam],
                          label=f"{name} original")
        axes[0][col].plot(xs, [r["converted"] / C.MiB for r in rs], ls, marker="s", color=color[fam], alpha=0.5,
                          label=f"{name} converted")
        axes[1][col].plot(xs, [100 * (1 - r["converted"] / r["original"]) for r in rs], ls, marker="o",
                          color=color[fam], label=name)
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for col in (0, 1):
        for row in (0, 1):
            axes[row][col].set_xscale("log", base=2)
            axes[row][col].xaxis.set_major_formatter(plain)
            axes[row][col].grid(alpha=0.3)
        axes[0][col].set_yscale("log", base=2)
        axes[0][col].yaxis.set_major_formatter(plain)
        axes[0][col].set_ylabel("MiB per block")
        axes[1][col].set_ylabel("reduction, % (converted vs original)")
        axes[1][col].set_ylim(0, 100)
        axes[0][col].legend(fontsize=7)
        axes[1][col].legend(fontsize=7, loc="lower right")
    fams = {f["name"]: f for f in data["families"]}
    axes[1][0].set_xlabel("sequence length (tokens), batch 1")
    axes[1][1].set_xlabel(f"batch (LLaMA at seq {data.get('scaling_batch_seq', '?')}, "
                          f"ViT at {fams.get('vit', {}).get('tokens', '?')} tokens)")
    axes[0][0].set_title("bytes vs sequence length", fontsize=9)
    axes[0][1].set_title("bytes vs batch", fontsize=9)
    shapes = "; ".join(f"{f['label']}: {f['describe'].rsplit(', ', 2)[0]}" for f in data["families"])
    fig.suptitle(f"Per-block saved-for-backward bytes as the input grows, bf16 weights\n{shapes}\n"
                 f"{data['machine']}", fontsize=8)
    C.save_figure(fig, path)


def render(data: dict, outdir: str) -> list[str]:
    os.makedirs(outdir, exist_ok=True)
    paths = [os.path.join(outdir, "bench_memory.png")]
    plot_blocks(data, paths[0])
    if data.get("scaling"):
        paths.append(os.path.join(outdir, "bench_scaling.png"))
        plot_scaling(data, paths[1])
    return paths


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (smoke run)")
    ap.add_argument("--families", default="llama,vit,bert")
    ap.add_argument("--modes", default="bf16,autocast")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows (slow on CPU)")
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--plot", default=None, help="write the PNG charts into this folder")
    a = ap.parse_args(argv)
    a.family_list = [s.strip() for s in a.families.split(",") if s.strip()]
    a.mode_list = [s.strip() for s in a.modes.split(",") if s.strip()]
    if not set(a.family_list) <= set(C.FULL) or not a.family_list:
        ap.error(f"--families: choose from {list(C.FULL)}")
    if not set(a.mode_list) <= set(C.MODES) or not a.mode_list:
        ap.error(f"--modes: choose from {list(C.MODES)}")
    return a


def run(args: argparse.Namespace, log=print) -> dict:
    t0 = time.perf_counter()
    torch.manual_seed(0)
    fams = C.families(args.tiny, args.family_list)
    data = {"kind": "memory", "machine": C.machine("cpu"), "device": "cpu", "tiny": args.tiny,
            "modes": args.mode_list, "families": [C.as_dict(f) for f in fams], "blocks": [], "scaling": [],
            "scaling_batch_seq": C.TINY["llama"].seq if args.tiny else min(C.FULL["llama"].seq, BATCH_SWEEP_SEQ)}
    log(f"# per-block saved bytes on {data['machine']}")
    for fam in fams:
        for mode in args.mode_list:
            data["blocks"] += measure_blocks(fam, mode, "cpu", compile_=not args.no_compile, log=log)
            C.save_json(args.json, data)
    if not args.no_scaling:
        data["scaling"] = measure_scaling(args.tiny, "cpu", log=log)
    return C.finish(data, t0, args.json)


def main(argv=None) -> int:
    args = parse_args(argv)
    data = run(args)
    print("\n" + summary_table(data) + "\n\n" + full_table(data))
    if data["scaling"]:
        print("\n" + scaling_table(data))
    return C.print_end(data, render, args.plot)


if __name__ == "__main__":
    sys.exit(main())
