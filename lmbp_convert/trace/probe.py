"""Build a small input the model accepts, from its own config (HF) or pretrained_cfg (timm)."""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..errors import ProbeError


def _device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    for p in model.parameters():
        if p.is_floating_point():
            return p.device, p.dtype
    for b in model.buffers():
        return b.device, torch.float32
    return torch.device("cpu"), torch.float32


# Every tensor made here is drawn on the CPU (seeded) and then moved to the model's device: an ambient default
# device (``with torch.device("meta"):``) must not decide where a probe of a CPU model lives.


def _first(cfg: Any, *names: str, default=None):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def _accepts(model: nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def make_probe(model: nn.Module, batch: int = 2, seq: int = 8) -> tuple[Any, int, str]:
    """Return (probe, count, unit): the input, and how many tokens/images it holds (for per-token figures)."""
    device, dtype = _device_dtype(model)
    get_base = getattr(model, "get_base_model", None)  # PEFT wrappers: the input is the base model's
    if callable(get_base):
        model = get_base()
    cfg = getattr(model, "config", None)
    main = getattr(model, "main_input_name", None)
    if cfg is not None and main == "input_ids":
        vocab = _first(cfg, "vocab_size") or _first(getattr(cfg, "text_config", None), "vocab_size")
        if not vocab:
            raise ProbeError(f"{type(model).__name__}: config has no vocab_size; pass probe=...")
        max_pos = _first(cfg, "max_position_embeddings", "n_positions", default=seq)
        n = max(2, min(seq, max_pos))
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (batch, n), generator=gen, device="cpu").to(device)
        probe = {"input_ids": ids}
        if device.type == "meta" and getattr(cfg, "use_cache", None) is False and _accepts(model, "use_cache"):
            # Without a cache, transformers checks the position ids for packed sequences, a data-dependent test a
            # meta tensor cannot answer; a cache changes no module's consumers, so the meta trace asks for one.
            probe["use_cache"] = True
        return probe, batch * n, "token"
    if cfg is not None and main == "pixel_values":
        vcfg = getattr(cfg, "vision_config", None) or cfg
        size = _first(vcfg, "image_size", default=224)
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        chans = _first(vcfg, "num_channels", default=3)
        x = torch.randn(batch, chans, *size, generator=torch.Generator().manual_seed(0), device="cpu").to(device, dtype)
        return {"pixel_values": x}, batch, "image"
    pcfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None)
    if isinstance(pcfg, dict) and pcfg.get("input_size"):
        size = tuple(pcfg["input_size"])
        img = getattr(model, "patch_embed", None)
        if img is not None and getattr(img, "img_size", None):  # timm models built with a non-default size
            size = (size[0], *tuple(img.img_size))
        x = torch.randn(batch, *size, generator=torch.Generator().manual_seed(0), device="cpu").to(device, dtype)
        return x, batch, "image"
    raise ProbeError(
        f"cannot build a probe input for {type(model).__name__} (not a Hugging Face text/vision model nor a "
        "timm model with pretrained_cfg['input_size']); pass probe=... (a tensor, a tuple of positional "
        "args or a dict of keyword args the model accepts)"
    )
