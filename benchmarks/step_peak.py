"""Peak memory of one whole training step (forward, loss, backward, AdamW step, zero_grad), split at the peak into
parameters, gradients, optimizer state and activations + temporaries.

The model, optimizer and input exist before the step, and the optimizer has stepped once (its state exists).
The tracked step is the second one. On CPU (and on any device) every live tensor storage is tracked
(``benchmarks.live_tensors``: exact ``nbytes``, no allocator rounding); on CUDA a third, untracked step also gives
``torch.cuda.max_memory_allocated`` minus the memory allocated before it (``cuda_peak_over_start``).

Configurations (``--configs``):

    a  LLaMA-3-8B shape scaled 8x: d 512, FFN 1792, 8 heads / 2 KV heads, vocab 16032, 32 layers, bf16 weights,
       SDPA; PEFT LoRA r16 on q, k, v, o, gate, up, down (PEFT's defaults: alpha 8, no dropout, fp32
       adapters); HF's loss (labels=input_ids); T 2048, batch 1
    b  (a) with lora_dropout=0.05
    c  timm ViT-B/16 at 224 px, fp32 weights under bf16 autocast, LoRA r4 on qkv, head trained, 100 classes,
       batch 64 (the paper's Fig. 1 set-up, as benchmarks.speed)
    d  (a) without LoRA: full fine-tuning, bf16 weights, gradients and AdamW state

Variants (``--variants``): original, converted, ckpt (HF ``gradient_checkpointing_enable`` non-reentrant; timm
``set_grad_checkpointing``), ckpt-reentrant (HF only, with ``enable_input_require_grads``), and converted+ each
of the two. ``convert()`` runs with ``--convert-kwargs`` (JSON), after ``get_peft_model`` by default
(``--convert-order before`` converts the base first). Every figure printed is what was run: ``--layers``,
``--seq``, ``--batch`` scale a run down to fit a machine, and the table says so; nothing is extrapolated.

    python -m benchmarks.step_peak --configs a --layers 8 --seq 2048
    python -m benchmarks.step_peak --configs c --batch 16 --json build/step_peak_vit.json
    python -m benchmarks.step_peak --tiny      # smoke run: every config at tiny widths
    python -m benchmarks.step_peak --configs a,b,c,d --variants original,converted,ckpt,converted+ckpt \
        --chart docs/bench_step_peak.png       # the README's chart, from the run
    python -m benchmarks.step_peak --from-table README.md --chart docs/bench_step_peak.png
                                               # the same chart from the figures the README's table records

``--chart`` draws the whole-step peak of each configuration and variant as stacked bars (parameters, gradients and
optimizer state below, activations and temporaries above), the change against the original (and, for converted +
ckpt, against ckpt alone) on each bar. ``--from-table`` reads the rows back from the README's whole-step table
(between its markers) instead of running, so the chart can be redrawn from recorded figures.
"""
from __future__ import annotations

import argparse
import json
import re
import time
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional

import torch
from torch import nn

from benchmarks import common as C
from benchmarks.live_tensors import LiveTensorTracker

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS = ("original", "converted", "ckpt", "converted+ckpt", "ckpt-reentrant", "converted+ckpt-reentrant")


@dataclass(frozen=True)
class StepConfig:
    """One configuration at the size it is run. ``lora_dropout`` None: full fine-tuning."""

    key: str
    family: str  # "llama" | "vit"
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    vocab: int
    layers: int
    seq: int  # tokens (ViT: image side in px)
    batch: int
    lora_r: int = 16
    lora_dropout: Optional[float] = 0.0

    def describe(self) -> str:
        if self.family == "vit":
            what = (f"timm ViT d {self.hidden}, MLP {self.inter}, {self.heads} heads, {self.layers} layers, "
                    f"{self.seq} px, batch {self.batch}, fp32 weights + bf16 autocast, LoRA r{self.lora_r} on qkv")
        else:
            what = (f"LLaMA d {self.hidden}, FFN {self.inter}, {self.heads}/{self.kv_heads} heads, vocab "
                    f"{self.vocab}, {self.layers} layers, T {self.seq}, batch {self.batch}, bf16 weights, SDPA")
            what += (", full fine-tuning" if self.lora_dropout is None else
                     f", LoRA r{self.lora_r} on all 7 projections (dropout {self.lora_dropout})")
        return what


