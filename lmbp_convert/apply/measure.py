"""The bytes a conversion saves, measured: one training forward on the probe under `SavedTensorLedger`, before
the first rewrite and after verification, in the mode the model will train in.

An analytic prediction per rewrite cannot know what the rest of the step keeps (PEFT's copies, autocast's casts,
dropout's masks, what two rewrites share), so the report's headline is this measurement and says its mode: the
weights' dtype, autocast if convert() runs inside it (call it inside the autocast the training uses), train mode
(dropout active), how many parameters train. Nothing of the model changes: the random state is forked (dropout
draws, LayerDrop), buffers a training forward updates (BatchNorm statistics) are restored, every module's
training flag is put back.
"""
from __future__ import annotations

from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from ..memory import SavedTensorLedger
from ..trace.device import training_mode
from ..trace.tracer import call_model

__all__ = ["Measured", "measure_saved"]


@dataclass
class Measured:
    bytes: int
    mode: str


def _mode(model: nn.Module) -> str:
    params = list(model.parameters())
    dtypes: Counter = Counter()
    for p in params:
        if p.is_floating_point():
            dtypes[str(p.dtype).replace("torch.", "")] += p.numel()
    device = params[0].device.type if params else "cpu"
    parts = [f"{dtypes.most_common(1)[0][0]} weights" if dtypes else "no weights"]
    if torch.is_autocast_enabled(device if device != "meta" else "cpu"):
        parts.append(f"autocast {str(torch.get_autocast_dtype(device)).replace('torch.', '')}")
    drops = sum(1 for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0)
    parts.append("train mode" + (f" ({drops} dropout module(s) active)" if drops else ""))
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    parts.append("all parameters trainable" if trainable == total else f"{trainable:,} of {total:,} parameters "
                 "trainable")
    return ", ".join(parts)


def measure_saved(model: nn.Module, probe: Any, autocast: Sequence[tuple[str, torch.dtype]] = ()) -> Measured:
    """Exact saved-for-backward bytes of one training-mode forward of ``model`` on ``probe`` (parameters and
    autocast's weight casts excluded), leaving the model as it was; under ``autocast`` ((device type, dtype)
    pairs: what was active around convert(), which analyses outside it)."""
    buffers = [(b, b.detach().clone()) for b in model.buffers() if b.device.type != "meta"]
    devices = sorted({b.device.index or 0 for b, _ in buffers if b.device.type == "cuda"} |
                     {p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with training_mode(model, True), ExitStack() as amp, torch.random.fork_rng(devices=devices), \
                torch.enable_grad():
            for dev, dtype in autocast:
                amp.enter_context(torch.autocast(dev, dtype=dtype))
            mode = _mode(model)
            with SavedTensorLedger(model) as led:
                out = call_model(model, probe)
            del out
        return Measured(led.bytes, mode)
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                if b.shape == saved.shape:
                    b.copy_(saved)
