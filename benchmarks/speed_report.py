"""`benchmarks.speed`'s tables and charts, and the variant names its rows carry (markdown and PNGs from the JSON).
"""
from __future__ import annotations

import os
from typing import Optional

from benchmarks import common as C

#: The variant names the rows carry (JSON and tables).
V_ORIG, V_CONV, V_CKPT, V_LIGER = "original", "converted", "checkpointing", "Liger-Kernel"
V_COMPILE, V_CONV_COMPILE = "torch.compile", "converted + compile"


def cpu_table(data: dict) -> str:
    rows = []
    by = {}
    for r in data.get("steps", []):
        by.setdefault((r["label"], r["mode"], r["shape"]), {})[r["variant"]] = r
    for (label, mode, shape), vs in by.items():
        o, c, k = vs.get(V_ORIG), vs.get(V_CONV), vs.get(V_CKPT)
        rows.append((label, shape, C.MODE_LABEL[mode], f"{o['median_s']:.3f}", f"{c['median_s']:.3f}",
                     f"**{c['ratio']:.2f}×**" + _quartiles(c), f"{k['median_s']:.3f}", f"{k['ratio']:.2f}×"))
    return C.markdown_table(("model (2 blocks)", "shape", "dtype", "original s/step", "converted s/step",
                             "converted / original", "checkpointing s/step", "checkpointing / original"), rows)


def _quartiles(row: dict) -> str:
    """The spread of the per-round ratios (JSON written before they were kept has none)."""
    return f" ({row['ratio_q1']:.2f}–{row['ratio_q3']:.2f})" if "ratio_q1" in row else ""


def convert_table(data: dict) -> str:
    rows = [(f"{r['params'] / 1e9:.2f} B", f"hidden {r['hidden']}, intermediate {r['intermediate']}, "
             f"{r['layers']} layers, vocab {r['vocab']}", f"{r['plan_s']:.2f}", f"{r['convert_s']:.2f}",
             r["verified"]) for r in data.get("convert", [])]
    return C.markdown_table(("params", "LLaMA shape (fp32)", "trace + plan s", "convert() s", "verified"), rows)


def _f(v, fmt="{:.0f}", scale=1.0) -> str:
    return "—" if v is None else fmt.format(v / scale)


def _pct(v: Optional[float]) -> str:
    return "—" if v is None else f"{100 * v:.0f} %"


