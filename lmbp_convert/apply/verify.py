"""Compare a model's outputs on the probe with reference outputs (eval mode, no grad)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from ..trace.tracer import call_model


def _float_tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _float_tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _float_tensors(v, out)
    return out


def default_rtol(model: nn.Module) -> float:
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes & {torch.float16, torch.bfloat16}:
        return 5e-2
    return 1e-4


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Run in eval mode, then put every module's own training flag back."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, t in flags:
            m.training = t


def run_probe(model: nn.Module, probe: Any) -> Any:
    with eval_mode(model), torch.no_grad():
        return call_model(model, probe)


def relative_error(out: Any, ref: Any) -> float:
    """max over output tensors of ‖out − ref‖ / ‖ref‖ (inf on a shape mismatch or a new nan)."""
    a, b = _float_tensors(out, []), _float_tensors(ref, [])
    if len(a) != len(b):
        return float("inf")
    worst = 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape:
            return float("inf")
        x, y = x.detach().double(), y.detach().double()
        if (torch.isnan(x) != torch.isnan(y)).any():
            return float("inf")
        mask = ~torch.isnan(y)
        num = torch.linalg.vector_norm((x - y)[mask])
        den = torch.linalg.vector_norm(y[mask]).clamp_min(1e-30)
        worst = max(worst, float(num / den))
    return worst
