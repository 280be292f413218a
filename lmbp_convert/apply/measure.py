"""The bytes a conversion saves, measured: one training forward on the probe under `SavedTensorLedger`, before
the first rewrite and after verification, in the mode the model will train in.

An analytic prediction per rewrite cannot know what the rest of the step keeps (PEFT's copies, autocast's casts,
dropout's masks, what two rewrites share), so the report's headline is this measurement and says its mode: the
weights' dtype, autocast if convert() runs inside it (call it inside the autocast the training uses), train mode
(dropout active), how many parameters train, and activation checkpointing where it is on. Nothing of the model
changes: the random state is forked (dropout draws, LayerDrop), buffers a training forward updates (BatchNorm
statistics) are restored, every module's training flag is put back.

Checkpointed layers (HF ``gradient_checkpointing_enable``, timm ``set_grad_checkpointing``, `checkpoint_for_budget`)
keep only their inputs in the forward and save the rest while each is recomputed in backward, where the rewrites
act: the ledger does not see that, so where checkpointing is on the same forward is measured again with it off
(`checkpointing_off`: the flags flipped for that forward, then put back), which is what the rewrites change there.
"""
from __future__ import annotations

from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ..memory import SavedTensorLedger
from ..trace.device import training_mode
from ..trace.tracer import call_model

__all__ = ["Checkpointing", "Measured", "checkpointing", "checkpointing_off", "describe_inputs", "measure_saved"]


@dataclass
class Measured:
    bytes: int
    mode: str


def _tensor_text(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
    return type(t).__name__


def describe_inputs(probe: Any) -> str:
    """The probe as the report names it: each input's shape and dtype (``input_ids (2, 8) int64``)."""
    if isinstance(probe, dict):
        return ", ".join(f"{k} {_tensor_text(v)}" for k, v in probe.items() if v is not None)
    if isinstance(probe, (list, tuple)):
        return ", ".join(f"arg {i} {_tensor_text(v)}" for i, v in enumerate(probe))
    return f"a tensor {_tensor_text(probe)}"


@dataclass(frozen=True)
class Checkpointing:
    """Activation checkpointing a training forward of the model runs with: by what (``how``), on which modules."""

    how: str
    modules: tuple[str, ...]

    def describe(self) -> str:
        n = len(self.modules)
        return f"{self.how} on {n} module{'s' if n != 1 else ''}"


def _hf_layer_class() -> type | None:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except Exception:  # noqa: BLE001 - older transformers: the model's own loop checkpoints its layers
        return None
    return GradientCheckpointingLayer


def _flagged(model: nn.Module, attr: str) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if getattr(m, attr, None) is True]


def checkpointing(model: nn.Module) -> list[Checkpointing]:
    """What checkpoints the model's layers in a training forward: HF's gradient checkpointing (the layers' flag;
    on an older transformers the model's own), timm's ``grad_checkpointing``, `lmbp_convert.checkpoint_for_budget`."""
    from ..budget import _CheckpointedForward  # (budget imports the ledger only)

    found = []
    hf = _flagged(model, "gradient_checkpointing")
    if hf:
        layer = _hf_layer_class()
        layers = [n for n, m in hf if layer is not None and isinstance(m, layer)]
        found.append(Checkpointing("HF gradient checkpointing", tuple(layers or [n for n, _ in hf])))
    timm = _flagged(model, "grad_checkpointing")
    if timm:
        found.append(Checkpointing("timm grad_checkpointing", tuple(n for n, _ in timm)))
    budget = [n for n, m in model.named_modules() if isinstance(m.__dict__.get("forward"), _CheckpointedForward)]
    if budget:
        found.append(Checkpointing("checkpoint_for_budget", tuple(budget)))
    return found


@contextmanager
def checkpointing_off(model: nn.Module) -> Iterator[None]:
    """The model's activation checkpointing (`checkpointing`) off for the block, then exactly as it was."""
    from ..budget import _CheckpointedForward

    attrs = [(m, "gradient_checkpointing") for _, m in _flagged(model, "gradient_checkpointing")]
    attrs += [(m, "grad_checkpointing") for _, m in _flagged(model, "grad_checkpointing")]
    forwards = [(m, m.__dict__["forward"]) for m in model.modules()
                if isinstance(m.__dict__.get("forward"), _CheckpointedForward)]
    try:
        for m, attr in attrs:
            setattr(m, attr, False)
        for m, _ in forwards:
            del m.__dict__["forward"]
        yield
    finally:
        for m, attr in attrs:
            setattr(m, attr, True)
        for m, fwd in forwards:
            m.__dict__["forward"] = fwd


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
    parts += [f"{c.describe()} (see below)" for c in checkpointing(model)]
    return ", ".join(parts)


def measure_saved(model: nn.Module, probe: Any, autocast: Sequence[tuple[str, torch.dtype]] = (), *,
                  checkpoints: bool = True) -> Measured:
    """Exact saved-for-backward bytes of one training-mode forward of ``model`` on ``probe`` (parameters and
    autocast's weight casts excluded), leaving the model as it was; under ``autocast`` ((device type, dtype)
    pairs: what was active around convert(), which analyses outside it). ``checkpoints=False``: with the model's
    activation checkpointing off for that forward (`checkpointing_off`)."""
    if not checkpoints:
        with checkpointing_off(model):
            return measure_saved(model, probe, autocast)
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