def gpu_tables(g: dict) -> str:
    parts = [f"Machine: {g.get('machine')}."]
    v = g.get("vit_lora", {})
    if v.get("rows"):
        rows = []
        paper = C.PAPER_VIT_LORA
        ref = {r.get("compile"): r for r in v["rows"] if not r.get("converted") and "img_s" in r}
        for r in v["rows"]:
            err = r.get("error") or r.get("skipped")
            i = {V_ORIG: 0, V_CONV: 1}.get(r["variant"])
            p_mem, p_img = ("", "") if i is None else (paper["mem_mib"][i], paper["img_s"][i])
            name = r["variant"] + (f" ({r['graphs']} graphs, {r['graph_breaks']} breaks"
                                   + (f", {r['cudagraph_skips']} CUDA-graph skips" if "cudagraph_skips" in r else "")
                                   + ")" if "graphs" in r else "")
            o = ref.get(r.get("compile"), {})
            vs = (f"{r['img_s'] / o['img_s']:.2f}×" if not err and o.get("img_s") and r.get("converted") else "")
            rows.append((name, err or _f(r.get("peak"), scale=C.MiB),
                         "" if err else _f(r.get("peak_over_static"), scale=C.MiB),
                         "" if err else _f(r.get("img_s"), "{:.0f}"), vs,
                         "" if err else _pct(r.get("gpu_busy")),
                         "" if err else _f(r.get("saved_bytes"), "{:.1f}", C.MiB), p_mem, p_img))
        parts.append(f"**ViT-B/16 LoRA** ({v['shape']})\n\n" + C.markdown_table(
            ("variant", "peak allocated MiB", "peak over weights + optimizer MiB", "img/s",
             "converted / original (same compile mode)", "GPU busy", "saved for backward MiB",
             "paper peak MiB", "paper img/s"), rows))
    s = g.get("llama_slice", {})
    if s.get("rows"):
        rows = []
        ref = {r["mode"]: r for r in s["rows"] if r["variant"] == V_ORIG and "block_bytes" in r}
        for r in s["rows"]:
            err = r.get("error") or r.get("skipped")
            o = ref.get(r["mode"], {})
            if err:
                rows.append((C.MODE_LABEL[r["mode"]], r["variant"], f"not measured: {err}") + ("",) * 7)
                continue
            xc = (f"{r['ledger_bytes'] / C.MiB:.1f} / {r['alloc_delta_bytes'] / C.MiB:.1f}"
                  if "ledger_bytes" in r else "—")
            name = r["variant"] + (f" ({r['graphs']} graphs, {r['graph_breaks']} breaks)" if "graphs" in r else "")
            rows.append((C.MODE_LABEL[r["mode"]], name, _f(r["block_bytes"], "{:.1f}", C.MiB),
                         C.pct(r["block_bytes"], o.get("block_bytes")), _f(r.get("peak"), scale=C.MiB),
                         _f(r.get("peak_over_static"), scale=C.MiB), _f(r.get("tokens_s")),
                         f"{r['tokens_s'] / o['tokens_s']:.2f}×" if o.get("tokens_s") else "—",
                         _pct(r.get("gpu_busy")), xc))
        parts.append(f"**LLaMA-7B-shaped slice** ({s['shape']})\n\n" + C.markdown_table(
            ("dtype", "variant", "MiB per block", "vs original", "peak MiB", "peak over weights MiB",
             "tokens/s", "tokens/s vs original eager", "GPU busy", "ledger / allocator MiB (whole forward)"), rows))
    b = g.get("blocks", {})
    if b.get("rows"):
        rows = []
        ref = {(r["family"], r["mode"]): r.get("block_bytes") for r in b["rows"] if r["variant"] == V_ORIG}
        for r in b["rows"]:
            err = r.get("error") or r.get("skipped")
            rows.append((r["label"], C.MODE_LABEL[r["mode"]], r["variant"],
                         err or _f(r.get("block_bytes"), "{:.2f}", C.MiB),
                         "" if err else C.pct(r.get("block_bytes"), ref.get((r["family"], r["mode"])))))
        shapes = "; ".join(dict.fromkeys(f"{r['label']}: {r['shape']}" for r in b["rows"]))
        parts.append(f"**Per-block bytes on the GPU** ({shapes})\n\n" + C.markdown_table(
            ("block", "dtype", "variant", "MiB per block", "vs original"), rows))
    for name in ("vit_lora", "llama_slice", "blocks"):
        if g.get(name, {}).get("errors"):
            parts.append(f"{name}: phases that failed as a whole: " + "; ".join(map(str, g[name]["errors"])))
    q = g.get("qlora")
    if q and q.get("rows"):
        from benchmarks import qlora as bench_qlora

        parts.append(bench_qlora.table(q))
    k = g.get("kernels", {})
    if k.get("table"):
        parts.append("**Per-kernel bandwidth** (`python -m benchmarks.kernels`, bf16, 64M elements)\n\n" + k["table"])
    elif k:
        parts.append(f"Per-kernel bandwidth: not measured ({k.get('skipped') or k.get('error')}).")
    return "\n\n".join(parts)


def plot_cpu(data: dict, path: str) -> None:
    plt = C.plt()
    by = {}
    for r in data.get("steps", []):
        by.setdefault((r["label"], r["mode"]), {})[r["variant"]] = r
    keys = list(by)
    fig, ax = plt.subplots(figsize=(10, 5.4))
    width = 0.27
    colors = {V_ORIG: "#888888", V_CONV: "#1f77b4", V_CKPT: "#d62728"}
    for i, v in enumerate((V_ORIG, V_CONV, V_CKPT)):
        xs = [j + (i - 1) * width for j in range(len(keys))]
        vals = [by[k][v]["ratio"] for k in keys]
        bars = ax.bar(xs, vals, width, label=v, color=colors[v])
        for bar, k in zip(bars, keys):
            ax.text(bar.get_x() + width / 2, bar.get_height(), f"{by[k][v]['median_s']:.2f}s", ha="center",
                    va="bottom", fontsize=7, rotation=90)
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_xticks(range(len(keys)))
    shapes = {r["label"]: r["shape"] for r in data.get("steps", [])}
    ax.set_xticklabels([f"{lab}\n{C.MODE_LABEL[m].replace(', ', chr(10))}" for lab, m in keys], fontsize=7)
    ax.set_ylabel("step time / original (fwd + bwd)")
    ax.margins(y=0.2)
    ax.legend(fontsize=8)
    sh = "\n".join(f"{k}: {v}" for k, v in shapes.items())
    ax.set_title(f"CPU step time, median of {data.get('repeats')} runs (ViT, BERT: "
                 f"{3 * data.get('repeats', 0)}) after {data.get('warmup')} warm-up (2 blocks; labels: s/step)\n{sh}\n{data['machine']}", fontsize=7)
    C.save_figure(fig, path)


