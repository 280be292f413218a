"""Plain-PyTorch reference of the approximate-backprop activations (lmbp_convert/ops/approx_act.py), straight
from the constants: the exact forward of the original module, and the backward grad · f'_step(x), where
f'_step(x) = Σ a_i over the thresholds c_i below x. Tests compare the op and converted models against it."""
from __future__ import annotations

import torch
from torch import nn

from lmbp_convert.ops.approx_act import get_constants


def step_derivative(x: torch.Tensor, kind: str, bits: int) -> torch.Tensor:
    """f'(x) = sum of a_i over thresholds c_i < x, in float64, straight from the constants."""
    const = get_constants(kind, bits)
    xd = x.double()
    d = torch.zeros_like(xd)
    for a, c in zip(const.a, const.c):
        d = d + a * (xd > c).double()
    return d


class StepBackward(nn.Module):
    """``module``'s forward, bit for bit; its backward grad · f'_step(x) (``slope``: a hook to replace the step
    derivative, so a test can show that a wrong one fails)."""

    def __init__(self, module: nn.Module, kind: str, bits: int, slope=step_derivative) -> None:
        super().__init__()
        self.module, self.kind, self.bits, self.slope = module, kind, bits, slope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.module(x.detach())
        s = self.slope(x.detach(), self.kind, self.bits).to(x.dtype)
        return y + (x * s - (x * s).detach())  # value: y exactly (the added term is 0); d/dx: s


def with_step_backward(model: nn.Module, swaps, slope=step_derivative) -> nn.Module:
    """``model`` (unconverted) with each module a conversion swapped for an approximate activation (``swaps``: the
    plan's ActSwap items, names and kinds) wrapped in `StepBackward`."""
    for it in swaps:
        parent_name, _, leaf = it.name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, leaf, StepBackward(getattr(parent, leaf), it.act, it.bits, slope))
    return model
