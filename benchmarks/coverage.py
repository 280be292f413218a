"""Conversion coverage: for every tiny family in the test registries, a plain ``convert(model)`` (no probe) in
fp32, bf16 and bf16 autocast, with its verification and the exact saved-for-backward bytes it saves.

Families come from the test builders (tests/tiny_models.py, tests/probe_families.py) plus a few more HF model
types at tiny sizes; nothing is downloaded. Bytes: one training forward on the probe ``make_probe`` builds,
counted by ``SavedTensorLedger`` with parameters excluded, before and after conversion.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from typing import Callable

import torch
from torch import nn

from benchmarks import common as C

sys.path.insert(0, os.path.join(C.ROOT, "tests"))  # the tiny-model builders live with the tests

GROUPS = {
    "decoder": ["llama", "mistral", "qwen2", "gemma", "gpt2", "gpt2_classifier", "phi3", "qwen3", "olmo", "granite", "gemma2",
                "stablelm", "opt", "gpt_neox",
                "bloom"],
    "encoder": ["bert", "roberta", "bert_multiple_choice", "electra", "distilbert"],
    "enc-dec": ["t5", "umt5", "bart", "bart_classifier", "mbart", "marian", "pegasus", "bert2bert", "vit_gpt2"],
    "MoE": ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"],
    "speech": ["whisper", "wav2vec2_bert", "speech_to_text", "wav2vec2", "hubert"],
    "vision-timm": ["timm_vit", "timm_swin", "timm_hiera_160", "timm_mixer_160", "timm_vit_160", "timm_convnext",
                    "timm_eva02", "timm_deit", "timm_beit"],
    "vision-HF": ["vit", "clip_vision"],
    "dual": ["clip", "siglip"],
}
MODES = ("fp32", "bf16", "autocast")


def registry() -> dict[str, Callable[[], nn.Module]]:
    """name → builder of a tiny random-init model."""
    from probe_families import PROBE_FAMILIES
    from tiny_models import FAMILIES, hf

    reg: dict[str, Callable[[], nn.Module]] = {**FAMILIES, **PROBE_FAMILIES}
    small = dict(intermediate_size=172, num_key_value_heads=2)
    moe = dict(small, intermediate_size=128)  # bf16 grouped matmuls want 16-byte strides
    reg.update({
        "phi3": lambda: hf("phi3", pad_token_id=0, **small),
        "granite": lambda: hf("granite", **small),
        "gemma2": lambda: hf("gemma2", head_dim=16, **small),
        "stablelm": lambda: hf("stablelm", **small),
        "qwen3": lambda: hf("qwen3", head_dim=16, **small),
        "olmo": lambda: hf("olmo", **small),
        "electra": lambda: hf("electra", head="cls", embedding_size=64),
        "distilbert": lambda: hf("distilbert", head="cls", dim=64, hidden_dim=256, n_layers=2, n_heads=4),
        "mixtral": lambda: hf("mixtral", num_local_experts=4, num_experts_per_tok=2, **moe),
        "qwen2_moe": lambda: hf("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                shared_expert_intermediate_size=64, **moe),
        "qwen3_moe": lambda: hf("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                head_dim=16, **moe),
        "opt": lambda: hf("opt", ffn_dim=256, word_embed_proj_dim=64, max_position_embeddings=64),
        "gpt_neox": lambda: hf("gpt_neox", tie_word_embeddings=False),
        "bloom": lambda: hf("bloom", n_layer=2, n_head=4),
        "timm_convnext": lambda: _timm("convnext_atto", depths=(1, 1, 1, 1), dims=(16, 32, 48, 64)),
        "timm_eva02": lambda: _timm("eva02_tiny_patch14_224", embed_dim=64, depth=2, num_heads=2, img_size=28),
        "timm_deit": lambda: _timm("deit_tiny_patch16_224", embed_dim=64, depth=2, num_heads=2, img_size=32),
        "timm_beit": lambda: _timm("beit_base_patch16_224", embed_dim=64, depth=2, num_heads=2, img_size=32),
        "olmoe": lambda: hf("olmoe", num_experts=4, num_experts_per_tok=2, **moe),
    })
    return reg


def _timm(name: str, **kw) -> nn.Module:
    import timm
    from tiny_models import randomize_norms

    torch.manual_seed(0)
    return randomize_norms(timm.create_model(name, pretrained=False, num_classes=10, **kw))


def group_of(name: str) -> str:
    return next((g for g, names in GROUPS.items() if name in names), "other")


def _call(model: nn.Module, probe):
    if isinstance(probe, dict):
        return model(**probe)
    if isinstance(probe, (tuple, list)):
        return model(*probe)
    return model(probe)


def measure(build: Callable[[], nn.Module], mode: str) -> dict:
    """One family in one mode: {'saved': fraction | None, 'error': str | None, 'verification', 'skips'}."""
    from lmbp_convert import convert
    from lmbp_convert.trace.probe import make_probe

    row: dict = {"saved": None, "error": None, "verification": "", "skips": []}
    try:
        model = build()
        if mode == "bf16":
            model = model.to(torch.bfloat16)
        model.train()
        probe, _, _ = make_probe(model)
        ac = mode == "autocast"

        def fwd(m):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
                return _call(m, probe)

        torch.manual_seed(0)
        before = C.ledger_bytes(lambda: fwd(model), model)
        convert(model)
        rep = model.lmbp_report
        row["verification"] = str(rep.verification.value if hasattr(rep.verification, "value") else rep.verification)
        row["skips"] = [f"{s.name}: {s.reason}" for s in rep.plan.skips]
        model.train()
        torch.manual_seed(0)
        after = C.ledger_bytes(lambda: fwd(model), model)
        row["saved"] = 1 - after / before if before else 0.0
    except Exception as e:  # a row per failure: the table shows it
        row["error"] = C.err(e)
    return row


def run(names: list[str], modes: list[str]) -> dict[str, dict[str, dict]]:
    reg = registry()
    return {n: {m: measure(reg[n], m) for m in modes} for n in names}


def table(results: dict[str, dict[str, dict]], modes: list[str]) -> str:
    rows = []
    for name, per in results.items():
        cells = []
        for m in modes:
            r = per[m]
            cells.append(f"error: {r['error'][:160]}" if r["error"] else f"{100 * r['saved']:.1f} %")
        ver = "; ".join(sorted({per[m]["verification"] for m in modes if per[m]["verification"]}))
        low = [r for r in per.values() if not r["error"] and r["saved"] < 0.2]
        why = "; ".join(r[:160] for r in low[0]["skips"][:2]).replace("|", "/") if low else ""
        rows.append([name, group_of(name), *[c.replace("|", "/") for c in cells], ver, why])
    return C.markdown_table(["family", "group", *modes, "verification", "skip reasons (< 20 %)"], rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="*", default=None)
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    p.add_argument("--out", default=None, help="write the markdown table here (e.g. docs/coverage.md)")
    a = p.parse_args(argv)
    names = a.families or list(registry())
    t0 = time.time()
    res = run(names, a.modes)
    secs = time.time() - t0
    md = table(res, a.modes)
    counts = {m: sum(1 for r in res.values() if not r[m]["error"] and r[m]["saved"] >= 0.2) for m in a.modes}
    head = (f"# Conversion coverage\n\n`python -m benchmarks.coverage {' '.join(argv or sys.argv[1:])}`\n\n"
            f"{C.machine()}; {len(res)} families; saves >= 20 %: "
            + ", ".join(f"{m} {c}" for m, c in counts.items()) + f"; {secs:.0f} s\n\n")
    print(head + md)
    if a.out:
        with open(a.out, "w") as f:
            f.write(head + md + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
