"""Per-block saved-for-backward bytes, shared by the tests and the benchmarks.

A model's block list is cut to its first ``n`` blocks (the same module objects) so that one block's bytes are the
whole model's minus the shorter model's: embeddings, head and loss cancel. The counts are exact
(``lmbp_convert.SavedTensorLedger``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

__all__ = ["block_list", "truncated", "ledger_bytes", "layers_owner", "block_bytes"]


def block_list(model: nn.Module) -> nn.Module:
    """The model's list of blocks: timm's ``blocks``, LLaMA-style ``layers`` or BERT's ``encoder.layer``."""
    if hasattr(model, "blocks"):  # timm
        return model.blocks
    if hasattr(model, "layers"):  # LLaMA-style
        return model.layers
    return model.encoder.layer  # BERT


def _set_blocks(model: nn.Module, blocks: nn.Module) -> None:
    if hasattr(model, "blocks"):
        model.blocks = blocks
    elif hasattr(model, "layers"):
        model.layers = blocks
    else:
        model.encoder.layer = blocks


@contextlib.contextmanager
def truncated(model: nn.Module, n: int) -> Iterator[nn.Module]:
    """The model with only its first ``n`` blocks (the same module objects), restored on exit."""
    full = block_list(model)
    short = type(full)(*list(full)[:n]) if isinstance(full, nn.Sequential) else nn.ModuleList(list(full)[:n])
    _set_blocks(model, short)
    try:
        yield model
    finally:
        _set_blocks(model, full)


def ledger_bytes(fn: Callable[[], object], params=None) -> int:
    """Exact saved-for-backward bytes of ``fn()`` (``lmbp_convert.SavedTensorLedger``: unique storages kept for
    backward; the parameters of ``params``, a module or a list, and their autocast casts excluded)."""
    from lmbp_convert import SavedTensorLedger

    with SavedTensorLedger(params) as led:
        out = fn()
    del out
    return led.bytes


def layers_owner(m: nn.Module) -> nn.Module:
    """The LlamaModel inside PEFT's and the causal LM's wrappers (it holds ``layers``)."""
    for mod in m.modules():
        if hasattr(mod, "layers") and isinstance(mod.layers, nn.ModuleList):
            return mod
    raise RuntimeError("no decoder layer list found")


def block_bytes(m: nn.Module, ids: torch.Tensor) -> int:
    """Exact saved-for-backward bytes of one decoder block of a causal LM (with labels): the whole model with L
    blocks minus L - 1."""
    inner = layers_owner(m)
    full = ledger_bytes(lambda: m(input_ids=ids, labels=ids, use_cache=False), m)
    with truncated(inner, len(inner.layers) - 1):
        short = ledger_bytes(lambda: m(input_ids=ids, labels=ids, use_cache=False), m)
    return full - short