FULL = {
    "a": StepConfig("a", "llama", 512, 1792, 8, 2, 16032, 32, 2048, 1),
    "vit": StepConfig("c", "vit", 768, 3072, 12, 12, 0, 12, 224, 64, lora_r=4),
}
FULL["b"] = replace(FULL["a"], key="b", lora_dropout=0.05)
FULL["c"] = FULL.pop("vit")
FULL["d"] = replace(FULL["a"], key="d", lora_dropout=None)
TINY = {k: replace(v, hidden=64, inter=224 if v.family == "llama" else 256, heads=4, kv_heads=2 if
                   v.family == "llama" else 4, vocab=256, layers=2, seq=32, batch=2) for k, v in FULL.items()}


# ------------------------------------------------------------------------------------------------- models
def build_llama(cfg: StepConfig, device: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model("llama", hidden_size=cfg.hidden, intermediate_size=cfg.inter,
                                  num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                                  num_key_value_heads=cfg.kv_heads, vocab_size=cfg.vocab,
                                  max_position_embeddings=max(8192, cfg.seq), tie_word_embeddings=False,
                                  use_cache=False)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    m = C.cheap_init(m.to_empty(device=device))
    with torch.no_grad():  # the buffer to_empty left uninitialised
        m.model.rotary_emb.__init__(config=m.config)
        m.model.rotary_emb.to(device)
    return m


def build_vit(cfg: StepConfig, device: str) -> nn.Module:
    import timm

    with torch.device("meta"):
        m = timm.create_model("vit_base_patch16_224", pretrained=False, embed_dim=cfg.hidden, num_heads=cfg.heads,
                              mlp_ratio=cfg.inter / cfg.hidden, img_size=cfg.seq, depth=cfg.layers,
                              num_classes=100)
    return C.cheap_init(m.to_empty(device=device))


def peft_wrap(cfg: StepConfig, m: nn.Module) -> nn.Module:
    import peft

    if cfg.family == "vit":
        lc = peft.LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_r, lora_dropout=0.0, target_modules=["qkv"],
                             modules_to_save=["head"])
    else:
        lc = peft.LoraConfig(r=cfg.lora_r, target_modules=LLAMA_TARGETS, lora_dropout=cfg.lora_dropout)
    return peft.get_peft_model(m, lc)


def inner_model(m: nn.Module) -> nn.Module:
    return m.get_base_model() if hasattr(m, "get_base_model") else m


def enable_checkpointing(cfg: StepConfig, m: nn.Module, reentrant: bool) -> None:
    base = inner_model(m)
    if cfg.family == "vit":
        if reentrant:
            raise ValueError("timm's set_grad_checkpointing has no reentrant switch here: use 'ckpt'")
        base.set_grad_checkpointing(True)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant and cfg.lora_dropout is not None:  # frozen embeddings: reentrant blocks need an input that
        base.enable_input_require_grads()  # requires grad to backprop into their adapters (as PEFT/TRL do)


def build_variant(cfg: StepConfig, variant: str, device: str, convert_kwargs: dict,
                  convert_order: str = "after") -> tuple[nn.Module, dict]:
    """The model of one variant, trainable parameters set, and what conversion did."""
    from lmbp_convert import convert

    m = (build_vit if cfg.family == "vit" else build_llama)(cfg, device)
    converted = variant.startswith("converted")
    info: dict = {}
    if converted and convert_order == "before":
        convert(m, **convert_kwargs)
    if cfg.lora_dropout is not None:
        m = peft_wrap(cfg, m)
    if converted and convert_order == "after":
        convert(m, **convert_kwargs)
    if converted:
        rep = m.lmbp_report if hasattr(m, "lmbp_report") else inner_model(m).lmbp_report
        info = {"verified": bool(rep.verified), "items": len(rep.plan.items),
                "predicted_saved_bytes": int(getattr(rep.plan, "predicted_saved_bytes", 0) or 0)}
    if "ckpt" in variant:
        enable_checkpointing(cfg, m, reentrant=variant.endswith("reentrant"))
    return m.train(), info


def make_batch(cfg: StepConfig, device: str) -> dict:
    g = torch.Generator().manual_seed(0)
    if cfg.family == "vit":
        return {"x": torch.randn(cfg.batch, 3, cfg.seq, cfg.seq, generator=g).to(device),
                "y": torch.randint(0, 100, (cfg.batch,), generator=g).to(device)}
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g).to(device)
    return {"input_ids": ids}


