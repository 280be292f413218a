"""A faithful CPU stand-in for bitsandbytes' ``Linear4bit`` (which needs its own wheel, and a GPU for speed).

What matters to lmbp-convert is how the layer looks and what it keeps for backward, not its kernels:
``Packed4bitLinear`` is an ``nn.Linear`` subclass (as Linear4bit is: PEFT wraps it in its ``lora.Linear``) whose
``weight`` is a frozen uint8 parameter holding two 4-bit codes a byte (per-row absmax scales in a buffer); its
forward dequantizes and calls F.linear inside an autograd function that keeps the packed weight on ``ctx``,
not its input — like bitsandbytes' MatMul4Bit, which saves nothing for backward that saved-tensor hooks see.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def pack4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale): ``w`` rounded to 16 levels per row, two codes a byte."""
    scale = w.detach().float().abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 7
    q = (torch.clamp(torch.round(w.detach().float() / scale), -8, 7) + 8).to(torch.uint8).flatten()
    if q.numel() % 2:
        q = torch.cat([q, q.new_zeros(1)])
    return (q[0::2] | (q[1::2] << 4)).contiguous(), scale


def unpack4(codes: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    q = torch.stack([codes & 0xF, codes >> 4], dim=1).flatten()[: shape[0] * shape[1]]
    return (q.float() - 8).view(shape) * scale


class _DequantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, codes, scale, bias, shape):
        ctx.packed = (codes, scale, shape)  # not save_for_backward: the weight is no activation (as bitsandbytes)
        return F.linear(x, unpack4(codes, scale, shape).to(x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, gy):
        codes, scale, shape = ctx.packed
        gx = gy @ unpack4(codes, scale, shape).to(gy.dtype) if ctx.needs_input_grad[0] else None
        return gx, None, None, None, None


class Packed4bitLinear(nn.Linear):
    """A Linear with 4-bit packed, frozen weights (see the module docstring)."""

    def __init__(self, lin: nn.Linear, compute_dtype: torch.dtype | None = None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = lin.in_features, lin.out_features
        codes, scale = pack4(lin.weight)
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.register_buffer("scale", scale)
        self.bias = None if lin.bias is None else nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
        self.compute_dtype = compute_dtype or lin.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DequantLinear.apply(x.to(self.compute_dtype), self.weight, self.scale, self.bias,
                                    (self.out_features, self.in_features))


def quantize_linears(model: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """Replace every nn.Linear whose attribute name is in ``names`` by a ``Packed4bitLinear`` (in place)."""
    for parent in list(model.modules()):
        for cname, child in list(parent.named_children()):
            if cname in names and type(child) is nn.Linear:
                setattr(parent, cname, Packed4bitLinear(child))
    return model
