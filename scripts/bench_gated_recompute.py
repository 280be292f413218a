"""Gated MLP: down projection fused into the op (today) vs called unchanged with h recomputed (prototype).

For one LLaMA-shaped MLP block (transformers LlamaMLP) and each down projection (plain Linear, PEFT LoRA on
gate/up/down, PEFT DoRA on gate/up/down) and precision (fp32, bf16, bf16 autocast), prints

* saved-for-backward bytes of one forward (`SavedTensorLedger`, exact) for the original MLP, `MSGatedMLP`
  with ``down_mode="fused"`` and with ``down_mode="recompute"``;
* with ``--compile``, the same bytes for the torch.compile'd modules (CPU inductor);
* CPU fwd+bwd time (1 thread, `time.thread_time`, A/B/C rounds interleaved in one process, medians), eager
  and, with ``--compile``, under torch.compile (inductor). Timing ratios are to the fused module.

Usage: python scripts/bench_gated_recompute.py [--tokens 256 --hidden 512 --inter 1376 --rounds 15 --compile]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from lmbp_convert.memory import SavedTensorLedger
from lmbp_convert.nn.gated_mlp import MSGatedMLP

DOWNS = ("linear", "lora", "dora", "lora-dropout")
PRECISIONS = ("fp32", "bf16", "bf16-autocast")
VARIANTS = ("original", "fused", "recompute")


class Block(nn.Module):
    """The MLP under a parent, so PEFT can wrap its projections by name."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def make_block(hidden: int, inter: int, down: str, dtype: torch.dtype, rank: int) -> nn.Module:
    import transformers
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=4,
                                   num_key_value_heads=4, hidden_act="silu")
    torch.manual_seed(0)
    block = Block(LlamaMLP(cfg)).to(dtype)
    if down == "linear":
        return block
    import peft

    lcfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["gate_proj", "up_proj", "down_proj"],
                           init_lora_weights=False, use_dora=down == "dora",
                           lora_dropout=0.1 if down == "lora-dropout" else 0.0)
    return peft.get_peft_model(block, lcfg).base_model.model


def convert(block: nn.Module, mode: str) -> nn.Module:
    block = copy.deepcopy(block)
    m = block.mlp
    names = ("gate_proj", "up_proj", "down_proj")
    block.mlp = MSGatedMLP("silu", "down_proj", "gate_proj", "up_proj", modules={n: getattr(m, n) for n in names},
                           down_mode=mode)
    return block


def variants(base: nn.Module) -> dict[str, nn.Module | str]:
    out: dict[str, nn.Module | str] = {"original": base}
    for mode in ("fused", "recompute"):
        try:
            out[mode] = convert(base, mode)
        except NotImplementedError as e:
            out[mode] = f"raises ({str(e).split(';')[0][:60]}...)"
    return out


def run_ctx(precision: str):
    if precision == "bf16-autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def saved_bytes(module: nn.Module, x: torch.Tensor, precision: str) -> int:
    with run_ctx(precision), SavedTensorLedger(module) as ledger:
        module(x)
    return ledger.bytes


def step(module, x: torch.Tensor, w: torch.Tensor, precision: str) -> None:
    for p in module.parameters():
        p.grad = None
    with run_ctx(precision):
        out = module(x)
    (out.float() * w).sum().backward()


def time_rounds(fns: dict, rounds: int, warmup: int = 2) -> dict[str, float]:
    """Interleaved rounds, one call each per round; median CPU thread time per call in ms."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.thread_time()
            fn()
            times[k].append(time.thread_time() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1376, help="intermediate size (LLaMA ratio 11008/4096)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--downs", nargs="+", default=list(DOWNS), choices=DOWNS)
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    ap.add_argument("--speed-precisions", nargs="+", default=["fp32"], choices=PRECISIONS)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile (inductor, CPU)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    print(f"LLaMA-shaped MLP: T={args.tokens} tokens, hidden={args.hidden}, inter={args.inter}, LoRA r={args.rank}")
    print("\nsaved-for-backward bytes (one forward)")
    print(f"{'down':<13}{'precision':<15}" + "".join(f"{v:>14}" for v in VARIANTS) + f"{'recompute-fused':>18}")
    for down in args.downs:
        for precision in args.precisions:
            dtype = torch.bfloat16 if precision == "bf16" else torch.float32
            mods = variants(make_block(args.hidden, args.inter, down, dtype, args.rank))
            x_dtype = torch.float32 if precision == "fp32" else torch.bfloat16  # autocast: the norm emits bf16
            x = torch.randn(1, args.tokens, args.hidden, dtype=x_dtype, requires_grad=True)
            row = {k: (saved_bytes(m, x, precision) if isinstance(m, nn.Module) else m) for k, m in mods.items()}
            both = all(isinstance(row[k], int) for k in ("fused", "recompute"))
            diff = row["recompute"] - row["fused"] if both else "-"
            cells = "".join(f"{v:>14}" if isinstance(v, int) else f"  {v}" for v in row.values())
            print(f"{down:<13}{precision:<15}{cells}{diff:>18}")

    modes = ["eager"] + (["compiled"] if args.compile else [])
    compiled_bytes: dict[tuple[str, str, str], int] = {}
    print(f"\nCPU fwd+bwd, 1 thread, median of {args.rounds} interleaved rounds (ms); ratios to fused")
    print(f"{'down':<13}{'precision':<15}{'mode':<10}" + "".join(f"{v:>12}" for v in VARIANTS)
          + f"{'orig/fused':>12}{'recomp/fused':>14}{'recomp/orig':>13}")
    for down in args.downs:
        for precision in args.speed_precisions:
            dtype = torch.bfloat16 if precision == "bf16" else torch.float32
            mods = variants(make_block(args.hidden, args.inter, down, dtype, args.rank))
            x_dtype = torch.float32 if precision == "fp32" else torch.bfloat16
            x = torch.randn(1, args.tokens, args.hidden, dtype=x_dtype, requires_grad=True)
            w = torch.randn(1, args.tokens, args.hidden)
            compiled: dict[str, nn.Module] = {}
            for mode in modes:
                fns = {}
                for k, m in mods.items():
                    if not isinstance(m, nn.Module):
                        continue
                    mm = compiled.setdefault(k, torch.compile(m)) if mode == "compiled" else m
                    fns[k] = (lambda mm=mm, x=x, w=w, p=precision: step(mm, x, w, p))
                ms = time_rounds(fns, args.rounds)
                if mode == "compiled":
                    for k, m in mods.items():
                        if isinstance(m, nn.Module):
                            compiled_bytes[(down, precision, k)] = saved_bytes(compiled[k], x, precision)
                cells = "".join(f"{ms[v]:>12.2f}" if v in ms else f"{'-':>12}" for v in VARIANTS)
                r1 = f"{ms['original'] / ms['fused']:.3f}" if "fused" in ms else "-"
                r2 = f"{ms['recompute'] / ms['fused']:.3f}" if "fused" in ms else "-"
                r3 = f"{ms['recompute'] / ms['original']:.3f}"
                print(f"{down:<13}{precision:<15}{mode:<10}{cells}{r1:>12}{r2:>14}{r3:>13}", flush=True)
    if compiled_bytes:
        print("\nsaved-for-backward bytes under torch.compile (one forward)")
        for (down, precision) in dict.fromkeys((d, p) for d, p, _ in compiled_bytes):
            cells = "".join(f"{compiled_bytes[(down, precision, v)]:>14}" if (down, precision, v) in compiled_bytes
                            else f"{'-':>14}" for v in VARIANTS)
            print(f"{down:<13}{precision:<15}{cells}")


if __name__ == "__main__":
    main()
