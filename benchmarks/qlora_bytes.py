"""Saved-for-backward bytes per LLaMA block in the QLoRA flow, on CPU: fold on disk, load, quantize, convert, LoRA.

    python -m benchmarks.qlora_bytes                 # fp32 and bf16; the stand-in, and bitsandbytes if importable
    python -m benchmarks.qlora_bytes --quant standin --dtype bf16

Flow per row: a LLaMA-shaped model from a config (random weights, norm gains in U(0.5, 1.5)), ``save_pretrained``
(SRC) → ``lmbp-convert SRC DST`` (in process) → load DST → 4-bit projections (``testsupport.quant_standin``'s
Packed4bitLinear, or bitsandbytes' Linear4bit through ``BitsAndBytesConfig``, which runs on CPU since 0.48) →
``convert()`` → PEFT LoRA (r 8 on q/k/v/o/gate/up/down, dropout 0) → exact saved bytes of one block
(SavedTensorLedger: L blocks minus L - 1). The baseline is plain QLoRA on SRC (no lmbp-convert).
"""
from __future__ import annotations

import argparse
import tempfile
import warnings

import torch

from benchmarks import common as C
from testsupport.blocks import block_bytes
from testsupport.quant_standin import quantize_linears

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_source(path: str, dtype: torch.dtype, layers: int = 2) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=256, intermediate_size=704, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                               tie_word_embeddings=False)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).to(dtype)
    with torch.no_grad():
        for mod in m.modules():
            if "norm" in type(mod).__name__.lower():
                mod.weight.uniform_(0.5, 1.5)
    m.save_pretrained(path)


def load(path: str, dtype: torch.dtype, quant: str):
    from transformers import AutoModelForCausalLM

    kw: dict = {"dtype": dtype}
    if quant == "bnb":
        from transformers import BitsAndBytesConfig

        kw["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_compute_dtype=dtype)
        kw["device_map"] = {"": "cpu"}
    m = AutoModelForCausalLM.from_pretrained(path, **kw)
    return quantize_linears(m, TARGETS) if quant == "standin" else m


def lora(m):
    import peft

    cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(TARGETS), task_type="CAUSAL_LM")
    return peft.get_peft_model(m, cfg).train()


def measure(dtype_name: str, quant: str, log=print) -> dict:
    from lmbp_convert import cli, convert

    dtype = DTYPES[dtype_name]
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as work:
        src, dst = f"{work}/src", f"{work}/dst"
        make_source(src, dtype)
        if cli.main([src, dst, "--no-progress", "-q"]) != 0:
            raise RuntimeError("lmbp-convert failed")
        base = lora(load(src, dtype, quant))
        plain = block_bytes(base, ids)
        m = load(dst, dtype, quant)
        rep = convert(m).lmbp_report
        ours = block_bytes(lora(m), ids)
    row = {"dtype": dtype_name, "quant": quant, "qlora": plain, "ours": ours,
           "report": rep.counts()}
    log(f"  {dtype_name:<5} {quant:<8} QLoRA {plain:>9} B  lmbp-convert + QLoRA {ours:>9} B  "
        f"({C.pct(ours, plain)})  [{row['report']}]")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), action="append")
    ap.add_argument("--quant", choices=("standin", "bnb"), action="append")
    a = ap.parse_args(argv)
    C.quiet()
    warnings.filterwarnings("ignore")
    quants = a.quant or ["standin"]
    if a.quant is None:
        try:
            import bitsandbytes  # noqa: F401

            quants.append("bnb")
        except Exception as e:
            print(f"(bitsandbytes not importable: {C.err(e)}; stand-in only)")
    torch.set_num_threads(1)
    print("saved bytes per LLaMA block (hidden 256, intermediate 704, batch 2 × 64 tokens, LoRA r 8)")
    for q in quants:
        for d in a.dtype or ["fp32", "bf16"]:
            measure(d, q)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
