"""Tiny sharded checkpoints for the checkpoint tests: built from configs, with random non-trivial norm affines."""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

logging.getLogger("transformers").setLevel(logging.ERROR)

SPECS = {
    # model_type: (config overrides, auto class name)
    "llama": (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=96, tie_word_embeddings=False), "AutoModelForCausalLM"),
    "gemma": (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, vocab_size=96), "AutoModelForCausalLM"),  # (1+w), tied
    "gpt2": (dict(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=64, bos_token_id=0,
                  eos_token_id=0), "AutoModelForCausalLM"),  # Conv1D, tied head
    "bert": (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=96), "AutoModelForMaskedLM"),  # post-LN
}
EXTRA_FILES = {"tokenizer.json": '{"version": "1.0"}\n', "README.md": "# tiny\n", "special_tokens_map.json": "{}\n"}


def auto_class(arch: str):
    import transformers

    return getattr(transformers, SPECS[arch][1])


def build_model(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    from transformers import AutoConfig

    kw, _ = SPECS[arch]
    cfg = AutoConfig.for_model(arch, **{**kw, **overrides})
    torch.manual_seed(seed)
    model = auto_class(arch).from_config(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # fresh norms are the identity: make them not, so that a wrong fold shows
        for mod in model.modules():
            if "norm" not in type(mod).__name__.lower():
                continue
            w, b = getattr(mod, "weight", None), getattr(mod, "bias", None)
            if isinstance(w, torch.Tensor):
                base = 0.0 if arch == "gemma" else 0.5  # Gemma scales by 1 + w
                w.copy_(torch.rand(w.shape, generator=gen) + base)
            if isinstance(b, torch.Tensor):
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))
    return model.to(dtype).eval()


def save_model(model, path: Path, max_shard_size: str = "20KB") -> Path:
    model.save_pretrained(path, max_shard_size=max_shard_size)
    for name, text in EXTRA_FILES.items():
        (path / name).write_text(text)
    return path


def tree_hash(path: Path) -> dict[str, str]:
    """Relative path → sha256 of every file under ``path`` (or of the file itself)."""
    if path.is_file():
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def leftovers(parent: Path) -> list[str]:
    """Temporary files the converter might have left beside DST."""
    if not parent.is_dir():
        return []
    return [p.name for p in parent.iterdir() if ".lmbp-tmp-" in p.name or ".lmbp-old-" in p.name]
