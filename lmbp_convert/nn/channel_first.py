"""Memory-sharing norms over dim 1 of a channel-first tensor (timm LayerNorm2d, HF ConvNext's channels_first
LayerNorm on NCHW).

The ops normalise over the last dim, so the input is viewed channels-last (``movedim``, no copy of its own: the op
reads it once into its contiguous channels-last output) and the output is handed back as a channel-first *view* of
that storage. The backward keeps that one storage, which the consumer (a 1×1 or strided convolution, or a permute
back to channels-last and a Linear) keeps anyway: the norm's input is no longer kept. Downstream, the tensor has
channels-last strides, which convolutions and elementwise ops accept as they are.
"""
from __future__ import annotations

import torch

from .norms import MSLayerNorm, MSRMSNorm, _MSNorm

__all__ = ["MSLayerNorm2d", "MSRMSNorm2d", "channel_first_class"]


class _ChannelFirst:
    """Mixin: the channels are dim 1 (``channel_dim``) of the input, not its last dim."""

    channel_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(f"{type(self).__name__}: a channel-first input needs at least 2 dims, got {x.dim()}")
        y = super().forward(x.movedim(self.channel_dim, -1))
        return y.movedim(-1, self.channel_dim)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", channel_dim={self.channel_dim}"


class MSLayerNorm2d(_ChannelFirst, MSLayerNorm):
    """`MSLayerNorm` over dim 1 (NCHW)."""


class MSRMSNorm2d(_ChannelFirst, MSRMSNorm):
    """`MSRMSNorm` over dim 1 (NCHW)."""


def channel_first_class(cls: type[_MSNorm]) -> type[_MSNorm]:
    """The channel-first form of a memory-sharing norm class."""
    return {MSLayerNorm: MSLayerNorm2d, MSRMSNorm: MSRMSNorm2d}[cls]
