"""Train-mode verification with a backward: one training forward on a fixed RNG draw, then the gradient of a
fixed random weighting of its outputs with respect to the trainable parameters.

A rewrite can pass every forward check and still break training: autograd raises at backward when a tensor it
saved was modified in place (a router multiplying its input by jitter noise in train mode, where that input is a
memory-sharing norm's saved output), or an op's backward fails on its own. Only a backward sees that, so the
train-mode checks run one, on the original (for its gradients) and on the converted model (for its failure and,
where every applied rewrite claims exact training, its gradients against the original's).

Nothing of the model changes: ``torch.autograd.grad`` returns the gradients without accumulating into ``.grad``;
requires_grad is set for the run only when no parameter has it (on the floating-point vectors: `_trainable`) and
put back; the RNG is forked and seeded, buffers a training forward
updates are put back, every module's training flag is restored (`verify.run_probe_train`'s guards); the
modules' backward hooks are held back for the run and put back (the same entries, in order: their handles still
remove them), so a user's gradient hook does not fire for convert()'s check.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from ..trace.device import training_mode
from ..trace.tracer import OUT_OF_MEMORY, call_model
from .verify import _buffers_kept, _nonfinite_mismatch, _seeded, float_tensors

__all__ = ["TrainRun", "gradient_error", "run_train_step"]


@dataclass(frozen=True)
class TrainRun:
    """One training forward + backward. ``output`` is detached; ``grads`` (parameter name → gradient, None for
    a parameter the scalar does not reach) only when asked for and the backward ran; ``failure``: what the
    backward raised, for people ("RuntimeError: ..."; None: it ran, or there was nothing to differentiate)."""

    output: Any
    grads: dict[str, torch.Tensor | None] | None = None
    failure: str | None = None


@contextmanager
def _backward_hooks_held(model: nn.Module) -> Iterator[None]:
    """Every module's backward hooks and backward pre-hooks out of their dicts for the check, then back."""
    held = [(d, dict(d)) for m in model.modules() for d in (m._backward_hooks, m._backward_pre_hooks) if d]
    try:
        for d, _ in held:
            d.clear()
        yield
    finally:
        for d, entries in held:
            d.clear()
            d.update(entries)


@contextmanager
def _trainable(model: nn.Module) -> Iterator[list[tuple[str, nn.Parameter]]]:
    """The parameters the backward differentiates: those that require grad; when none does (a frozen model
    converted before PEFT adds adapters), the floating-point vectors (norm weights, biases: every layer has some,
    so the backward still runs through each, for a few bytes of gradient where lifting every matrix would hold
    a second model's worth), else every floating-point parameter; requires_grad is put back afterwards."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    lifted: list[nn.Parameter] = []
    if not params:
        floats = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]
        params = [(n, p) for n, p in floats if p.dim() <= 1] or floats
        lifted = [p for _, p in params]
    try:
        for p in lifted:
            p.requires_grad_(True)
        yield params
    finally:
        for p in lifted:
            p.requires_grad_(False)


def _weights(outputs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """A fixed random weight per output element (the same for the original and the converted model: drawn from a
    private generator, not the caller's stream), zero where the output is not finite. A plain sum would make
    degenerate gradients (the sum of a normalised row does not depend on its input)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in outputs:
        w = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(device=t.device, dtype=t.dtype)
        out.append(torch.where(torch.isfinite(t.detach()), w, torch.zeros((), dtype=t.dtype, device=t.device)))
    return out


def run_train_step(model: nn.Module, probe: Any, seed: int, keep_grads: bool) -> TrainRun:
    """The model's training forward on ``probe`` on RNG seed ``seed``, then one backward; model state, ``.grad``s
    and the caller's RNG unchanged. The forward's own exceptions propagate; the backward's are returned as
    ``failure`` (out-of-memory propagates: the machine's limit, not the rewrite's)."""
    with training_mode(model, True), torch.enable_grad(), _seeded(model, seed), _buffers_kept(model), \
            _backward_hooks_held(model), _trainable(model) as params:
        out = call_model(model, probe)
        outputs = [t for t in float_tensors(out) if t.requires_grad]
        detached = _detached(out)
        if not outputs or not params:  # nothing in the output depends on a trainable tensor
            return TrainRun(detached)
        try:
            grads = torch.autograd.grad(outputs, [p for _, p in params], grad_outputs=_weights(outputs, seed),
                                        allow_unused=True)
        except OUT_OF_MEMORY:
            raise
        except Exception as exc:  # noqa: BLE001 - autograd's failure is the verdict, carried as data
            return TrainRun(detached, None, _said(exc))
        del outputs, out
        if not keep_grads:
            return TrainRun(detached)
        return TrainRun(detached, {n: g for (n, _), g in zip(params, grads)})


def _said(exc: BaseException, limit: int = 200) -> str:
    """The exception for the report: its type and the start of its message (autograd's run long)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text if len(text) <= limit else text[:limit].rstrip() + '…'}"


def _detached(obj: Any) -> Any:
    """``obj`` with every tensor detached (the comparison reads values only; the graph is freed by the backward)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, dict):
        return type(obj)({k: _detached(v) for k, v in obj.items()}) if type(obj) is dict else _detached_mapping(obj)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_detached(v) for v in obj)
    return obj


def _detached_mapping(obj: Any) -> Any:
    """A dict subclass (transformers' ModelOutput): its tensors detached in place of the copy's items."""
    for k in list(obj.keys()):
        obj[k] = _detached(obj[k])
    return obj


def gradient_error(grads: dict[str, torch.Tensor | None], reference: dict[str, torch.Tensor | None]
                   ) -> float | None:
    """‖g − g_ref‖ / ‖g_ref‖ over the parameters both have (exact rewrites keep the names; a parameter the
    converted model no longer has is not compared), as one vector, a gradient the scalar no longer reaches
    counting as zeros: a per-parameter ratio would be rounding noise over noise where the exact gradient is zero
    (attention key biases). As for outputs (`verify.compare_outputs`): the finite reference values are compared,
    non-finite ones must match exactly (else inf), and None when nothing finite is left to compare."""
    num = den = 0.0
    compared = 0
    for name, ref in reference.items():
        if ref is None or name not in grads:
            continue
        got = grads[name]
        r = ref.detach().double()
        g = torch.zeros_like(r) if got is None else got.detach().double()
        if g.shape != r.shape or _nonfinite_mismatch(g, r):
            return math.inf
        finite = torch.isfinite(r)
        compared += int(finite.sum())
        num += float(((g - r)[finite] ** 2).sum())
        den += float((r[finite] ** 2).sum())
    if compared == 0:
        return None
    if not math.isfinite(num) or not math.isfinite(den):
        return math.inf
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)
