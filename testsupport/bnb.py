"""Real bitsandbytes 4-bit on CPU, where it runs: its CPU backend ships in the index's wheels since 0.48.

`cpu_4bit_problem` says why it cannot run here (None: it can), so a test skips with that reason instead of
quietly testing something else; `load_4bit` loads a checkpoint with 4-bit NF4 projections on CPU.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(None)
def cpu_4bit_problem() -> str | None:
    """None when bitsandbytes imports and a 4-bit Linear runs forward and backward on CPU, else why not."""
    try:
        import bitsandbytes as bnb
    except Exception as exc:  # noqa: BLE001 - not installed, or its wheel does not load here
        return (f"bitsandbytes is not importable ({type(exc).__name__}: {exc}); its CPU backend installs from the "
                "index with `pip install 'bitsandbytes>=0.48'` (the test extra)")
    try:
        lin = bnb.nn.Linear4bit(32, 32, bias=False, compute_dtype=torch.float32, quant_type="nf4")
        lin = lin.to("cpu")
        lin.weight = bnb.nn.Params4bit(torch.randn(32, 32), requires_grad=False, quant_type="nf4").to("cpu")
        x = torch.randn(2, 32, requires_grad=True)
        lin(x).sum().backward()
    except Exception as exc:  # noqa: BLE001 - an old bitsandbytes (CUDA only) or a CPU it has no kernel for
        return (f"bitsandbytes {getattr(bnb, '__version__', '?')} has no working CPU 4-bit backend here "
                f"({type(exc).__name__}: {exc})")
    return None


def load_4bit(path, dtype: torch.dtype = torch.float32):
    """``from_pretrained(path)`` with NF4 4-bit projections on CPU (compute in ``dtype``)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, device_map={"": "cpu"}, dtype=dtype)
