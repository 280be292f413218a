"""Demo on an embedded default: a tiny LLaMA-style model (config shipped with the package, random weights, no
network) is converted, trained for one step, and its activation memory is counted before and after.

    python -m lmbp_convert.demo [--seq 256] [--batch 4] [--autocast]
"""
from __future__ import annotations

import argparse
import json
import logging
from importlib import resources

import torch


def _saved_bytes(model, ids, autocast: bool) -> int:
    from .memory import SavedTensorLedger

    with SavedTensorLedger(model) as ledger:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    return ledger.bytes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--autocast", action="store_true", help="bf16 CPU autocast")
    args = ap.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers import AutoConfig, AutoModelForCausalLM

    from . import convert

    cfg_dict = json.loads(resources.files("lmbp_convert").joinpath("data/demo_config.json").read_text())
    cfg = AutoConfig.for_model(**cfg_dict)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # give the norms a non-trivial affine, as a trained model has
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    before = _saved_bytes(model, ids, args.autocast)

    report = convert(model).lmbp_report
    print(report)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    after = _saved_bytes(model, ids, args.autocast)
    mode = "bf16 autocast" if args.autocast else "fp32"
    print(f"\none training step done, loss {loss.item():.4f}")
    print(f"activation memory saved for backward ({mode}, batch {args.batch} × seq {args.seq}, "
          f"{cfg.num_hidden_layers} layers):")
    print(f"  original : {before / 2**20:8.2f} MiB")
    print(f"  converted: {after / 2**20:8.2f} MiB  ({100 * (1 - after / before):.1f} % less)")


if __name__ == "__main__":
    main()
