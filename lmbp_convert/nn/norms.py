"""Memory-sharing norm modules: LayerNorm / RMSNorm whose backward keeps only the output and rstd.

Their state is declared, not improvised: ``affine`` says where the norm's affine lives (`AffineState`: folded
into the next Linears, or kept as the original Parameters and re-applied by hooks on the other branches), and
``param`` how ``weight`` gives the scale (γ = w or 1 + w). A folded norm holds no learnable parameters;
``identity_affine`` optionally registers persistent identity buffers (``weight``, and ``bias`` for LayerNorm)
only so that a converted model's state_dict keeps the original keys: "one" stores weight = 1 (plain ``x̂·w``),
"zero" stores weight = 0 (Gemma-style ``x̂·(1 + w)``). Forward never reads the affine.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from ..enums import AffineState, ConvertedModule, NormType, WeightParam
from ..ops.ms_norm import ms_norm_unchecked, normalize_shape

__all__ = ["MSLayerNorm", "MSRMSNorm"]

#: ``identity_affine`` spelling → the parameterisation whose identity the buffers hold
_IDENTITY_PARAM = {p.identity_fill: p for p in WeightParam}


def _check_trailing(x: torch.Tensor, shape: tuple[int, ...], op: str) -> None:
    if x.shape[-len(shape):] != shape or x.dim() < len(shape):
        raise ValueError(f"{op}: normalized_shape {shape} does not match the trailing dims of the input of "
                         f"shape {tuple(x.shape)}")


#: the state-dict entry (``<norm>.lmbp_folded``) by which a converted model's own state dict says that the Linears of
#: a norm whose affine is also re-applied (post-LN) already hold γ, β folded in: its entries look the same as an
#: original checkpoint's otherwise (`lmbp_convert.apply.load_hooks`)
FOLD_MARKER = "lmbp_folded"


class _MSNorm(ConvertedModule, nn.Module):
    norm_type: NormType
    _has_bias: bool = False
    #: write `FOLD_MARKER` into the state dict (set on a re-applied norm once its Linears hold the fold)
    marks_fold: bool = False

    def __init__(self, normalized_shape: int | Sequence[int], eps: float, identity_affine: str | None = None,
                 *, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.normalized_shape = normalize_shape(normalized_shape)
        self.eps = float(eps)
        self._n = math.prod(self.normalized_shape)  # row length, computed once
        if identity_affine is not None and identity_affine not in _IDENTITY_PARAM:
            raise ValueError(f"identity_affine must be None, 'one' or 'zero', got {identity_affine!r}")
        self.identity_affine = identity_affine
        #: where the affine lives; set by `reapplying` when the norm keeps γ, β for hooks on other branches
        self.affine = AffineState.FOLDED
        #: how ``weight`` (identity buffer or kept Parameter) gives the scale
        self.param = _IDENTITY_PARAM[identity_affine] if identity_affine is not None else WeightParam.W
        #: the dtype the replaced norm cast its output to (T5: its half-precision weight's); None: the input's
        self.out_dtype: torch.dtype | None = None
        if identity_affine is not None:
            kw = {"dtype": dtype, "device": device}
            self.register_buffer("weight", torch.full(self.normalized_shape, self.param.identity, **kw))
            if self._has_bias:
                self.register_buffer("bias", torch.zeros(self.normalized_shape, **kw))

    @classmethod
    def reapplying(cls, normalized_shape: int | Sequence[int], eps: float, weight: nn.Parameter,
                   bias: nn.Parameter | None, param: WeightParam | str) -> "_MSNorm":
        """A norm whose affine is re-applied on the branches that are not folded Linears: it keeps the original
        Parameters (same objects, same state_dict keys) for those hooks to read; its forward never does."""
        norm = cls(normalized_shape, eps)
        norm.register_parameter("weight", weight)
        if bias is not None:
            norm.register_parameter("bias", bias)
        norm.affine = AffineState.REAPPLIED
        norm.param = WeightParam(param)
        return norm

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.marks_fold:  # after γ, β: a shard boundary between them and the marker is resolved on load
            destination[prefix + FOLD_MARKER] = torch.ones((), dtype=torch.bool)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args) -> None:
        state_dict.pop(prefix + FOLD_MARKER, None)  # read by the model's FoldOnLoad hook; no tensor of its own
        super()._load_from_state_dict(state_dict, prefix, *args)

    def extra_repr(self) -> str:
        s = f"norm_type={self.norm_type}, normalized_shape={self.normalized_shape}, eps={self.eps}"
        if self.identity_affine is not None:
            s += f", identity_affine={self.identity_affine!r}"
        if self.out_dtype is not None:
            s += f", out_dtype={self.out_dtype}"
        if self.affine is not AffineState.FOLDED:
            s += f", affine={self.affine}, param={self.param}"
        return s


class MSLayerNorm(_MSNorm):
    """LayerNorm without affine whose backward uses only its output and rstd (see `ms_layer_norm`)."""

    norm_type = NormType.LAYER
    _has_bias = True

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5, identity_affine: str | None = None,
                 *, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__(normalized_shape, eps, identity_affine, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_trailing(x, self.normalized_shape, "MSLayerNorm")
        y = ms_norm_unchecked(x, self._n, self.eps, False)
        return y if self.out_dtype is None else y.to(self.out_dtype)


class MSRMSNorm(_MSNorm):
    """RMSNorm without affine whose backward uses only its output and rstd (see `ms_rms_norm`)."""

    norm_type = NormType.RMS

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-6, identity_affine: str | None = None,
                 *, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__(normalized_shape, eps, identity_affine, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_trailing(x, self.normalized_shape, "MSRMSNorm")
        y = ms_norm_unchecked(x, self._n, self.eps, True)
        return y if self.out_dtype is None else y.to(self.out_dtype)
