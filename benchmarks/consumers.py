"""Saved-for-backward bytes of small models whose norms feed functional consumers (match/consumers.py): timm
EVA02 / EVA / BEiT (F.linear on ``qkv.weight`` with a bias assembled in forward), SigLIP vision with its
attention-pool head and nn.TransformerEncoder (pre-LN) (nn.MultiheadAttention's in_proj), timm PVT-v2 (a channel-first
view into the spatial-reduction conv), timm ConvNeXt and HF ConvNext (channel-first LayerNorms into 1×1 / strided
convs). For each: the original model, convert(fold_norms=True) without the consumer matcher (what it did before), with
it (both planned past the doors, `fold_past_doors`, as the checkpoint CLI plans: this measures the folds
themselves, including those ``convert(fold_norms=True)`` keeps exact because a door could see them), and the exact
default convert() (no parameter folded), one forward each (`lmbp_convert.SavedTensorLedger`), in fp32, bf16 weights and bf16 autocast, with
convert()'s verification error.

    python -m benchmarks.consumers --models eva beit siglip transformer_encoder pvt_v2_b0 convnext_atto
"""
from __future__ import annotations

import argparse
import contextlib
import copy

import torch
from torch import nn

from lmbp_convert import convert
from lmbp_convert.match.kinds import suspended
from lmbp_convert.match.consumers import ConsumerFold
from lmbp_convert.match.doors import fold_past_doors

from . import common as C


def _timm(name, **kw):
    import timm

    return timm.create_model(name, pretrained=False, num_classes=10, **kw)


def _siglip():
    from transformers import SiglipVisionConfig, SiglipVisionModel

    cfg = SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             image_size=32, patch_size=8)
    return SiglipVisionModel(cfg)


def _hf_convnext():
    from transformers import ConvNextConfig, ConvNextModel

    return ConvNextModel(ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1]))


def _encoder():
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True, norm_first=True,
                                       activation="gelu")
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


_VIT = dict(img_size=32, patch_size=8, depth=2)
#: name → (builder, input shape)
MODELS = {
    "eva02_tiny": (lambda: _timm("eva02_tiny_patch14_224", **_VIT), (2, 3, 32, 32)),
    "eva": (lambda: _timm("eva_giant_patch14_224", embed_dim=64, num_heads=4, **_VIT), (2, 3, 32, 32)),
    "beit": (lambda: _timm("beit_base_patch16_224", embed_dim=64, num_heads=4, **_VIT), (2, 3, 32, 32)),
    "siglip": (_siglip, (2, 3, 32, 32)),
    "transformer_encoder": (_encoder, (2, 16, 64)),
    "pvt_v2_b0": (lambda: _timm("pvt_v2_b0"), (2, 3, 64, 64)),
    "convnext_atto": (lambda: _timm("convnext_atto"), (2, 3, 64, 64)),
    "hf_convnext": (_hf_convnext, (2, 3, 64, 64)),
}
MODES = ("fp32", "bf16", "autocast")


def randomized(model: nn.Module) -> nn.Module:
    """Non-trivial norm affines (fresh ones are the identity), so a wrong fold shows in verification."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for mod in model.modules():
            w, b = getattr(mod, "weight", None), getattr(mod, "bias", None)
            if "norm" in type(mod).__name__.lower() and isinstance(w, torch.Tensor) and w.dim() == 1:
                w.copy_(torch.rand(w.shape, generator=gen) + 0.5)
                if isinstance(b, torch.Tensor):
                    b.copy_(0.5 * torch.randn(b.shape, generator=gen))
    return model


@contextlib.contextmanager
def without_consumer_folds():
    """convert() as it was before functional consumers: its kind suspended."""
    with suspended(ConsumerFold):
        yield


def saved(model: nn.Module, x: torch.Tensor, mode: str) -> int:
    m, x = copy.deepcopy(model), x
    if mode == "bf16":
        m, x = m.bfloat16(), x.bfloat16()

    def fwd():
        with C.autocast_ctx("cpu", mode == "autocast"):
            out = m(x)
        return out if isinstance(out, torch.Tensor) else out[0]

    return C.ledger_bytes(fwd, m)


def row(name: str) -> dict:
    build, shape = MODELS[name]
    torch.manual_seed(0)
    base = randomized(build()).eval()
    x = torch.randn(*shape)
    out = {"model": name, "original": {k: saved(base, x, k) for k in MODES}}
    with fold_past_doors():
        with without_consumer_folds():
            before = convert(copy.deepcopy(base), probe=x, fold_norms=True)
        after = convert(copy.deepcopy(base), probe=x, fold_norms=True)
    exact = convert(copy.deepcopy(base), probe=x)  # the default: exact norms, every original parameter kept
    for label, m in (("before", before), ("after", after), ("exact", exact)):
        rep = m.lmbp_report
        out[label] = {k: saved(m, x, k) for k in MODES}
        out[f"{label}_error"] = rep.relative_error
        out[f"{label}_verified"] = rep.verified
    out["consumer_folds"] = len(after.lmbp_report.plan.of(ConsumerFold))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    found = []
    for name in args.models:
        r = row(name)
        o = r["original"]
        cells = "  ".join(f"{k} {1 - r['before'][k] / o[k]:6.1%} → {1 - r['after'][k] / o[k]:6.1%} "
                          f"(exact {1 - r['exact'][k] / o[k]:6.1%})" for k in MODES)
        print(f"{name:20s} saved: {cells}  consumer folds={r['consumer_folds']}  verification error "
              f"{r['before_error']:.1e} → {r['after_error']:.1e}", flush=True)
        found.append(r)
    return found


if __name__ == "__main__":
    main()
