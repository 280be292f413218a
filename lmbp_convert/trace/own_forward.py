"""When no probe would help: the model's own forward fails in the mode convert() traces in.

The trace and the verification run the model in eval mode under ``torch.no_grad()``. A model whose forward fails
there on every input — while the same input runs in train mode — is not refusing the probe: one of its modules
refuses what the model's own layers hand it in inference (bitsandbytes' CPU 4-bit kernel, for one, repacks its
weight for inference in blocks of output features: a width its blocks do not divide fails in eval mode only). Then
"pass probe=" would send the user looking for an input that does not exist: `own_forward_failure` tells it apart
(one train-mode forward on the same input) and names the module that raised.
"""
from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from ..errors import TraceError
from .tracer import OUT_OF_MEMORY, call_model

__all__ = ["own_forward_failure"]


def _devices(model: nn.Module) -> list[int]:
    return sorted({t.device.index or 0 for t in [*model.parameters(), *model.buffers()] if t.device.type == "cuda"})


def _runs_in_train_mode(model: nn.Module, inputs: Any) -> bool:
    """Whether a training forward (train mode, grad enabled) takes ``inputs``; the model is left as it was (flags,
    buffers, the RNG)."""
    flags = [(m, m.training) for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers() if b.device.type != "meta"]
    try:
        model.train()
        with torch.random.fork_rng(devices=_devices(model)), torch.enable_grad():
            out = call_model(model, inputs)
        del out
        return True
    except OUT_OF_MEMORY:
        raise
    except Exception:  # noqa: BLE001 - it fails in training too: nothing to tell apart
        return False
    finally:
        for m, t in flags:
            m.training = t
        with torch.no_grad():
            for b, saved in buffers:
                if b.shape == saved.shape:
                    b.copy_(saved)


def _failing_module(model: nn.Module, inputs: Any) -> tuple[str, nn.Module] | None:
    """The innermost module running when the eval-mode forward under no_grad raises (None: it did not raise)."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    stack: list[nn.Module] = []
    flags = [(m, m.training) for m in model.modules()]

    def enter(mod: nn.Module, _args: Any) -> None:
        stack.append(mod)

    def leave(_mod: nn.Module, _args: Any, _out: Any) -> None:  # (returns None: the output stays the module's)
        if stack:
            stack.pop()

    with ExitStack() as hooks:
        for m in model.modules():
            hooks.callback(m.register_forward_pre_hook(enter).remove)
            hooks.callback(m.register_forward_hook(leave).remove)
        try:
            model.eval()
            with torch.no_grad(), torch.random.fork_rng(devices=_devices(model)):
                call_model(model, inputs)
            return None
        except OUT_OF_MEMORY:
            raise
        except Exception:  # noqa: BLE001 - the failure being located
            if not stack:
                return None
            mod = stack[-1]
            return names.get(id(mod), "?") or "<model>", mod
        finally:
            for m, t in flags:
                m.training = t


def own_forward_failure(model: nn.Module, inputs: Any, error: BaseException, tried: str) -> TraceError | None:
    """The error to raise where the model's eval-mode forward under no_grad failed with ``error`` on ``inputs``
    (``tried``: what those are, "every probe built from its config and signature (8 tried)"), and a training
    forward takes them: its own forward fails, no probe would help. None: a training forward fails too (the
    input may be at fault: the caller's own error stands)."""
    if any(p.device.type == "meta" for p in model.parameters()) or not _runs_in_train_mode(model, inputs):
        return None
    where = _failing_module(model, inputs)
    at, hint = "", ""
    if where is not None:
        name, mod = where
        at = f" in {name} ({type(mod).__module__}.{type(mod).__qualname__})"
        packed = next((t for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]
                       if not t.is_floating_point()), None)
        if packed is not None:
            hint = (f"; its weight is stored as {packed.dtype} (quantized), and a quantized Linear's inference "
                    "kernel may need a layer width its blocks divide (bitsandbytes' CPU 4-bit path repacks the "
                    "weight in blocks of output features)")
    return TraceError(
        f"{type(model).__name__}'s own forward fails in eval mode under torch.no_grad(), the mode convert() traces "
        f"and verifies in, on {tried}, and runs on the same input in train mode: no probe would help. It raised "
        f"{type(error).__name__}: {error}{at}{hint}. The model cannot be evaluated that way either (an evaluation "
        "loop or generate() runs it so): fix its inference forward (another layer width, device or quantization), "
        "then convert()")
