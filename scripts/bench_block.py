"""Saved-for-backward bytes and CPU step time of one LLaMA-7B-shaped decoder block, original vs converted.

    python scripts/bench_block.py                       # hidden 4096, intermediate 11008, seq 512, bf16
    python scripts/bench_block.py --small --repeats 2   # smoke run

Bytes are exact (SavedTensorLedger: unique storages saved for backward, parameters and autocast weight copies
excluded). Time is forward+backward, median of --repeats runs after one warm-up, original and converted
interleaved.
"""
from __future__ import annotations

import argparse
import copy
import logging
import platform
import statistics
import time

import torch


def block(hidden: int, inter: int, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
                               num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128, vocab_size=256,
                               tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    m = m.to_empty(device="cpu")
    with torch.no_grad():
        for p in m.parameters():
            p.uniform_(0.5, 1.5) if p.dim() == 1 else p.normal_(0, 0.02)
    m.model.rotary_emb.__init__(config=cfg)
    return m


def measure(model, ids, autocast: bool, repeats: int):
    from lmbp_convert import SavedTensorLedger

    model.train()

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model.model(input_ids=ids).last_hidden_state
        out.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    with SavedTensorLedger(model) as led:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model.model(input_ids=ids).last_hidden_state
    del out
    return led.bytes, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from lmbp_convert import convert

    hidden, inter = (512, 1376) if args.small else (4096, 11008)
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"LLaMA block: hidden {hidden}, intermediate {inter}, seq {args.seq}, batch 1 (embedding and final "
          "norm included, no head)\n")
    print("| mode | original bytes | converted bytes | reduction | original s/step | converted s/step | ratio |")
    print("|---|---|---|---|---|---|---|")
    for mode in ("bf16", "bf16 autocast (fp32 weights)"):
        dtype = torch.bfloat16 if mode == "bf16" else torch.float32
        orig = block(hidden, inter, dtype)
        conv = convert(copy.deepcopy(orig))
        ids = torch.randint(0, 256, (1, args.seq))
        autocast = "autocast" in mode
        b0, s0 = measure(orig, ids, autocast, args.repeats)
        b1, s1 = measure(conv, ids, autocast, args.repeats)
        s0(), s1()  # warm-up
        t0, t1 = [], []
        for _ in range(args.repeats):
            for fn, ts in ((s0, t0), (s1, t1)):
                a = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - a)
        m0, m1 = statistics.median(t0), statistics.median(t1)
        print(f"| {mode} | {b0 / 2**20:.1f} MiB | {b1 / 2**20:.1f} MiB | {100 * (1 - b1 / b0):.1f} % | "
              f"{m0:.2f} | {m1:.2f} | {m1 / m0:.3f} |", flush=True)


if __name__ == "__main__":
    main()
