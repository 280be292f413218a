"""CPU time of one whole training step (forward, loss, backward, AdamW step) of `benchmarks.step_peak`'s
configurations, variants against the original as ratios.

Every variant's model, optimizer and batch stay alive, and the variants run in interleaved rounds in one process
(one thread by default, ``time.thread_time``, medians), so machine noise falls on all of them alike. The model is
scaled down to what the machine runs in reasonable time (``--layers``, ``--seq``, ``--batch``), and the table says
so. ``--compile``: every variant's model runs as ``torch.compile(model)`` (inductor; the optimizer stays eager),
compiled and warmed up before the first timed round.

    python -m benchmarks.step_time --configs a --layers 2 --seq 512 --rounds 11
    python -m benchmarks.step_time --configs a,d --variants original,converted --convert-kwargs '{"loss": false}'
    python -m benchmarks.step_time --configs c --seq 224 --batch 8 --rounds 11 --compile
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from benchmarks import common as C
from benchmarks import step_peak as S


def run(cfg: S.StepConfig, variants: list[str], rounds: int, convert_kwargs: dict, log=print,
        compiled: bool = False) -> dict:
    """Median seconds per variant and their ratios to the first variant; ``compiled``: each model through
    ``torch.compile`` (inductor)."""
    steps = {}
    for v in variants:
        m, _ = S.build_variant(cfg, v, "cpu", dict(convert_kwargs))
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
        steps[v] = S.make_step(cfg, torch.compile(m) if compiled else m, opt, S.make_batch(cfg, "cpu"), "cpu")
        for _ in range(2 if compiled else 1):  # warm-up: optimizer state, first-use builds; the compile's graphs
            steps[v]()
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for v, step in steps.items():
            t = time.thread_time()
            step()
            times[v].append(time.thread_time() - t)
    med = {v: statistics.median(ts) for v, ts in times.items()}
    ratios = {v: med[v] / med[variants[0]] for v in variants}
    log(f"({cfg.key}) {cfg.describe()}" + (", torch.compile (inductor)" if compiled else ""))
    for v in variants:
        log(f"  {v:<16} {med[v] * 1e3:9.1f} ms   {ratios[v]:.3f}×")
    return {"config": cfg.key, "describe": cfg.describe(), "median_s": med, "ratio": ratios,
            "times_s": times, "rounds": rounds, "compiled": compiled}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="a", help="comma list of a, b, c, d")
    p.add_argument("--variants", default="original,converted", help="the first is the reference")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int)
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--convert-kwargs", default="{}", type=json.loads)
    p.add_argument("--compile", action="store_true", help="torch.compile(model) every variant (inductor)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    C.quiet()
    t0 = time.perf_counter()
    data = {"machine": C.machine("cpu"), "threads": a.threads, "convert_kwargs": a.convert_kwargs, "rows": []}
    for key in a.configs.split(","):
        over = {k: getattr(a, k) for k in ("layers", "seq", "batch") if getattr(a, k) is not None}
        data["rows"].append(run(replace(S.FULL[key], **over), a.variants.split(","), a.rounds, a.convert_kwargs,
                                compiled=a.compile))
    C.finish(data, t0, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
