"""The QLoRA flow, run for real: fold on disk, load in 4 bits, convert, LoRA, train; against plain QLoRA.

    python -m benchmarks.qlora                       # CUDA + bitsandbytes; ~1.1 B LLaMA-shaped model
    python -m benchmarks.qlora --tiny --no-quant --device cpu     # smoke run of the same flow, no 4-bit

Flow (the README's reason for the checkpoint CLI):
  0. a LLaMA-shaped causal LM built from a config (default TinyLlama-1.1B's shape: hidden 2048, intermediate
     5632, 22 layers, 32 heads, 4 KV heads, vocab 32000), random weights (norm gains in U(0.5, 1.5) so the fold
     is not trivial), bf16, ``save_pretrained`` to a temporary folder: SRC. No network.
  1. baseline QLoRA: ``from_pretrained(SRC, quantization_config=BitsAndBytesConfig(load_in_4bit=True, nf4,
     double quant, bf16 compute))`` → PEFT LoRA (r 16 on q/k/v/o/gate/up/down) → training steps.
  2. ours: ``lmbp-convert SRC DST`` (the CLI, timed) → ``from_pretrained(DST, same 4-bit config)`` →
     ``convert()`` → the same LoRA → the same steps.
Reported for each: load (and CLI, convert) seconds, the first step's loss (same weights and LoRA init, so the
two agree to bf16 rounding: the fold and the swaps are exact), tokens/s (median step; AdamW on the adapters),
peak ``torch.cuda.max_memory_allocated`` over the timed steps and its excess over what the loaded model holds,
and the exact saved-for-backward bytes per block (SavedTensorLedger: L blocks minus L-1 blocks).
JSON to ``--json`` (default $OUT/bench_qlora.json when OUT is set). Exit status 2 when CUDA or bitsandbytes is
missing for the 4-bit run.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Optional

import torch
from torch import nn

from benchmarks import common as C
from testsupport.blocks import block_bytes

V_BASE, V_OURS = "QLoRA", "lmbp-convert + QLoRA"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def problem(args) -> Optional[str]:
    """Why the run cannot start (None when it can)."""
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        return "benchmarks.qlora: no CUDA device (use --device cpu --no-quant for a smoke run of the flow)"
    if not args.no_quant:
        if not args.device.startswith("cuda"):
            return "benchmarks.qlora: 4-bit loading needs CUDA (or pass --no-quant)"
        try:
            import bitsandbytes  # noqa: F401
        except Exception as e:
            return f"benchmarks.qlora: bitsandbytes is not importable ({C.err(e)}); install it or pass --no-quant"
    return None


def build_source(args, path: str) -> dict:
    """The random-weight LLaMA-shaped checkpoint (SRC), saved with save_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    C.quiet()
    cfg = AutoConfig.for_model("llama", hidden_size=args.hidden, intermediate_size=args.inter,
                               num_hidden_layers=args.layers, num_attention_heads=args.heads,
                               num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                               max_position_embeddings=max(2048, args.seq), tie_word_embeddings=False)
    dev = args.device if args.device.startswith("cuda") else "cpu"
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    m = C.cheap_init(m.to_empty(device=dev))
    with torch.no_grad():
        m.model.rotary_emb.__init__(config=m.config)
    params = sum(p.numel() for p in m.parameters())
    t0 = time.perf_counter()
    m.save_pretrained(path)
    info = {"params": params, "save_s": round(time.perf_counter() - t0, 1),
            "shape": f"LLaMA: hidden {args.hidden}, intermediate {args.inter}, {args.layers} layers, "
                     f"{args.heads} heads ({args.kv_heads} KV), vocab {args.vocab}; {params / 1e9:.2f} B params, "
                     "random weights, bf16"}
    del m
    C.free()
    return info


#: Run the CLI in this process (tests: skips a second interpreter's imports) instead of a subprocess.
CLI_IN_PROCESS = False


def fold_on_disk(src: str, dst: str) -> dict:
    """``lmbp-convert SRC DST`` in a subprocess (as a user runs it, imports included), timed."""
    if CLI_IN_PROCESS:
        from lmbp_convert import cli

        t0 = time.perf_counter()
        rc = cli.main([src, dst, "--no-progress", "-q"])
        if rc != 0:
            raise RuntimeError(f"lmbp-convert failed ({rc})")
        return {"cli_s": round(time.perf_counter() - t0, 1), "returncode": rc, "in_process": True}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (C.ROOT, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "lmbp_convert", src, dst, "--no-progress"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    out = {"cli_s": round(time.perf_counter() - t0, 1), "returncode": p.returncode,
           "cli_tail": (p.stdout + p.stderr)[-1200:]}
    if p.returncode != 0:
        raise RuntimeError(f"lmbp-convert failed ({p.returncode}): {out['cli_tail']}")
    return out


def load(path: str, args) -> nn.Module:
    from transformers import AutoModelForCausalLM

    kw: dict = {"dtype": torch.bfloat16}
    if not args.no_quant:
        from transformers import BitsAndBytesConfig

        kw["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_use_double_quant=True,
                                                       bnb_4bit_compute_dtype=torch.bfloat16)
        kw["device_map"] = {"": torch.device(args.device).index or 0}
    m = AutoModelForCausalLM.from_pretrained(path, **kw)
    if args.no_quant:
        m = m.to(args.device)
    return m


def add_lora(m: nn.Module, rank: int) -> nn.Module:
    import peft

    cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=LORA_TARGETS,
                          task_type="CAUSAL_LM")
    return peft.get_peft_model(m, cfg).train()