def plot_convert(data: dict, path: str) -> None:
    plt = C.plt()
    rows = data.get("convert", [])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ps = [r["params"] / 1e9 for r in rows]
    ax.plot(ps, [r["convert_s"] for r in rows], "o-", label="convert() total (trace, plan, rewrite, verify)")
    ax.plot(ps, [r["plan_s"] for r in rows], "s--", label="trace + plan alone")
    for r in rows:
        ax.annotate(f"{r['convert_s']:.1f} s", (r["params"] / 1e9, r["convert_s"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=7)
    ax.set_xlabel("parameters, billions (LLaMA-shaped causal LM, fp32, random weights)")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(f"convert() time vs model size\n{data['machine']}", fontsize=8)
    C.save_figure(fig, path)


def plot_gpu(g: dict, path: str) -> bool:
    v = [r for r in g.get("vit_lora", {}).get("rows", []) if "img_s" in r and "peak" in r
         and r["variant"] in (V_ORIG, V_CONV)]
    s = [r for r in g.get("llama_slice", {}).get("rows", []) if "tokens_s" in r and "peak" in r
         and r["mode"] == "bf16"]
    if not v and not s:
        return False
    plt = C.plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.0))
    if v:
        ax = axes[0]
        labels = [r["variant"] for r in v]
        ax.bar([0, 1][:len(v)], [r["peak"] / C.MiB for r in v], 0.35, label="ours: peak MiB", color="#1f77b4")
        ax.bar([0.36, 1.36][:len(v)], list(C.PAPER_VIT_LORA["mem_mib"])[:len(v)], 0.35, label="paper (its GPU): peak MiB",
               color="#aec7e8")
        for i, r in enumerate(v):
            ax.text(i, r["peak"] / C.MiB, f"{r['img_s']:.0f} img/s", ha="center", va="bottom", fontsize=8)
            ax.text(i + 0.36, C.PAPER_VIT_LORA["mem_mib"][i], f"{C.PAPER_VIT_LORA['img_s'][i]} img/s",
                    ha="center", va="bottom", fontsize=8)
        ax.set_xticks([0.18, 1.18][:len(v)])
        ax.set_xticklabels(labels)
        ax.set_ylabel("torch.cuda.max_memory_allocated, MiB")
        ax.margins(y=0.15)
        ax.legend(fontsize=8, loc="lower right")
        ax.set_title("ViT-B/16 LoRA r4, batch 64, bf16 autocast", fontsize=9)
    if s:
        ax = axes[1]
        xs = list(range(len(s)))
        ax.bar([i - 0.2 for i in xs], [r.get("ledger_bytes", 0) / C.MiB for r in s], 0.4, color="#2ca02c",
               label="held for backward after the forward (ledger)")
        ax.bar([i + 0.2 for i in xs], [r["peak_over_static"] / C.MiB for r in s], 0.4, color="#98df8a",
               label="step peak over weights (full gradients incl.)")
        for i, r in enumerate(s):
            ax.text(i, max(r.get("ledger_bytes", 0), r["peak_over_static"]) / C.MiB, f"{r['tokens_s'] / 1000:.0f}k tok/s",
                    ha="center", va="bottom", fontsize=7)
        ax.set_xticks(xs)
        ax.set_xticklabels([r["variant"].replace(" + ", "\n+ ") for r in s], fontsize=7)
        ax.set_ylabel("MiB")
        ax.margins(y=0.12)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
        ax.set_title(f"LLaMA-7B-shaped slice, bf16 weights\n{g['llama_slice']['shape']}", fontsize=9)
    fig.suptitle(g["machine"], fontsize=9)
    C.save_figure(fig, path)
    return True


def render(data: dict, outdir: str) -> list[str]:
    os.makedirs(outdir, exist_ok=True)
    paths = []
    if data.get("steps"):
        paths.append(os.path.join(outdir, "bench_speed.png"))
        plot_cpu(data, paths[-1])
    if data.get("convert"):
        paths.append(os.path.join(outdir, "bench_convert_time.png"))
        plot_convert(data, paths[-1])
    return paths
