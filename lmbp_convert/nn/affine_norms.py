"""Memory-sharing norm that keeps its affine: the original γ, β Parameters (same objects, same state_dict keys),
applied in forward, with a backward computed from the output (`lmbp_convert.ops.ms_norm_affine`).

Used where the affine cannot be folded into the next Linears but a consumer keeps the norm's output anyway (a
post-LN residual add in the same forward, a tied head): the norm's input is then no longer kept.

The guard: channels whose x̂ cannot be recovered from y to the documented bound (|γ| tiny, or |β| ≫ |γ|) keep their
input columns instead. Which channels those are is decided once per parameter update (keyed on the parameters'
version counters, so a GPU forward does not sync on every call); when more than half the channels would need it,
the forward is the plain norm (saving its input, as the original did): exact, nothing gained, nothing lost.

Under torch.compile the forward is that plain norm as well: the guard's key (version counters, data pointers)
and its channel choice (a data-dependent count) cannot be traced into a graph, and a guess at them could go
stale after an optimizer step. Outputs are identical and gradients exact; the input is saved, as the original norm did.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kinds import AffineState, ConvertedModule, NormKind, WeightParam
from ..ops.ms_norm_affine import ms_norm_affine, plain_norm_affine, unreliable_channels

__all__ = ["MSAffineNorm"]


class MSAffineNorm(ConvertedModule, nn.Module):
    """LayerNorm / RMSNorm over the last dim with its own γ (= w or 1 + w) and β, backward from its output."""

    #: fall back to the plain norm when more than this fraction of the channels must keep their input column
    max_kept_fraction = 0.5

    def __init__(self, kind: NormKind | str, n: int, eps: float, weight: nn.Parameter,
                 bias: nn.Parameter | None = None, param: WeightParam | str = WeightParam.W,
                 out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if weight.shape != (n,) or (bias is not None and bias.shape != (n,)):
            raise ValueError(f"MSAffineNorm: weight/bias must have shape ({n},)")
        self.norm_kind = NormKind(kind)
        self.normalized_shape = (int(n),)
        self.eps = float(eps)
        self.param = WeightParam(param)
        self.affine = AffineState.KEPT
        #: the dtype the replaced norm cast its output to (None: the input's, or autocast's compute dtype)
        self.out_dtype = out_dtype
        self.register_parameter("weight", weight)
        self.register_parameter("bias", bias)
        self._guard_key: tuple | None = None
        self._keep_idx: torch.Tensor | None = None

    @property
    def kind(self) -> str:
        return f"{self.norm_kind}_norm"

    def kept_channels(self, device: torch.device) -> torch.Tensor | None:
        """Indices of the channels whose input column is kept (None: too many, use the plain norm)."""
        w, b = self.weight, self.bias
        key = (w._version, w.data_ptr(), None if b is None else (b._version, b.data_ptr()), device)
        if key != self._guard_key:
            bad = unreliable_channels(w, b, self.param is WeightParam.ONE_PLUS_W)
            idx = torch.nonzero(bad).reshape(-1)
            self._keep_idx = None if idx.numel() > self.max_kept_fraction * bad.numel() else idx.to(device)
            self._guard_key = key
        return self._keep_idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.normalized_shape[0]
        if x.dim() == 0 or x.shape[-1] != n:
            raise ValueError(f"MSAffineNorm: normalized_shape ({n},) does not match the last dim of the input of "
                             f"shape {tuple(x.shape)}")
        is_rms, one_plus = self.norm_kind is NormKind.RMS, self.param is WeightParam.ONE_PLUS_W
        # the guard (too many channels cannot be inverted), or a graph that cannot hold it: the plain norm, exactly
        keep = None if torch.compiler.is_compiling() else self.kept_channels(x.device)
        if keep is None:
            return plain_norm_affine(x, self.weight, self.bias, n, self.eps, is_rms, one_plus, self.out_dtype)
        return ms_norm_affine(x, self.weight, self.bias, n, self.eps, is_rms, one_plus, keep, self.out_dtype)

    def __getstate__(self) -> dict:
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state["_guard_key"], state["_keep_idx"] = None, None  # recomputed after a copy or a load
        return state

    def extra_repr(self) -> str:
        return (f"kind={self.kind}, normalized_shape={self.normalized_shape}, eps={self.eps}, param={self.param}, "
                f"affine={self.affine}" + (f", out_dtype={self.out_dtype}" if self.out_dtype is not None else ""))
