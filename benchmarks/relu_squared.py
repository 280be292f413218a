"""Squared-ReLU MLP blocks (Nemotron / Persimmon shape: up → relu² → down): saved-for-backward bytes and step time,
transformers' ReLUSquaredActivation against the memory-sharing op (`lmbp_convert.ops.relu_squared`), per dtype.

Bytes are exact (`lmbp_convert.SavedTensorLedger`); step time (forward + backward) is the median of interleaved
A/B rounds, on CPU with one thread and ``time.thread_time`` (only this thread's CPU time counts), on CUDA with
``time.perf_counter`` around synchronised steps (the Triton kernels).

    python -m benchmarks.relu_squared --tokens 2048 --hidden 1024 --intermediate 4096
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

from lmbp_convert import SavedTensorLedger
from lmbp_convert.nn.activations import MSReLUSquared

from . import common as C


class Block(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        from transformers.activations import ReLUSquaredActivation

        self.up, self.act, self.down = nn.Linear(hidden, intermediate), ReLUSquaredActivation(), nn.Linear(
            intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.relu_squared", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def _step(model: nn.Module, x: torch.Tensor):
    def run() -> None:
        model(x).float().pow(2).mean().backward()
    return run


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    clock = time.thread_time if args.device == "cpu" else time.perf_counter
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        original = Block(args.hidden, args.intermediate).to(args.device, dtype)
        converted = copy.deepcopy(original)
        converted.act = MSReLUSquared()
        x = torch.randn(args.tokens, args.hidden, device=args.device, dtype=dtype, requires_grad=True)
        nbytes = {}
        for name, m in (("original", original), ("converted", converted)):
            with SavedTensorLedger(m) as led:
                m(x)
            nbytes[name] = led.bytes
        times = C.time_interleaved({"original": _step(original, x), "converted": _step(converted, x)},
                                   repeats=args.repeats, warmup=2, device=args.device, clock=clock)
        row = {"dtype": str(dtype).replace("torch.", ""), **{f"{k}_bytes": v for k, v in nbytes.items()},
               "time_ratio": C.median(times["converted"]) / C.median(times["original"])}
        rows.append(row)
        print(f"{args.device} {row['dtype']}: saved bytes {row['original_bytes']} -> {row['converted_bytes']} "
              f"({1 - row['converted_bytes'] / row['original_bytes']:.1%} less); step time converted / original "
              f"{row['time_ratio']:.2f}x ({args.tokens} tokens, {args.hidden} -> {args.intermediate})")
    return rows


if __name__ == "__main__":
    main()
