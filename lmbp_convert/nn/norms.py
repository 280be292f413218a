"""Memory-sharing norm modules: LayerNorm / RMSNorm with the affine folded into the next Linear.

They hold no learnable parameters. ``identity_affine`` optionally registers persistent identity buffers
(``weight``, and ``bias`` for LayerNorm) only so that a converted model's state_dict keeps the original keys:
"one" stores weight = 1 (plain ``x̂·w``), "zero" stores weight = 0 (Gemma-style ``x̂·(1 + w)``). Forward never
reads them.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..ops.ms_norm import ms_layer_norm, ms_rms_norm, normalize_shape

__all__ = ["MSLayerNorm", "MSRMSNorm"]

_IDENTITY_FILL = {"one": 1.0, "zero": 0.0}


class _MSNorm(nn.Module):
    kind: str = ""
    _has_bias: bool = False

    def __init__(self, normalized_shape: int | Sequence[int], eps: float, identity_affine: str | None = None,
                 *, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.normalized_shape = normalize_shape(normalized_shape)
        self.eps = float(eps)
        if identity_affine is not None and identity_affine not in _IDENTITY_FILL:
            raise ValueError(f"identity_affine must be None, 'one' or 'zero', got {identity_affine!r}")
        self.identity_affine = identity_affine
        if identity_affine is not None:
            kw = {"dtype": dtype, "device": device}
            self.register_buffer("weight", torch.full(self.normalized_shape, _IDENTITY_FILL[identity_affine], **kw))
            if self._has_bias:
                self.register_buffer("bias", torch.zeros(self.normalized_shape, **kw))

    def extra_repr(self) -> str:
        s = f"kind={self.kind}, normalized_shape={self.normalized_shape}, eps={self.eps}"
        if self.identity_affine is not None:
            s += f", identity_affine={self.identity_affine!r}"
        return s


class MSLayerNorm(_MSNorm):
    """LayerNorm without affine whose backward uses only its output and rstd (see `ms_layer_norm`)."""

    kind = "layer_norm"
    _has_bias = True

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5, identity_affine: str | None = None,
                 *, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__(normalized_shape, eps, identity_affine, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ms_layer_norm(x, self.normalized_shape, self.eps)


class MSRMSNorm(_MSNorm):
    """RMSNorm without affine whose backward uses only its output and rstd (see `ms_rms_norm`)."""

    kind = "rms_norm"

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-6, identity_affine: str | None = None,
                 *, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__(normalized_shape, eps, identity_affine, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ms_rms_norm(x, self.normalized_shape, self.eps)
