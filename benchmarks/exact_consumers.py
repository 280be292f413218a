"""Saved-for-backward bytes of the families whose norms feed functional consumers or are channel-first (timm
ConvNeXt, BEiT, EVA02, PVT-v2; `testsupport.families`): the original model, ``fold_norms=True`` (the affine folded
into the consumers' parameters) and the exact default (``fold_norms=False``: every original parameter kept), one
training forward each under `lmbp_convert.SavedTensorLedger`, in fp32, bf16 weights and fp32 weights under bf16
autocast. Norm affines are randomised first, so verification sees a wrong fold. Activations off (their bytes are
the same in both conversions), so the difference is the norms'.

    python -m benchmarks.exact_consumers [--families timm_convnext timm_beit timm_eva02 timm_pvt_v2]
"""
from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from lmbp_convert import convert
from lmbp_convert.errors import NothingToConvertError
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.trace.tracer import call_model

from . import common as C
from .consumers import randomized
from testsupport.families import registry

FAMILIES = ("timm_convnext", "timm_beit", "timm_eva02", "timm_pvt_v2")
MODES = ("fp32", "bf16", "autocast")


def _bf16(probe):
    if torch.is_tensor(probe):
        return probe.bfloat16() if probe.is_floating_point() else probe
    if isinstance(probe, dict):
        return {k: _bf16(v) for k, v in probe.items()}
    return type(probe)(_bf16(v) for v in probe) if isinstance(probe, (list, tuple)) else probe


def saved(model: nn.Module, probe, mode: str) -> int:
    """Ledger bytes of one training forward of ``model`` on ``probe`` in ``mode``."""
    m = copy.deepcopy(model).train()
    if mode == "bf16":
        m = m.bfloat16()
        probe = _bf16(probe)

    def fwd():
        with C.autocast_ctx("cpu", mode == "autocast"):
            return call_model(m, probe)

    return C.ledger_bytes(fwd, m)


def row(family: str) -> dict:
    """Bytes per mode of the original, the fold and the exact default, with each conversion's verification."""
    torch.manual_seed(0)
    base = randomized(registry()[family]()).eval()
    probe = make_probe(base)[0]
    out = {"family": family, "original": {k: saved(base, probe, k) for k in MODES}}
    for label, fold in (("fold", True), ("exact", False)):
        m = copy.deepcopy(base)
        try:
            convert(m, activations=False, fold_norms=fold, measure=False)
        except NothingToConvertError:  # every norm left as it is
            out[label], out[f"{label}_verified"], out[f"{label}_inexact"] = out["original"], True, []
            continue
        rep = m.lmbp_report
        out[label] = {k: saved(m, probe, k) for k in MODES}
        out[f"{label}_verified"], out[f"{label}_inexact"] = rep.verified, sorted(rep.inexact_training)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    found = []
    for fam in args.families:
        r = row(fam)
        cells = "  ".join(f"{k} {r['original'][k]} / {r['fold'][k]} / {r['exact'][k]}" for k in MODES)
        print(f"{fam:14s} original / fold / exact bytes: {cells}  inexact in training: fold "
              f"{len(r['fold_inexact'])}, exact {len(r['exact_inexact'])}", flush=True)
        found.append(r)
    return found


if __name__ == "__main__":
    main()
