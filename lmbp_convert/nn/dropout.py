"""`BitDropout`: nn.Dropout whose backward keeps a 1-bit mask and whose output is rebuilt from its input for any
consumer that saves it (`lmbp_convert.ops.dropout_bits`). Same draws and values as the nn.Dropout it replaces."""
from __future__ import annotations

import torch
from torch import nn

from ..enums import ConvertedModule
from ..ops.dropout_bits import dropout_bits

__all__ = ["BitDropout"]


class BitDropout(ConvertedModule, nn.Dropout):
    """Drop-in for a (non-inplace) ``nn.Dropout``; an nn.Dropout subclass, so ``isinstance`` checks still hold."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return dropout_bits(x, self.p)