def train(m: nn.Module, args, row: dict) -> None:
    """Warm-up and timed training steps (AdamW on the trainable parameters); fills ``row``."""
    dev = args.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(dev)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
    losses: list[float] = []

    def step() -> None:
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    row["block_bytes"] = block_bytes(m, ids)
    for _ in range(args.warmup):
        step()
    C.sync(dev)
    if dev.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    row["static"] = C.cuda_mem(dev).get("allocated")
    times = C.time_interleaved({"s": step}, args.steps, 0, dev)["s"]
    med = C.median(times)
    row.update({"step_s": med, "tokens_s": args.batch * args.seq / med, "steps_s": [round(t, 4) for t in times],
                "first_loss": float(losses[0]) if losses else None, **C.cuda_mem(dev)})
    if row.get("peak") is not None and row.get("static") is not None:
        row["peak_over_static"] = row["peak"] - row["static"]
    opt = losses = None  # free the optimizer state now (step() keeps the cells, not the values)
    C.free()


def variant(name: str, path: str, args, do_convert: bool) -> dict:
    from lmbp_convert import convert

    row: dict = {"variant": name}
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    m = load(path, args)
    row["load_s"] = round(time.perf_counter() - t0, 1)
    row["loaded_bytes"] = C.cuda_mem(args.device).get("allocated")
    if do_convert:
        t0 = time.perf_counter()
        rep = convert(m).lmbp_report
        row["convert_s"] = round(time.perf_counter() - t0, 1)
        row["convert_report"] = rep.counts()
        row["verified"] = rep.verified
    m = add_lora(m, args.rank)
    row["trainable_params"] = sum(p.numel() for p in m.parameters() if p.requires_grad)
    train(m, args, row)
    del m
    C.free()
    return row


def run(args, log=print) -> dict:
    data = {"kind": "qlora", "machine": C.machine(args.device), "quantized": not args.no_quant,
            "batch": args.batch, "seq": args.seq, "rank": args.rank, "steps": args.steps, "warmup": args.warmup,
            "rows": []}
    work = args.workdir or tempfile.mkdtemp(prefix="lmbp_qlora_")
    src, dst = os.path.join(work, "src"), os.path.join(work, "folded")

    def save() -> None:
        C.save_json(args.json, data)

    t_start = time.perf_counter()
    try:
        data["model"] = build_source(args, src)
        log(f"# {data['model']['shape']}; saved in {data['model']['save_s']} s")
        for name in (V_BASE, V_OURS):
            try:
                row = {"variant": name}
                if name == V_OURS:
                    row.update(fold_on_disk(src, dst))
                    log(f"  lmbp-convert SRC DST: {row['cli_s']} s")
                row.update(variant(name, dst if name == V_OURS else src, args, name == V_OURS))
                log(f"  {name:<22} {row['tokens_s']:9.0f} tok/s  step {row['step_s'] * 1e3:7.1f} ms  "
                    f"block {row['block_bytes'] / C.MiB:7.1f} MiB  first loss {row['first_loss']:.4f}"
                    + (f"  peak {row['peak'] / C.MiB:7.0f} MiB (+{row['peak_over_static'] / C.MiB:.0f} over "
                       f"the loaded model)" if row.get("peak") is not None else "")
                    + (f"  [{row['convert_report']}]" if "convert_report" in row else ""))
            except Exception as e:
                row["error"] = C.err(e)
                log(f"  {name}: FAILED {row['error']}")
                traceback.print_exc()
            data["rows"].append(row)
            save()
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return C.finish(data, t_start, args.json)


def table(data: dict) -> str:
    rows = []
    base = next((r for r in data.get("rows", []) if r["variant"] == V_BASE and "tokens_s" in r), {})
    for r in data.get("rows", []):
        if "error" in r:
            rows.append((r["variant"], f"failed: {r['error']}", "", "", "", "", "", ""))
            continue
        rows.append((r["variant"], f"{r['tokens_s']:.0f}",
                     f"{r['tokens_s'] / base['tokens_s']:.2f}×" if base else "—",
                     C.mib(r.get("peak")), C.mib(r.get("peak_over_static")),
                     f"{r['block_bytes'] / C.MiB:.1f} ({C.pct(r['block_bytes'], base.get('block_bytes'))})",
                     f"{r['first_loss']:.4f}",
                     ", ".join(f"{k} {r[k]} s" for k in ("cli_s", "load_s", "convert_s") if k in r)))
    q = "4-bit NF4 (bitsandbytes, double quant, bf16 compute)" if data.get("quantized") else "bf16, not quantized"
    head = (f"**QLoRA flow** ({data.get('model', {}).get('shape', '?')}; {q}; LoRA r {data.get('rank')} on "
            f"{', '.join(LORA_TARGETS)}; batch {data.get('batch')} × seq {data.get('seq')}; AdamW; median of "
            f"{data.get('steps')} steps after {data.get('warmup')}) on {data.get('machine')}")
    return head + "\n\n" + C.markdown_table(
        ("variant", "tokens/s", "vs QLoRA", "peak MiB", "peak over loaded model MiB", "saved MiB per block",
         "first loss", "times"), rows)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model and steps (smoke run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-quant", action="store_true", help="load in bf16 instead of 4 bits (no bitsandbytes)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--workdir", default=None, help="where SRC and DST go (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.tiny:
        a.hidden, a.inter, a.layers, a.heads, a.kv_heads, a.vocab = 64, 172, 2, 4, 2, 256
        a.seq, a.batch, a.rank, a.steps, a.warmup = 32, 2, 4, 2, 1
    if a.json is None and os.environ.get("OUT"):
        a.json = os.path.join(os.environ["OUT"], "bench_qlora.json")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    why = problem(args)
    if why:
        print(why, file=sys.stderr)
        return 2
    data = run(args)
    print("\n" + table(data))
    print(f"\n{data['elapsed_s']} s")
    return 0 if data["rows"] and all("error" not in r for r in data["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
