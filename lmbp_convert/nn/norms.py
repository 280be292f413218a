"""Memory-sharing norm modules: LayerNorm / RMSNorm with the affine folded into the next Linear.

They hold no learnable parameters. ``identity_affine`` optionally registers persistent identity buffers
(``weight``, and ``bias`` for LayerNorm) only so that a converted model's state_dict keeps the original keys:
"one" stores weight = 1 (plain ``x̂·w``), "zero" stores weight = 0 (Gemma-style ``x̂·(1 + w)``). Forward never
reads them.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from ..ops.ms_norm import ms_norm_unchecked, normalize_shape

__all__ = ["MSLayerNorm", "MSRMSNorm"]

_IDENTITY_FILL = {"one": 1.0, "zero": 0.0}


def _check_trailing(x: torch.Tensor, shape: tuple[int, ...], op: str) -> None:
    if x.shape[-len(shape):] != shape or x.dim() < len(shape):
        raise ValueError(f"{op}: normalized_shape {shape} does not match the trailing dims of the input of "
                         f"shape {tuple(x.shape)}")


class _MSNorm(nn.Module):
    kind: str = ""
    _has_bias: bool = False

    def __init__(self, normalized_shape: int | Sequence[int], eps: float, identity_affine: str | None = None,
                 *, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.normalized_shape = normalize_shape(normalized_shape)
        self.eps = float(eps)
        self._n = math.prod(self.normalized_shape)  # row length, computed once
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
        _check_trailing(x, self.normalized_shape, "MSLayerNorm")
        return ms_norm_unchecked(x, self._n, self.eps, False)


class MSRMSNorm(_MSNorm):
    """RMSNorm without affine whose backward uses only its output and rstd (see `ms_rms_norm`)."""

    kind = "rms_norm"

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-6, identity_affine: str | None = None,
                 *, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__(normalized_shape, eps, identity_affine, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_trailing(x, self.normalized_shape, "MSRMSNorm")
        return ms_norm_unchecked(x, self._n, self.eps, True)
