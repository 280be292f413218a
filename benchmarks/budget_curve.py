"""Whole-step peak bytes against step time as more layers are checkpointed (``checkpoint_for_budget``), original
vs converted, on a small LLaMA configuration of ``benchmarks.step_peak`` (PEFT LoRA r16, bf16, HF's loss).

For each model and each fraction of layers (0, 25, 50, 75, 100 % by default), the budget given to
``checkpoint_for_budget`` is its own predicted peak for that many layers, so it checkpoints that many (or fewer,
where fewer already meet it). Each point has the budget's prediction (activation bytes kept for backward on the
batch), the tracked peak of a whole step (``benchmarks.live_tensors``) and its step time: all points' steps are
timed interleaved, one thread, ``time.thread_time``, medians, as ratios to the original with no checkpointing
and to the same model with every layer checkpointed.

    python -m benchmarks.budget_curve                      # config (a) shape, 8 layers, T 512
    python -m benchmarks.budget_curve --layers 4 --seq 128 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

from benchmarks import common as C
from benchmarks import step_peak as SP


def build_point(cfg: SP.StepConfig, variant: str, fraction: float, convert_kwargs: dict) -> dict:
    from lmbp_convert import checkpoint_for_budget

    m, info = SP.build_variant(cfg, variant, "cpu", convert_kwargs)
    batch = SP.make_batch(cfg, "cpu")
    probe = {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}
    options = checkpoint_for_budget(m, 2 ** 62, probe, verify=False).choices
    k = round(fraction * (len(options) - 1))
    plan = checkpoint_for_budget(m, options[k][2], probe)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
    step = SP.make_step(cfg, m, opt, batch, "cpu")
    step()  # optimizer state exists
    pk, _ = SP.track_step(cfg, m, opt, batch)
    return {"variant": variant, "fraction": fraction, "checkpointed": len(plan.checkpointed),
            "layers": len(plan.layers), "budget": plan.budget_bytes, "predicted_bytes": plan.predicted_bytes,
            "predicted_peak": plan.predicted_peak_bytes, "ledger_bytes": plan.measured_bytes, **pk.to_dict(),
            "verified": info.get("verified"), "_step": step, "_keep": (m, opt)}


def run(cfg: SP.StepConfig, fractions, repeats: int, convert_kwargs: dict, log=print) -> dict:
    torch.set_num_threads(1)
    points = []
    for variant in ("original", "converted"):
        for f in fractions:
            pt = build_point(cfg, variant, f, convert_kwargs)
            log(f"  {variant:<10} {pt['checkpointed']:>2}/{pt['layers']} checkpointed: predicted "
                f"{C.mib(pt['predicted_peak'])} MiB, whole-step peak {C.mib(pt['peak'])} MiB")
            points.append(pt)
    steps = {f"{p['variant']}@{p['checkpointed']}": p["_step"] for p in points}
    times = C.time_interleaved(steps, repeats, warmup=1, clock=time.thread_time)
    for p in points:
        p["step_s"] = C.median(times[f"{p['variant']}@{p['checkpointed']}"])
        p["times"] = times[f"{p['variant']}@{p['checkpointed']}"]
        del p["_step"], p["_keep"]
    ref = next(p for p in points if p["variant"] == "original" and p["checkpointed"] == 0)["step_s"]
    for p in points:
        every = next(q for q in points if q["variant"] == p["variant"] and q["checkpointed"] == q["layers"])
        p["ratio_vs_original"] = p["step_s"] / ref
        p["ratio_vs_all_checkpointed"] = p["step_s"] / every["step_s"]
    return {"machine": C.machine("cpu"), "threads": 1, "config": {**cfg.__dict__, "describe": cfg.describe()},
            "convert_kwargs": convert_kwargs, "repeats": repeats, "points": points}


def table(data: dict) -> str:
    rows = [[p["variant"], f"{p['checkpointed']}/{p['layers']}", C.mib(p["predicted_peak"]),
             C.mib(p["activations"]), C.mib(p["peak"]), f"{p['ratio_vs_original']:.2f}×",
             f"{p['ratio_vs_all_checkpointed']:.2f}×"] for p in data["points"]]
    head = ["model", "layers checkpointed", "budget's predicted activation MiB", "step peak: activations + temporaries",
            "step peak MiB", "step time vs original, none checkpointed", "vs same model, all checkpointed"]
    return (f"{data['config']['describe']}; {data['machine']}, thread_time medians of "
            f"{data['repeats']} interleaved rounds; convert kwargs {json.dumps(data['convert_kwargs'])}.\n\n"
            + C.markdown_table(head, rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--fractions", default="0,0.25,0.5,0.75,1")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--convert-kwargs", default="{}", type=json.loads)
    p.add_argument("--json")
    a = p.parse_args(argv)
    C.quiet()
    cfg = replace((SP.TINY if a.tiny else SP.FULL)["a"], layers=a.layers, seq=a.seq)
    t0 = time.perf_counter()
    data = run(cfg, [float(f) for f in a.fractions.split(",")], a.repeats, a.convert_kwargs)
    print("\n" + table(data))
    C.finish(data, t0, a.json)
    print(f"\n{data['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
