"""LoRA adapters that share their layer's input instead of keeping private copies of it.

PEFT's LoRA Linear casts its input to each adapter's dtype (fp32 by default: ``autocast_adapter_dtype``) and runs
``lora_A(dropout(x))``: every adapter keeps its own cast copy (and, with ``lora_dropout`` > 0, the dropout's mask
as a tensor of the input's size on CPU, and the dropped copy). Found by structure (the catalogue's LoRA entries: PEFT's
LoRA Linear and its bitsandbytes 4-/8-bit forms): a LoRA layer the probe calls, with an adapter whose dtype is wider than the layer's
input or whose dropout is active. The rewrite (`LoraInputShare`) notes the layer's input in the model-wide
shared-saves region (`lmbp_convert.ops.shared_saves`) and swaps each active ``lora_dropout`` for `BitDropout`
(same draws, a 1-bit mask): the adapters' saved inputs become recipes over the kept input. Nothing else changes:
same parameters, same state-dict keys, same adapter outputs; merging and saving adapters are untouched.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from ..catalogue import class_key, load_catalogue
from .context import MatchContext, tensor_bytes
from .plan import PlanItem, Skip

__all__ = ["LoraInputShare", "match_lora_inputs"]


@dataclass
class LoraInputShare(PlanItem):
    """A LoRA layer whose adapters rebuild their (cast, dropped) input from the layer's input in backward."""

    tag = "lora_inputs"
    noun = "LoRA layers (input shared)"
    noun_one = "LoRA layer (input shared)"
    heading = "LoRA layers → adapters share the layer's input (no private fp32 copies)"

    adapters: list[str] = field(default_factory=list)
    dropouts: list[str] = field(default_factory=list)  # adapters whose lora_dropout becomes a bit-mask dropout
    dropout_attr: str = "lora_dropout"
    predicted_saved_bytes: int = 0

    def claims(self) -> set[str]:
        return {self.name} | {f"{self.name}.{self.dropout_attr}.{a}" for a in self.dropouts}

    def describe(self) -> list[str]:
        drop = f"; dropout as 1-bit masks: {', '.join(self.dropouts)}" if self.dropouts else ""
        return [f"  {self.name}: adapters {', '.join(self.adapters)}{drop}"]


def _dropout_p(m: nn.Module) -> float | None:
    """p of a plain nn.Dropout (not a subclass with its own forward), else None."""
    return float(m.p) if type(m) is nn.Dropout and not m.inplace else None


def match_lora_inputs(ctx: MatchContext) -> Iterator[LoraInputShare | Skip]:
    """Every LoRA layer the catalogue knows, whatever its base (a Linear, a quantized Linear: the adapters' copies
    do not depend on it)."""
    if not ctx.opt.lora_inputs:
        return
    cat = load_catalogue()
    idle: list[tuple[str, str]] = []  # (adapter dtype, input dtype) of LoRA layers with nothing to share
    shared = 0
    for name, mod in ctx.modules.items():
        lora = cat.lora_entry(mod)
        if lora is None or name in ctx.claimed or not ctx.opt.selected(name):
            continue
        nodes = ctx.g.module_nodes(name)
        if len(nodes) != 1 or not nodes[0].inputs:
            continue
        tid = nodes[0].inputs[0]
        numel, in_bytes = tensor_bytes(ctx.g, tid)
        in_size = in_bytes // max(numel, 1)
        adapters_a, drops = getattr(mod, lora.adapters_a), getattr(mod, lora.dropout)
        adapters, dropouts, saved = [], [], 0
        dtypes = set()
        for adapter, a in adapters_a.items():
            w = getattr(a, "weight", None)
            if not isinstance(w, torch.Tensor) or not w.requires_grad:
                continue
            dtypes.add(str(w.dtype).replace("torch.", ""))
            p = _dropout_p(drops[adapter]) if adapter in drops else None
            copy = w.element_size() > in_size
            if p is not None and p > 0:
                dropouts.append(adapter)
                # the dropped copy, and the mask (a tensor of the input's size on CPU) down to 1 bit an element
                saved += numel * w.element_size() + numel * w.element_size() - (numel + 7) // 8
            elif copy:
                saved += numel * w.element_size()
            else:
                continue
            adapters.append(adapter)
        if not adapters:
            if dtypes:
                idle.append((", ".join(sorted(dtypes)), ctx.g.tensors[tid].dtype))
            continue
        shared += 1
        yield LoraInputShare(name, class_key(mod), adapters, dropouts, lora.dropout, saved)
    if idle:
        ctx.notes.append(_nothing_to_share(idle, shared))


def _nothing_to_share(idle: list[tuple[str, str]], shared: int) -> str:
    """Why LoRA layers got no `LoraInputShare`: their adapters keep no private copy of the input."""
    n = len(idle)
    of = f"{n} of {n + shared}" if shared else str(n)
    pairs = sorted(set(idle))
    what = "; ".join(f"adapters in {a} on a {i} input" for a, i in pairs)
    return (f"LoRA inputs: nothing to share in {of} LoRA layer{'s' if n != 1 else ''} ({what}, no active "
            "lora_dropout): no adapter keeps a private copy of its input, which only adapters wider than the input "
            "(fp32 adapters on bf16 weights) or an active dropout make")