def make_step(cfg: StepConfig, m: nn.Module, opt: torch.optim.Optimizer, batch: dict, device: str,
              tracker: Optional[LiveTensorTracker] = None) -> Callable[[], float]:
    """One training step; with a tracker, it names the phases."""
    mark = tracker.phase if tracker is not None else (lambda _name: None)

    def step() -> float:
        mark("forward")
        if cfg.family == "vit":
            with C.autocast_ctx(device, True):
                logits = m(batch["x"])
            loss = nn.functional.cross_entropy(logits.float(), batch["y"])
            del logits
        else:
            loss = m(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        mark("backward")
        loss.backward()
        mark("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark("after")
        return float(loss.detach())

    return step


# -------------------------------------------------------------------------------------------- measurement
def _opt_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def track_step(cfg: StepConfig, m: nn.Module, opt: torch.optim.Optimizer, batch: dict, device: str = "cpu"):
    """(Peak, loss) of one training step of a model whose optimizer has stepped before, every live tensor
    tracked."""
    C.free()
    params = [p for p in m.parameters() if p.requires_grad]
    with LiveTensorTracker() as tr:
        tr.register(list(m.parameters()) + list(m.buffers()), "params")
        tr.register(_opt_state(opt), "optimizer")
        tr.register(batch.values(), "activations")
        tr.watch_grads(params)
        loss = make_step(cfg, m, opt, batch, device, tr)()
        tr.label(_opt_state(opt), "optimizer")
        pk = tr.peak(list(m.parameters()) + list(m.buffers()) + _opt_state(opt))
    return pk, loss


def measure_variant(cfg: StepConfig, variant: str, device: str = "cpu", convert_kwargs: Optional[dict] = None,
                    convert_order: str = "after") -> dict:
    """Peak of the second training step of one variant, split; everything of it is freed on return."""
    t0 = time.perf_counter()
    m, info = build_variant(cfg, variant, device, dict(convert_kwargs or {}), convert_order)
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    batch = make_batch(cfg, device)
    first_loss = make_step(cfg, m, opt, batch, device)()  # optimizer state now exists
    pk, loss = track_step(cfg, m, opt, batch, device)
    row = {"config": cfg.key, "variant": variant, **info, **pk.to_dict(), "loss_step1": first_loss,
           "loss_step2": loss, "trainable_params": sum(p.numel() for p in params),
           "params_total": sum(p.numel() for p in m.parameters())}
    if device.startswith("cuda"):
        step = make_step(cfg, m, opt, batch, device)
        C.reset_peak(device)
        start = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        row["cuda_peak"] = torch.cuda.max_memory_allocated()
        row["cuda_peak_over_start"] = row["cuda_peak"] - start
        row["cuda_start"] = start
    row["seconds"] = round(time.perf_counter() - t0, 1)
    del m, opt, batch, params
    C.free()
    return row


def variants_for(cfg: StepConfig, wanted) -> list[str]:
    """The variants that exist for ``cfg`` (timm has no reentrant switch here)."""
    return [v for v in wanted if not (cfg.family == "vit" and v.endswith("reentrant"))]


def run(cfgs: list[StepConfig], variants, device: str = "cpu", convert_kwargs: Optional[dict] = None,
        convert_order: str = "after", log=print, json_path: Optional[str] = None) -> dict:
    data = {"machine": C.machine(device), "device": device, "convert_kwargs": convert_kwargs or {},
            "convert_order": convert_order, "configs": [], "rows": []}
    for cfg in cfgs:
        data["configs"].append({**asdict(cfg), "describe": cfg.describe()})
        log(f"\n({cfg.key}) {cfg.describe()}")
        for v in variants_for(cfg, variants):
            try:
                row = measure_variant(cfg, v, device, convert_kwargs, convert_order)
            except Exception as e:  # a failing variant is a row with its error, the others still run
                row = {"config": cfg.key, "variant": v, "error": C.err(e)}
            data["rows"].append(row)
            log("  " + line(row))
            C.save_json(json_path, data)
    return data


# -------------------------------------------------------------------------------------------------- output
def line(row: dict) -> str:
    if "error" in row:
        return f"{row['variant']:<26} ERROR {row['error']}"
    s = (f"{row['variant']:<26} peak {C.mib(row['peak']):>9} MiB ({row['phase']}): params {C.mib(row['params'])}, "
         f"grads {C.mib(row['grads'])}, optimizer {C.mib(row['optimizer'])}, activations+temporaries "
         f"{C.mib(row['activations'])}  [{row['seconds']} s]")
    if "cuda_peak" in row:
        s += f"  cuda max_memory_allocated {C.mib(row['cuda_peak'])} MiB"
    if row.get("untracked"):
        s += f"  UNTRACKED {row['untracked']} B"
    return s


def table(data: dict) -> str:
    """Markdown: one row per (config, variant), changes against the same config's original and ckpt rows."""
    rows = []
    by = {(r["config"], r["variant"]): r for r in data["rows"] if "error" not in r}
    for r in data["rows"]:
        if "error" in r:
            rows.append([r["config"], r["variant"], "error: " + r["error"]] + [""] * 8)
            continue
        base_v = r["variant"].replace("converted+", "") if r["variant"] != "converted" else "original"
        base = by.get((r["config"], base_v)) if base_v != r["variant"] else None
        rows.append([r["config"], r["variant"], C.mib(r["peak"]), C.mib(r["params"]), C.mib(r["grads"]),
                     C.mib(r["optimizer"]), C.mib(r["activations"]),
                     C.mib(r["activations_by_phase"].get("forward", 0)), r["phase"],
                     C.pct(r["peak"], base["peak"]) if base else "",
                     C.pct(r["activations"], base["activations"]) if base else ""])
    header = ["config", "variant", "peak MiB", "params", "grads", "optimizer", "activations + temporaries",
              "of which from forward", "peak in", "peak vs unconverted", "act. vs unconverted"]
    cfgs = "\n".join(f"- ({c['key']}) {c['describe']}" for c in data["configs"])
    kw = json.dumps(data["convert_kwargs"])
    return (f"Measured on {data['machine']}; convert() {data['convert_order']} get_peft_model, kwargs {kw}.\n\n"
            f"{cfgs}\n\n" + C.markdown_table(header, rows))


#: the chart's variants, in bar order, with their colours (activations; the static part is the same colour, lighter)
CHART_VARIANTS = {"original": "#7f7f7f", "converted": "#1f77b4", "ckpt": "#d62728", "converted+ckpt": "#2ca02c"}
TABLE_START, TABLE_END = "<!-- whole-step table -->", "<!-- /whole-step table -->"
#: the README table's columns → variants
_TABLE_COLUMNS = {"original MiB (activations)": "original", "converted": "converted", "ckpt": "ckpt",
                  "converted + ckpt": "converted+ckpt"}
_CELL = re.compile(r"\**([0-9.]+) \(([0-9.]+)\)\**")


def chart_groups(data: dict) -> list[tuple[str, dict[str, dict]]]:
    """(configuration label, variant → row) in the order the rows came, for the variants the chart draws (a run's
    rows are labelled by their config key; the README table's by its first column)."""
    groups: dict[str, dict[str, dict]] = {}
    for r in data["rows"]:
        if "error" in r or r["variant"] not in CHART_VARIANTS:
            continue
        groups.setdefault(r.get("label") or f"({r['config']})", {})[r["variant"]] = r
    return list(groups.items())


def chart(data: dict, path: str, title: str | None = None) -> None:
    """The whole-step peak of every configuration and variant as stacked bars (MiB): parameters, gradients and
    optimizer state (light), activations and temporaries (full colour); each bar's change against the same
    configuration's original (converted + ckpt: against ckpt alone)."""
    plt = C.plt()
    groups = chart_groups(data)
    if not groups:
        raise ValueError("no rows of the chart's variants to draw")
    fig, ax = plt.subplots(figsize=(max(6.0, 1.9 * len(groups) + 1.5), 4.6))
    width = 0.8 / len(CHART_VARIANTS)
    for i, (variant, colour) in enumerate(CHART_VARIANTS.items()):
        for j, (_, rows) in enumerate(groups):
            r = rows.get(variant)
            if r is None:
                continue
            x = j + (i - (len(CHART_VARIANTS) - 1) / 2) * width
            act, static = r["activations"] / C.MiB, (r["peak"] - r["activations"]) / C.MiB
            ax.bar(x, static, width, color=colour, alpha=0.35, edgecolor=colour)
            ax.bar(x, act, width, bottom=static, color=colour, label=variant if j == 0 else None)
            base = rows.get("ckpt" if variant == "converted+ckpt" else "original")
            if base is not None and variant != "original" and base["peak"]:
                ax.text(x, static + act, f"{100 * (r['peak'] / base['peak'] - 1):+.0f}%", ha="center", va="bottom",
                        fontsize=7)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([label for label, _ in groups], fontsize=8)
    ax.set_ylabel("whole-step peak, MiB")
    ax.margins(y=0.12)
    ax.legend(fontsize=8, title="light: params + grads + optimizer; full: activations + temporaries",
              title_fontsize=7)
    ax.set_title(title or "Whole training step peak (forward, loss, backward, AdamW step); bar labels: change against "
                 f"the original (converted+ckpt: against ckpt alone)\n{data.get('machine', '')}", fontsize=9)
    C.save_figure(fig, path)


def rows_from_table(markdown: str) -> dict:
    """The rows (peak and activations in bytes, from the MiB the table gives) of the whole-step table between the
    README's markers: what `chart` draws, without running anything."""
    start, end = markdown.find(TABLE_START), markdown.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"no whole-step table between {TABLE_START} and {TABLE_END}")
    lines = [ln.strip() for ln in markdown[start:end].splitlines() if ln.strip().startswith("|")]
    header = [h.strip() for h in lines[0].strip("|").split("|")]
    rows = []
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        label = cells[0]
        for name, cell in zip(header[1:], cells[1:]):
            m = _CELL.match(cell)
            if name in _TABLE_COLUMNS and m:
                peak, act = (round(float(v) * C.MiB) for v in m.groups())
                rows.append({"config": label, "label": label, "variant": _TABLE_COLUMNS[name], "peak": peak,
                             "activations": act})
    caption = markdown[:end].rsplit(TABLE_START, 1)[-1]
    machine = re.search(r"measured on (.+?) with `python -m benchmarks.step_peak`", " ".join(caption.split()))
    return {"machine": f"recorded in the README's table ({machine.group(1)})" if machine else "recorded figures",
            "configs": [], "rows": rows}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="a,c", help="comma list of a, b, c, d (default a,c)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--layers", type=int, help="number of layers (default: the configuration's)")
    p.add_argument("--seq", type=int, help="tokens per sequence (LLaMA) or image side in px (ViT)")
    p.add_argument("--batch", type=int, help="batch size (default: the configuration's)")
    p.add_argument("--tiny", action="store_true", help="tiny widths (smoke run)")
    p.add_argument("--convert-kwargs", default="{}", type=json.loads, help="JSON keyword arguments of convert()")
    p.add_argument("--convert-order", choices=("after", "before"), default="after",
                   help="convert() after get_peft_model (default) or the base before it")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--markdown", help="write the markdown table here")
    p.add_argument("--chart", help="write the chart of the whole-step peaks here (PNG)")
    p.add_argument("--from-table", metavar="MARKDOWN", help="draw --chart from the whole-step table in this file "
                                                             "(README.md) instead of running")
    a = p.parse_args(argv)
    if a.from_table and not a.chart:
        p.error("--from-table draws a chart: give --chart PATH")
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad}; choose from {list(VARIANTS)}")
    a.configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in a.configs if c not in FULL]
    if bad:
        p.error(f"--configs: unknown {bad}; choose from {sorted(FULL)}")
    if not isinstance(a.convert_kwargs, dict):
        p.error("--convert-kwargs must be a JSON object")
    return a


def configs_of(a: argparse.Namespace) -> list[StepConfig]:
    table_ = TINY if a.tiny else FULL
    out = []
    for key in a.configs:
        cfg = table_[key]
        over = {k: getattr(a, k) for k in ("layers", "seq", "batch") if getattr(a, k) is not None}
        out.append(replace(cfg, **over))
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.from_table:
        with open(a.from_table) as f:
            chart(rows_from_table(f.read()), a.chart)
        print(f"wrote {a.chart} from the table in {a.from_table}")
        return 0
    if a.threads:
        torch.set_num_threads(a.threads)
    C.quiet()
    t0 = time.perf_counter()
    data = run(configs_of(a), a.variants, a.device, a.convert_kwargs, a.convert_order, json_path=a.json)
    md = table(data)
    print("\n" + md)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md + "\n")
    C.finish(data, t0, a.json)
    if a.chart:
        chart(data, a.chart)
        print(f"wrote {a.chart}")
    print(f"\n{data['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

