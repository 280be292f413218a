"""Dropout whose backward keeps a 1-bit mask, drawing exactly the mask `torch.nn.functional.dropout` draws.

An adapter's dropout (PEFT ``lora_dropout``) keeps its mask for its own backward (on CPU a float noise tensor of
the input's size; on CUDA a bool mask) and the adapter's ``lora_A`` keeps the dropped input. Here the mask is kept
as packed bits, and the output is noted with `lmbp_convert.ops.shared_saves` as rebuildable from the input and
those bits, so ``lora_A`` keeps neither copy. Same random draws, same values, bitwise: on CUDA/XPU through
``native_dropout`` (what F.dropout runs there), elsewhere as ATen's CPU dropout (``noise.bernoulli_(1 - p)``,
``noise.div_(1 - p)``, ``x * noise``).
"""
from __future__ import annotations

import torch

from .shared_saves import note

__all__ = ["dropout_bits", "pack_bits", "unpack_bits"]

_FUSED = ("cuda", "xpu")  # devices where F.dropout runs native_dropout (ATen's is_fused_kernel_acceptable)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8, 8 elements a byte (little-endian bit order)."""
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (flat.view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8)


def unpack_bits(bits: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    n = 1
    for s in shape:
        n *= s
    return ((bits.unsqueeze(1) >> shifts) & 1).reshape(-1)[:n].view(shape).bool()


def _scale(x: torch.Tensor, p: float) -> torch.Tensor:
    """The value ATen's CPU dropout gives kept elements: ``1`` divided by ``1 - p`` in x's dtype."""
    return torch.ones((), dtype=x.dtype, device=x.device).div_(1 - p)


def _rebuild(x: torch.Tensor, bits: torch.Tensor, p: float) -> torch.Tensor:
    mask = unpack_bits(bits, x.shape)
    if x.device.type in _FUSED:
        return torch.ops.aten.native_dropout_backward(x, mask, 1.0 / (1 - p))
    return x * (mask.to(x.dtype) * _scale(x, p))


class _DropoutBits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p):
        if x.device.type in _FUSED:
            out, mask = torch.native_dropout(x, p, True)
        else:
            noise = torch.empty_like(x).bernoulli_(1 - p)
            noise.div_(1 - p)
            out = x * noise
            mask = noise != 0
        bits = pack_bits(mask)
        ctx.save_for_backward(bits)
        ctx.p, ctx.shape = p, x.shape
        ctx.mark_non_differentiable(bits)
        return out, bits

    @staticmethod
    def backward(ctx, g, _):
        (bits,) = ctx.saved_tensors
        mask = unpack_bits(bits, ctx.shape)
        if g.device.type in _FUSED:
            return torch.ops.aten.native_dropout_backward(g, mask, 1.0 / (1 - ctx.p)), None
        return g * (mask.to(g.dtype) * _scale(g, ctx.p)), None


def dropout_bits(x: torch.Tensor, p: float) -> torch.Tensor:
    """``F.dropout(x, p, training=True)``, bitwise, keeping a 1-bit mask for backward (see the module doc)."""
    if not (0.0 < p < 1.0) or x.numel() == 0 or not x.is_floating_point() or torch.compiler.is_compiling() \
            or not (x.requires_grad and torch.is_grad_enabled()):
        return torch.nn.functional.dropout(x, p, True)
    out, bits = _DropoutBits.apply(x, p)
    note(out, _rebuild, x, bits, p, weak=(0,))  # x: often a transient cast copy (PEFT's x.float())
    return out
