"""Drop-in activation module with approximate backprop (see ``lmbp_convert.ops.approx_act``)."""
from __future__ import annotations

import torch
from torch import nn

from ..enums import ConvertedModule
from ..ops.approx_act import ACT_BITS, ACT_KINDS, approx_act_unchecked
from ..ops.relu_squared import relu_squared

__all__ = ["ACT_KINDS", "ApproxActivation", "MSReLUSquared", "OUTPUT_KINDS"]


class ApproxActivation(ConvertedModule, nn.Module):
    """Exact ``kind`` activation whose backward stores a ``bits``-bit code per element instead of the input.

    Replaces nn.GELU / nn.GELU(approximate="tanh") / nn.SiLU / QuickGELU one-for-one: same forward output,
    no parameters or buffers, so a converted model's state_dict is unchanged.
    """

    def __init__(self, kind: str, bits: int = 2) -> None:
        super().__init__()
        if kind not in ACT_KINDS:
            raise ValueError(f"unknown activation kind {kind!r}; expected one of {', '.join(ACT_KINDS)}")
        if not isinstance(bits, int) or isinstance(bits, bool) or bits not in ACT_BITS:
            raise ValueError(f"bits must be an int in 1..4, got {bits!r}")
        self.kind = kind
        self.bits = bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return approx_act_unchecked(x, self.kind, self.bits)  # kind and bits validated above

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, bits={self.bits}"


class MSReLUSquared(ConvertedModule, nn.Module):
    """relu(x)² (Primer, Nemotron / Persimmon ``relu2``) whose backward keeps only its output: the derivative is
    2·√y, and y is what the following Linear keeps anyway (``lmbp_convert.ops.relu_squared``). Same forward, bit
    for bit; no parameters or buffers."""

    kind = "relu2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu_squared(x)


#: activations whose backward reads only their output: kind → module class
OUTPUT_KINDS: dict[str, type[nn.Module]] = {MSReLUSquared.kind: MSReLUSquared}
