"""Saved-for-backward bytes of small encoders whose gated MLPs sit behind identity ops (T5 v1.1 / UMT5 gated-gelu,
ModernBERT GeGLU, timm EVA02's GluMlp and SwiGLU with an inner norm): the original model, convert() without the
gated swap (``gated_mlp=False``: what convert() did before it walked through Dropout / Identity) and a plain
convert(), each in training mode on one forward (`lmbp_convert.SavedTensorLedger`), fp32 and bf16, with the MLP
dropout at 0 and (text models) 0.1.

    python -m benchmarks.gated_identity --models t5 umt5 modernbert eva02_tiny eva02_base_swiglu_norm
"""
from __future__ import annotations

import argparse
import copy

import timm
import torch
import transformers as T
from transformers import AutoConfig

from lmbp_convert import convert
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.trace.tracer import call_model

from . import common as C


def t5(kind, p):
    cfg = AutoConfig.for_model(kind, d_model=256, d_ff=1024, d_kv=32, num_heads=8, num_layers=2, vocab_size=256,
                               feed_forward_proj="gated-gelu", dropout_rate=p)
    return (T.T5EncoderModel if kind == "t5" else T.UMT5EncoderModel)(cfg)


def modernbert(p):
    cfg = AutoConfig.for_model("modernbert", hidden_size=256, intermediate_size=1152, num_hidden_layers=2,
                               num_attention_heads=4, vocab_size=256, global_attn_every_n_layers=1, local_attention=64,
                               pad_token_id=0, eos_token_id=1, bos_token_id=2, cls_token_id=2, sep_token_id=1,
                               mlp_dropout=p)
    return T.AutoModel.from_config(cfg)


MODELS = {
    "t5": lambda p: t5("t5", p), "umt5": lambda p: t5("umt5", p), "modernbert": modernbert,
    "eva02_tiny": lambda p: timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=56, depth=2),
    "eva02_base_swiglu_norm": lambda p: timm.create_model("eva02_base_patch14_224", pretrained=False, img_size=56,
                                                          depth=2, embed_dim=192, num_heads=3),
}


def saved(model, probe) -> int:
    model.train()
    return C.ledger_bytes(lambda: call_model(model, probe), model)


def rows(name: str, seq: int = 128, image: int = 56) -> list[dict]:
    """One row per (MLP dropout, dtype): original bytes, convert(gated_mlp=False), plain convert()."""
    out = []
    for p in ([0.0, 0.1] if not name.startswith("eva") else [0.0]):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            base = MODELS[name](p).to(dtype)
            if name.startswith("eva"):
                probe = torch.randn(2, 3, image, image, dtype=dtype)
            else:
                probe = make_probe(base, batch=2, seq=seq)[0]
            row = {"model": name, "p": p, "dtype": str(dtype)[6:], "original": saved(base, probe)}
            for label, kw in (("no_gated", dict(gated_mlp=False)), ("full", {})):
                m = convert(copy.deepcopy(base).eval(), **kw)
                row[label] = saved(m, probe)
                row["gated_mlps"] = len(m.lmbp_report.plan.gated_mlps)
            out.append(row)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--seq", type=int, default=128, help="text probe length")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    found = []
    for name in args.models:
        for r in rows(name, args.seq):
            o = r["original"]
            print(f"{name:24s} p={r['p']} {r['dtype']:9s} orig {o:>10d}  no-gated {r['no_gated']:>10d} "
                  f"({1 - r['no_gated'] / o:6.1%})  full {r['full']:>10d} ({1 - r['full'] / o:6.1%})  "
                  f"gated MLPs={r['gated_mlps']}", flush=True)
            found.append(r)
    return found


if __name__ == "__main__":
    main()
