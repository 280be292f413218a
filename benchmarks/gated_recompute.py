"""Gated MLP: down projection fused into the op (today) vs called unchanged with h recomputed (prototype).

For one LLaMA-shaped MLP block (transformers LlamaMLP) and each down projection (plain Linear, PEFT LoRA on
gate/up/down, PEFT DoRA on gate/up/down) and precision (fp32, bf16, bf16 autocast), prints

* saved-for-backward bytes of one forward (`SavedTensorLedger`, exact) for the original MLP, `MSGatedMLP`
  with ``down_mode="fused"`` and with ``down_mode="recompute"``;
* with ``--compile``, the same bytes for the torch.compile'd modules (CPU inductor);
* CPU fwd+bwd time (1 thread, `time.thread_time`, A/B/C rounds interleaved in one process by
  `common.time_interleaved`, medians), eager and, with ``--compile``, under torch.compile (inductor). Timing
  ratios are to the fused module.

Usage: python -m benchmarks.gated_recompute [--tokens 256 --hidden 512 --inter 1376 --rounds 15 --compile]
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from typing import Callable

import torch
from torch import nn

from benchmarks import common as C
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


def setup(args: argparse.Namespace, down: str, precision: str) -> tuple[dict[str, nn.Module | str], torch.Tensor]:
    """The three variants of one block and an input (under autocast the norm before the MLP emits bf16)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    mods = variants(make_block(args.hidden, args.inter, down, dtype, args.rank))
    x_dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    return mods, torch.randn(1, args.tokens, args.hidden, dtype=x_dtype, requires_grad=True)


def saved_bytes(module: nn.Module, x: torch.Tensor, precision: str) -> int:
    def fwd():
        with C.autocast_ctx("cpu", precision == "bf16-autocast"):
            return module(x)

    return C.ledger_bytes(fwd, module)


def step(module: nn.Module, x: torch.Tensor, w: torch.Tensor, precision: str) -> None:
    for p in module.parameters():
        p.grad = None
    with C.autocast_ctx("cpu", precision == "bf16-autocast"):
        out = module(x)
    (out.float() * w).sum().backward()


def bytes_rows(args: argparse.Namespace) -> list[dict]:
    """Saved-for-backward bytes of one forward: {down, precision, original, fused, recompute} (an int, or why
    the variant could not be built)."""
    rows = []
    for down in args.downs:
        for precision in args.precisions:
            mods, x = setup(args, down, precision)
            row = {k: (saved_bytes(m, x, precision) if isinstance(m, nn.Module) else m) for k, m in mods.items()}
            rows.append({"down": down, "precision": precision, **row})
    return rows


def print_bytes(rows: list[dict], log: Callable[[str], None] = print) -> None:
    log("\nsaved-for-backward bytes (one forward)")
    log(f"{'down':<13}{'precision':<15}" + "".join(f"{v:>14}" for v in VARIANTS) + f"{'recompute-fused':>18}")
    for r in rows:
        both = all(isinstance(r[k], int) for k in ("fused", "recompute"))
        diff = r["recompute"] - r["fused"] if both else "-"
        cells = "".join(f"{r[v]:>14}" if isinstance(r[v], int) else f"  {r[v]}" for v in VARIANTS)
        log(f"{r['down']:<13}{r['precision']:<15}{cells}{diff:>18}")


def speed(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[tuple[str, str, str], int]:
    """Print the fwd+bwd times (eager, and compiled with ``--compile``); return the compiled modules' bytes."""
    modes = ["eager"] + (["compiled"] if args.compile else [])
    compiled_bytes: dict[tuple[str, str, str], int] = {}
    log(f"\nCPU fwd+bwd, 1 thread, median of {args.rounds} interleaved rounds (ms); ratios to fused")
    log(f"{'down':<13}{'precision':<15}{'mode':<10}" + "".join(f"{v:>12}" for v in VARIANTS)
        + f"{'orig/fused':>12}{'recomp/fused':>14}{'recomp/orig':>13}")
    for down in args.downs:
        for precision in args.speed_precisions:
            mods, x = setup(args, down, precision)
            w = torch.randn(1, args.tokens, args.hidden)
            built = {k: m for k, m in mods.items() if isinstance(m, nn.Module)}
            for mode in modes:
                run = {k: torch.compile(m) for k, m in built.items()} if mode == "compiled" else built
                fns = {k: (lambda m=m: step(m, x, w, precision)) for k, m in run.items()}
                times = C.time_interleaved(fns, args.rounds, 2, clock=time.thread_time)
                ms = {k: 1e3 * C.median(v) for k, v in times.items()}
                if mode == "compiled":
                    compiled_bytes.update({(down, precision, k): saved_bytes(m, x, precision) for k, m in run.items()})
                cells = "".join(f"{ms[v]:>12.2f}" if v in ms else f"{'-':>12}" for v in VARIANTS)
                r1 = f"{ms['original'] / ms['fused']:.3f}" if "fused" in ms else "-"
                r2 = f"{ms['recompute'] / ms['fused']:.3f}" if "fused" in ms else "-"
                r3 = f"{ms['recompute'] / ms['original']:.3f}"
                log(f"{down:<13}{precision:<15}{mode:<10}{cells}{r1:>12}{r2:>14}{r3:>13}")
    return compiled_bytes


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1376, help="intermediate size (LLaMA ratio 11008/4096)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--downs", nargs="+", default=list(DOWNS), choices=DOWNS)
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    ap.add_argument("--speed-precisions", nargs="+", default=["fp32"], choices=PRECISIONS)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile (inductor, CPU)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    print(f"LLaMA-shaped MLP: T={args.tokens} tokens, hidden={args.hidden}, inter={args.inter}, LoRA r={args.rank}")
    print_bytes(bytes_rows(args))
    compiled_bytes = speed(args, log=lambda line: print(line, flush=True))
    if compiled_bytes:
        print("\nsaved-for-backward bytes under torch.compile (one forward)")
        for (down, precision) in dict.fromkeys((d, p) for d, p, _ in compiled_bytes):
            cells = "".join(f"{compiled_bytes[(down, precision, v)]:>14}" if (down, precision, v) in compiled_bytes
                            else f"{'-':>14}" for v in VARIANTS)
            print(f"{down:<13}{precision:<15}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
