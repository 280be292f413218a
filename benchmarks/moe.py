"""Saved-for-backward bytes of MoE blocks at real sizes: the norm before the experts plus the sparse MoE layer of a
transformers ≥ 5 decoder layer (router + experts held as 3-D parameters, shared expert where the family has one),
with its residual, original vs convert(), in bf16 and in bf16 autocast (fp32 weights), on one forward in training
mode (exact ledger bytes, `lmbp_convert.SavedTensorLedger`; device-independent). The plan is made on a short probe;
bytes are counted at ``--seq`` tokens.

    python -m benchmarks.moe                       # Mixtral 8×(4096→14336) top-2, Qwen3-MoE 128×(2048→768) top-8
    python -m benchmarks.moe --models mixtral --experts 2 --seq 64
"""
from __future__ import annotations

import argparse
import importlib
import time

import torch
from torch import nn
from transformers import AutoConfig

from lmbp_convert import convert
from lmbp_convert.match.doors import fold_past_doors
from lmbp_convert.match.moe import RecomputeRegion

from . import common as C

#: real hidden / expert sizes (Mixtral-8x7B, Qwen3-30B-A3B)
SHAPES = {
    "mixtral": dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                    num_attention_heads=32, num_key_value_heads=8),
    "qwen3_moe": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=128, decoder_sparse_step=1,
                      mlp_only_layers=[]),
}
EXPERTS_KEY = {"mixtral": "num_local_experts", "qwen3_moe": "num_experts"}


class MoEBlock(nn.Module):
    """``x + moe(norm(x))``: the second half of a decoder layer (its modules, under their own names)."""

    def __init__(self, norm: nn.Module, mlp: nn.Module):
        super().__init__()
        self.post_attention_layernorm, self.mlp = norm, mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp(self.post_attention_layernorm(x))
        return x + (out[0] if isinstance(out, tuple) else out)


def build(arch: str, dtype: torch.dtype, experts: int | None = None, small: dict | None = None,
          impl: str = "grouped_mm") -> MoEBlock:
    """The family's decoder layer 0 (built from its config), reduced to its MoE half, with cheap random weights."""
    from transformers import AutoModelForCausalLM

    kw = dict(SHAPES[arch], num_hidden_layers=1, vocab_size=256, **(small or {}))
    if experts:
        kw[EXPERTS_KEY[arch]] = experts
    cfg = AutoConfig.for_model(arch, **kw)
    cfg._experts_implementation = impl
    module = importlib.import_module(AutoModelForCausalLM._model_mapping[type(cfg)].__module__)
    layer_cls = next(getattr(module, n) for n in dir(module) if n.endswith("DecoderLayer"))
    with torch.device("meta"):
        layer = layer_cls(cfg, 0)
    block = MoEBlock(layer.post_attention_layernorm, layer.mlp).to_empty(device="cpu").to(dtype)
    return C.cheap_init(block).train()


def saved(block: nn.Module, x: torch.Tensor, autocast: bool) -> int:
    def fwd():
        with C.autocast_ctx("cpu", autocast):
            return block(x)

    block.train()
    return C.ledger_bytes(fwd, block)


def measure(arch: str, mode: str, seq: int, experts: int | None = None, small: dict | None = None,
            impl: str = "grouped_mm") -> dict:
    """One row: original and converted bytes of the block on ``seq`` tokens (converted in place: one copy of the
    weights in memory)."""
    autocast = mode == "autocast"
    dtype = torch.float32 if autocast else torch.bfloat16
    block = build(arch, dtype, experts, small, impl)
    hidden = block.post_attention_layernorm.weight.shape[0]
    # the residual stream inside a network needs a gradient (it comes from earlier layers)
    x = torch.randn(1, seq, hidden, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_(True)
    t0 = time.perf_counter()
    before = saved(block, x, autocast)
    probe = x[:, : min(seq, 32)].detach().clone()
    # the folds into the experts are what this shows (planned past the doors, as the checkpoint CLI plans: the
    # block is converted as the whole model, so its own frame would keep them exact); outside autocast, as one
    # converts before training (fp32 weights, then autocast)
    with fold_past_doors():
        convert(block, probe=probe, fold_norms=True)
    report = block.lmbp_report
    after = saved(block, x, autocast)
    row = {"model": arch, "mode": mode, "impl": impl, "seq": seq, "experts": experts or SHAPES[arch][EXPERTS_KEY[arch]],
           "original": before, "converted": after, "less": 1 - after / before,
           "folded": [t.label for f in report.plan.norm_folds for t in f.targets],
           "regions": [r.name for r in report.plan.of(RecomputeRegion)], "verified": report.verified,
           "seconds": round(time.perf_counter() - t0, 1)}
    del block
    C.free()
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--modes", nargs="+", choices=["bf16", "autocast"], default=["bf16", "autocast"])
    ap.add_argument("--impls", nargs="+", choices=["grouped_mm", "eager", "batched_mm"], default=["grouped_mm"],
                    help="how transformers runs the experts (its default: grouped_mm)")
    ap.add_argument("--seq", type=int, default=512, help="tokens (batch 1)")
    ap.add_argument("--experts", type=int, default=None,
                    help="fewer experts than the real model (the bytes do not depend on it: every token is routed "
                         "to top-k experts whatever their number); default: the real count")
    ap.add_argument("--json", default=None, help="also write the rows here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None, small: dict | None = None) -> list[dict]:
    args = parse_args(argv)
    print(C.machine())
    print("| block | mode | experts impl | tokens | original | converted | less |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for arch in args.models:
        for impl in args.impls:
            for mode in args.modes:
                r = measure(arch, mode, args.seq, args.experts, small, impl)
                rows.append(r)
                print(f"| {arch} ({r['experts']} experts) | {mode} | {impl} | {r['seq']} | {r['original']:,} B | "
                      f"{r['converted']:,} B | {r['less']:.1%} |", flush=True)
                C.save_json(args.json, {"machine": C.machine(), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
