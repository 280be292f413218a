"""Tiny random-init models of the families the walker must convert (no network: built from configs)."""
from __future__ import annotations

import logging

import torch
from torch import nn

logging.getLogger("transformers").setLevel(logging.ERROR)

# Real models' MLP ratios: 4× for BERT/ViT/CLIP/GPT-2, 11008/4096 ≈ 2.69× for LLaMA-style gated MLPs.
HF_SMALL = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)


def randomize_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial γ, β so that a wrong fold shows (fresh norms are the identity)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if "norm" not in type(mod).__name__.lower():
                continue
            w = getattr(mod, "weight", None)
            b = getattr(mod, "bias", None)
            if isinstance(w, torch.Tensor) and w.dim() == 1:
                w.copy_((torch.rand(w.shape, generator=gen) + 0.5).to(w.dtype))
            if isinstance(b, torch.Tensor) and b.dim() == 1:
                b.copy_((0.5 * torch.randn(b.shape, generator=gen)).to(b.dtype))
    return model


def hf(arch: str, head: str = "causal", **overrides) -> nn.Module:
    """A tiny ``arch`` model; the test is skipped where the installed transformers predates the family (the
    compat stage runs the oldest release pyproject.toml allows; the main suite's release knows every family)."""
    import transformers
    from transformers import (CONFIG_MAPPING, AutoConfig, AutoModel, AutoModelForCausalLM,
                              AutoModelForSequenceClassification)

    if arch not in CONFIG_MAPPING:
        import pytest

        pytest.skip(f"transformers {transformers.__version__} has no model type {arch!r} (a later family)")
    kw = dict(HF_SMALL)
    if arch == "gpt2":
        kw = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64)
    if arch in ("gemma",):
        kw.update(head_dim=16, num_key_value_heads=2)
    if arch in ("llama", "mistral", "qwen2", "gemma"):
        kw.update(intermediate_size=172)
    if arch in ("llama", "mistral", "qwen2"):
        kw.update(num_key_value_heads=2, tie_word_embeddings=False)
    if arch == "vit":
        kw.update(image_size=32, patch_size=8)
    kw.update(overrides)
    cfg = AutoConfig.for_model(arch, **kw)
    cls = {"causal": AutoModelForCausalLM, "base": AutoModel, "cls": AutoModelForSequenceClassification}[head]
    torch.manual_seed(0)
    return randomize_norms(cls.from_config(cfg))


def clip_vision() -> nn.Module:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    cfg = CLIPVisionConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8)
    return randomize_norms(CLIPVisionModel(cfg))


def timm_vit() -> nn.Module:
    import timm

    torch.manual_seed(0)
    return randomize_norms(timm.create_model("vit_base_patch16_224", pretrained=False, depth=2, embed_dim=64,
                                             num_heads=4, img_size=32, patch_size=8, num_classes=10))


def timm_swin() -> nn.Module:
    import timm

    torch.manual_seed(0)
    return randomize_norms(timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 1, 1, 1),
                                             embed_dim=32, num_heads=(1, 1, 1, 1), num_classes=10))


FAMILIES = {
    "llama": lambda: hf("llama"),
    "mistral": lambda: hf("mistral"),
    "qwen2": lambda: hf("qwen2"),
    "gemma": lambda: hf("gemma"),
    "gpt2": lambda: hf("gpt2"),
    "bert": lambda: hf("bert", head="cls"),
    "roberta": lambda: hf("roberta", head="cls", max_position_embeddings=66),
    "vit": lambda: hf("vit", head="base"),
    "clip_vision": clip_vision,
    "timm_vit": timm_vit,
    "timm_swin": timm_swin,
}
