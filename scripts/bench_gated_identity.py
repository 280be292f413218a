"""Saved-for-backward bytes of small encoders whose gated MLPs sit behind identity ops (T5 v1.1 / UMT5 gated-gelu,
ModernBERT GeGLU, timm EVA02's GluMlp and SwiGLU with an inner norm): the original model, convert() without the
gated swap (``gated_mlp=False``: what convert() did before it walked through Dropout / Identity) and a plain
convert(), each in training mode on one forward (`lmbp_convert.SavedTensorLedger`), fp32 and bf16, with the MLP
dropout at 0 and (text models) 0.1.

    python scripts/bench_gated_identity.py t5,umt5,modernbert,eva02_tiny,eva02_base_swiglu_norm
"""
import copy
import sys

import timm
import torch
import transformers as T
from transformers import AutoConfig

from lmbp_convert import SavedTensorLedger, convert
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.trace.tracer import call_model


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
    with SavedTensorLedger(model) as led:
        call_model(model, probe)
    return led.bytes


def main(names: list[str]) -> None:
    torch.manual_seed(0)
    for name in names:
        for p in ([0.0, 0.1] if not name.startswith("eva") else [0.0]):
            for dtype in (torch.float32, torch.bfloat16):
                base = MODELS[name](p).to(dtype)
                if name.startswith("eva"):
                    probe = torch.randn(2, 3, 56, 56, dtype=dtype)
                else:
                    probe = make_probe(base, batch=2, seq=128)[0]
                orig = saved(base, probe)
                res, n_gated = {}, 0
                for label, kw in (("no_gated", dict(gated_mlp=False)), ("full", {})):
                    m = copy.deepcopy(base).eval()
                    _, rep = convert(m, return_report=True, **kw)
                    res[label] = saved(m, probe)
                    n_gated = len(rep.plan.gated_mlps)
                print(f"{name:24s} p={p} {str(dtype)[6:]:9s} orig {orig:>10d}  "
                      f"no-gated {res['no_gated']:>10d} ({1 - res['no_gated'] / orig:6.1%})  "
                      f"full {res['full']:>10d} ({1 - res['full'] / orig:6.1%})  gated MLPs={n_gated}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else list(MODELS))
