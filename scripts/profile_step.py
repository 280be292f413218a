"""Where a ViT-B/16 LoRA training step spends its host time: torch.profiler's CPU self time per op, original vs
converted, on the bench_speed model (batch 64, bf16 autocast). For the eager GPU gap, which the busy fraction
says is host-bound: the table names the ops whose Python/C++ launch path costs the most.

    python scripts/profile_step.py                 # CUDA
    python scripts/profile_step.py --device cpu --tiny   # smoke run
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

import _bench_common as C
import bench_speed as S


def profile_variant(fam: C.Family, device: str, tiny: bool, convert_: bool, steps: int, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    m = S._vit_lora_model(fam, device, tiny, convert_)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
    x = C.make_input(fam, torch.float32, device)
    y = torch.randint(0, 100, (fam.batch,), device=device)

    def step():
        with C.autocast_ctx(device, True):
            logits = m(x)
        nn.functional.cross_entropy(logits.float(), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    C.sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    C.sync(device)
    wall = (time.perf_counter() - t0) / steps
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        C.sync(device)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    name = "converted" if convert_ else "original"
    return f"## {name}: {wall * 1e3:.2f} ms per step unprofiled ({fam.batch / wall:.0f} img/s)\n{table}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("profile_step: no CUDA device", file=sys.stderr)
        return 2
    C.quiet()
    fam = C.TINY["vit"].with_(batch=4) if args.tiny else C.FULL["vit"].with_(batch=64)  # as bench_speed --gpu
    for convert_ in (False, True):
        print(profile_variant(fam, args.device, args.tiny, convert_, args.steps, args.rows), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
