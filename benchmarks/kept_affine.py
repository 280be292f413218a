"""Saved-for-backward bytes of models whose norms cannot fold their affine (post-LN with the residual add in the
layer's own forward: BART, Marian, HuBERT, wav2vec2, DistilBERT; a tied head: OPT's final norm) and of one that
can (BERT, which must not regress): the original, convert(keep_affine=False) (what convert() did before the
affine-keeping norm) and a plain convert(), in fp32, bf16 and bf16 autocast (an fp32 model), one training forward
each (`lmbp_convert.SavedTensorLedger`, dropout off); plus the fp32 gradient error of the converted model against
the original (max over parameters and inputs of ‖Δ‖/‖ref‖).

    python -m benchmarks.kept_affine --models bart marian hubert wav2vec2 distilbert opt bert
"""
from __future__ import annotations

import argparse
import contextlib
import copy

import torch
import transformers as T

from lmbp_convert import convert
from lmbp_convert.errors import NothingToConvertError
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.trace.tracer import call_model

from . import common as C

_SEQ2SEQ = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=128, max_position_embeddings=64, pad_token_id=1,
                bos_token_id=0, eos_token_id=2, decoder_start_token_id=1, dropout=0.0, attention_dropout=0.0,
                activation_dropout=0.0)
_ENC = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
_SPEECH = dict(_ENC, conv_dim=(32, 32), conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=16,
               num_conv_pos_embedding_groups=2, vocab_size=32, hidden_dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0)


def _hf(auto: str, arch: str, **kw):
    return getattr(T, auto).from_config(T.AutoConfig.for_model(arch, **kw))


MODELS = {
    "bart": lambda: _hf("AutoModelForSeq2SeqLM", "bart", **_SEQ2SEQ),
    "marian": lambda: _hf("AutoModelForSeq2SeqLM", "marian", **_SEQ2SEQ),
    "hubert": lambda: _hf("AutoModel", "hubert", **_SPEECH),
    "wav2vec2": lambda: _hf("AutoModel", "wav2vec2", **_SPEECH),
    "distilbert": lambda: _hf("AutoModel", "distilbert", dim=64, hidden_dim=128, n_layers=2, n_heads=4, vocab_size=128,
                              dropout=0.0, attention_dropout=0.0),
    "opt": lambda: _hf("AutoModelForCausalLM", "opt", hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                       num_attention_heads=4, vocab_size=128, max_position_embeddings=64, word_embed_proj_dim=64,
                       dropout=0.0, do_layer_norm_before=True),
    "bert": lambda: _hf("AutoModelForMaskedLM", "bert", **_ENC, vocab_size=128, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0),
}


def trained_like(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Norm γ, β as a fine-tuned model has them (γ around 1 with spread, β of a few tenths), not the identity."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.LayerNorm) and mod.weight is not None:
                mod.weight.copy_(1 + 0.3 * torch.randn(mod.weight.shape, generator=gen))
                if mod.bias is not None:
                    mod.bias.copy_(0.3 * torch.randn(mod.bias.shape, generator=gen))
    return model


def _ctx(mode: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()


def saved(model, probe, mode: str) -> int:
    model.train()
    with _ctx(mode):
        return C.ledger_bytes(lambda: call_model(model, probe), model)


def _loss(out) -> torch.Tensor:
    from lmbp_convert.apply.verify import float_tensors

    return sum(t.float().pow(2).mean() for t in float_tensors(out))


def grad_error(ref, conv, probe) -> float:
    """max over parameters (by name) of ‖g_conv − g_ref‖/‖g_ref‖, fp32, training mode; the
    parameters a fold rewrote (folded norms and their Linears: another parameterisation) are left out, and those
    whose reference gradient is at the rounding-noise floor (below 1e-5 of the largest)."""
    rewritten = set()
    for it in conv.lmbp_report.plan.items:
        if it.tag == "norm_folds":
            rewritten |= {it.name, *(t.name for t in it.targets)}
    errs = []
    grads = []
    for m in (ref, conv):
        m.train()
        m.zero_grad()
        _loss(call_model(m, probe)).backward()
        grads.append({k: v.grad.clone() for k, v in m.named_parameters() if v.grad is not None})
    floor = 1e-5 * max(float(g.norm()) for g in grads[0].values())
    for k, gr in grads[0].items():
        gc = grads[1].get(k)
        if k.rsplit(".", 1)[0] in rewritten or float(gr.norm()) <= floor:
            continue  # zero in exact arithmetic (a key projection's bias under softmax): rounding noise only
        if gc is None:
            raise AssertionError(f"{k} got no gradient in the converted model")
        errs.append(float((gc - gr).norm() / gr.norm()))
    return max(errs) if errs else float("nan")


def rows(name: str, seq: int) -> list[dict]:
    out = []
    for mode in ("fp32", "bf16", "autocast"):
        torch.manual_seed(0)
        base = trained_like(MODELS[name]()).eval()
        if mode == "bf16":
            base = base.to(torch.bfloat16)
        probe = make_probe(base, batch=2, seq=seq)[0]
        row = {"model": name, "mode": mode, "original": saved(base, probe, mode)}
        # the fold's fallback is what this measures: the exact default replaces the kept-affine norm altogether
        for label, kw in (("old", dict(keep_affine=False, fold_norms=True)), ("new", dict(fold_norms=True))):
            m = convert(copy.deepcopy(base), **kw)
            row[label] = saved(m, probe, mode)
            row[f"{label}_kept"] = len([it for it in m.lmbp_report.plan.items if it.tag == "norm_keeps"])
            if mode == "fp32":  # exact rewrites only: approx-BP activations change gradients by design
                try:
                    exact = convert(copy.deepcopy(base), activations=False, **kw)
                    row[f"{label}_grad_err"] = grad_error(base, exact, probe)
                except NothingToConvertError:
                    row[f"{label}_grad_err"] = float("nan")  # nothing exact to convert
        out.append(row)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--seq", type=int, default=64, help="text probe length")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    found = []
    for name in args.models:
        for r in rows(name, args.seq):
            o = r["original"]
            g = (f"  grad err old {r['old_grad_err']:.1e} new {r['new_grad_err']:.1e}"
                 if "new_grad_err" in r else "")
            print(f"{name:11s} {r['mode']:9s} orig {o:>9d}  old {r['old']:>9d} ({1 - r['old'] / o:6.1%})  "
                  f"new {r['new']:>9d} ({1 - r['new'] / o:6.1%})  kept-affine norms {r['new_kept']}{g}", flush=True)
            found.append(r)
    return found


if __name__ == "__main__":
    main()
