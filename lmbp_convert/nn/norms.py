"""Memory-sharing norm modules: LayerNorm / RMSNorm whose backward keeps only the output and rstd.

Their state is declared, not improvised: ``affine`` says where the norm's affine lives (`AffineState`: folded
into the next Linears, or kept as the original Parameters and re-applied by hooks on the other branches), and
``param`` how ``weight`` gives the scale (γ = w or 1 + w). A folded norm holds no learnable parameters;
``identity_affine`` optionally registers persistent identity buffers (``weight``, and ``bias`` for LayerNorm)
only so that a converted model's state_dict keeps the original keys: "one" stores weight = 1 (plain ``x̂·w``),
"zero" stores weight = 0 (Gemma-style ``x̂·(1 + w)``). Forward never reads the affine.

An affine-free norm (no γ, β anywhere: nothing folded) made with `_MSNorm.replaying` runs the replaced module's own
forward in full precision (`lmbp_convert.ops.replay_norm`): it keeps the input instead of the output, and its
gradient is bitwise the original's.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from ..deprecation import renamed_attribute
from ..enums import AffineState, ConvertedModule, NormType, WeightParam
from ..ops.ms_norm import ms_norm_unchecked, normalize_shape
from ..ops.replay_norm import OriginalForward, replay_norm, replays

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
    #: 0.1.0's names (DeprecationWarning): ``norm_kind`` is ``norm_type``; ``kind`` was ``f"{norm_type}_norm"``
    norm_kind = renamed_attribute("norm_kind", "norm_type")
    kind = renamed_attribute("kind", "norm_type", read=lambda t: f"{t}_norm", note=' (kind was f"{norm_type}_norm")')
    #: write `FOLD_MARKER` into the state dict (set on a re-applied norm once its Linears hold the fold)
    marks_fold: bool = False
    #: the replaced affine-free norm's own forward (`replaying`), run in full precision for bitwise gradients
    _original: OriginalForward | None = None

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

    def replaying(self, replaced: nn.Module) -> "_MSNorm":
        """Run ``replaced``'s own forward where `replay_norm.replays` (fp32 / fp64, no autocast, the shared-saves
        region open): the input is kept instead of the output (the same bytes, no rstd), the consumers' copies of
        the output are rebuilt from it and the gradient is bitwise the original's. Only for an affine-free norm
        (no Parameters: nothing folded); a module a shell cannot stand in for (`OriginalForward.of`) is left out."""
        if self.affine is AffineState.FOLDED and self.identity_affine is None and not len(self._parameters):
            self.__dict__["_original"] = OriginalForward.of(replaced, None, None)
        return self

    def _replayed(self, x: torch.Tensor) -> torch.Tensor | None:
        if self._original is None or not replays(x):
            return None
        return replay_norm(self._original, x, None, None)

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
        return s + (", replays original" if self._original is not None else "")


class MSLayerNorm(_MSNorm):
    """LayerNorm without affine whose backward uses only its output and rstd (see `ms_layer_norm`)."""

    norm_type = NormType.LAYER
    _has_bias = True

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5, identity_affine: str | None = None,
                 *, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__(normalized_shape, eps, identity_affine, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_trailing(x, self.normalized_shape, "MSLayerNorm")
        y = self._replayed(x)
        if y is not None:
            return y
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
        y = self._replayed(x)
        if y is not None:
            return y
        y = ms_norm_unchecked(x, self._n, self.eps, True)
        return y if self.out_dtype is None else y.to(self.out_dtype)
