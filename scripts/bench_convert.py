"""How long convert() takes on a LLaMA-shaped model on CPU (issue 3: a 1B model well under a minute).

    python scripts/bench_convert.py                 # ~1.1B params (TinyLlama shape), fp32
    python scripts/bench_convert.py --dtype bf16
    python scripts/bench_convert.py --small         # smoke run

Prints the phases (trace+plan, rewrite+verify) and the report summary. Weights are random (no network).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_speed import build_causal_lm, time_convert  # noqa: E402  (shared with the scaling benchmark)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--small", action="store_true", help="tiny model, for a smoke run")
    args = ap.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    shape = (256, 688, 2, 1000) if args.small else (2048, 5632, 22, 32000)
    t0 = time.perf_counter()
    model = build_causal_lm(*shape, dtype=dtype)
    n = sum(p.numel() for p in model.parameters())
    t_build = time.perf_counter() - t0

    t_plan, t_convert, report = time_convert(model)
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print(f"model: LLaMA-shaped hidden={shape[0]} intermediate={shape[1]} layers={shape[2]} vocab={shape[3]}, "
          f"{n / 1e9:.2f} B params, {args.dtype} (built in {t_build:.1f} s)")
    print(f"trace + plan alone: {t_plan:.2f} s")
    print(f"convert() total (trace, plan, rewrite, verify): {t_convert:.2f} s")
    err = "n/a" if report.relative_error is None else f"{report.relative_error:.2e}"
    print(f"verification: {report.verification}, relative error {err}; "
          f"{len(report.plan.norm_folds)} norms, {len(report.plan.gated_mlps)} gated MLPs, "
          f"{len(report.plan.act_swaps)} activations")


if __name__ == "__main__":
    main()
