"""Where the tensors of a conversion live: on the model's device, whatever default device is in effect.

Inside ``with torch.device("meta"):`` a factory call without ``device=`` makes a meta tensor; a CPU model
converted there would get meta probes and fail ("Cannot copy out of meta tensor"). Tensors made by this package
name their device; the model's own forward (probe, verification) runs with the model's device as the default,
as it would outside such a block.
"""
from __future__ import annotations

import functools
from contextlib import ExitStack, contextmanager
from typing import Callable, Iterator, TypeVar

import torch
from torch import nn

F = TypeVar("F", bound=Callable)


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); CPU for a model without tensors."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


@contextmanager
def on_model_device(model: nn.Module) -> Iterator[None]:
    """Make the model's device the default device while converting, if another non-CPU default is in effect
    (the process default, CPU, is left alone: a model's forward is run as the user would run it)."""
    ambient = torch.get_default_device()
    dev = model_device(model) if isinstance(model, nn.Module) else ambient
    if ambient.type == "cpu" or ambient == dev:
        yield
        return
    with torch.device(dev):
        yield


def keeps_model_device(fn: F) -> F:
    """Decorator for entry points whose first argument is the model: run them ``on_model_device``."""

    @functools.wraps(fn)
    def wrapper(model, *args, **kwargs):
        with on_model_device(model):
            return fn(model, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


#: device types whose autocast state convert() looks at (those a model of this package can run on)
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


@contextmanager
def outside_autocast() -> Iterator[list[tuple[str, torch.dtype]]]:
    """Turn off any active ``torch.autocast`` inside the block; yields what was active, as (device type, dtype).

    Why: verification compares the converted model with the original at the tolerance of the weights' dtype.
    Under autocast both run in bf16 / fp16, and the fold's exact reparameterisation (W·diag(γ)) rounds
    differently there, so most rewrites failed that comparison and were rolled back (5 of 7 on a tiny LLaMA,
    all 5 of a tiny T5's): the saving was lost for rounding the original has too. Analysed in the weights' dtype they
    all verify, and the converted model, run under autocast later, adapts to it itself (outputs the autocast
    dtype, so memory sharing holds)."""
    active = []
    with ExitStack() as stack:
        for dev in _AUTOCAST_DEVICES:
            try:
                on = torch.is_autocast_enabled(dev)
            except (RuntimeError, ValueError):  # a device type this build does not know
                continue
            if on:
                active.append((dev, torch.get_autocast_dtype(dev)))
                stack.enter_context(torch.autocast(dev, enabled=False))
        yield active


@contextmanager
def training_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """Run ``model`` in train (True) or eval (False) mode, then put every module's own training flag back (a model
    may hold modules in mixed modes)."""
    flags = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, t in flags:
            m.training = t
