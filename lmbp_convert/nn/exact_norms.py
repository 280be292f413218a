"""`MSExactNorm`: a memory-sharing LayerNorm / RMSNorm that keeps its original γ, β Parameters and computes exactly
what the original computes, for exact training.

Forward: x̂ by the memory-sharing op (backward from its output and rstd, `lmbp_convert.ops.ms_norm`), then
``y = x̂·γ + β`` (`lmbp_convert.ops.norm_affine`), noted in the model-wide shared-saves region as rebuildable from
x̂. A consumer that saves y (a Linear, a LoRA adapter's cast copy, an attention projection, a tied head) gets a
recipe instead: the pair keeps x̂ and rstd, the bytes of a fold, while every parameter (γ, β, W, b) stays the
original one with the original gradient, and the state dict is the original's. On CPU the two ops run as one
autograd node, each direction one native pass (`lmbp_convert.ops.exact_norm`). Where no region is open (a
submodule called on its own, torch.compile), y is saved as eager autograd saves it: correct, more bytes.

In full precision (fp32 / fp64 input and γ, no autocast) over the trailing dims, with the region open, where the replaced module's
own forward can be replayed (`lmbp_convert.ops.replay_norm`), the norm keeps its input x instead of x̂ (the same
bytes) and its backward runs the replaced module's own ops again with autograd: every gradient is bitwise the
unconverted model's, so fp32 training follows the original's trajectory exactly, not up to amplified rounding.

Where no note can take (inside activation checkpointing, its recompute included; a submodule called on its own),
a LayerNorm with γ = w runs as ``F.layer_norm``, which is what the replaced norm computed: it saves the input,
which there is kept anyway (the checkpoint's input, the residual the block adds back), where x̂ would be a second
tensor of that size beside the consumers' own copies of y.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..deprecation import renamed_attribute
from ..enums import AffineState, ConvertedModule, NormType, WeightParam
from ..ops._common import autocast_dtype_for
from ..ops.exact_norm import affine_rows, exact_norm_cpu
from ..ops.ms_norm import ms_norm_unchecked
from ..ops.norm_affine import affine_forward, norm_affine
from ..ops.replay_norm import OriginalForward, replay_norm, replays
from ..ops.shared_saves import can_note, note

__all__ = ["MSExactNorm"]


class MSExactNorm(ConvertedModule, nn.Module):
    """LayerNorm / RMSNorm over the trailing ``normalized_shape`` with γ = w or 1 + w and optional β."""

    #: 0.1.0's names (DeprecationWarning): ``norm_kind`` is ``norm_type``; ``kind`` was ``f"{norm_type}_norm"``
    norm_kind = renamed_attribute("norm_kind", "norm_type")
    kind = renamed_attribute("kind", "norm_type", read=lambda t: f"{t}_norm", note=' (kind was f"{norm_type}_norm")')

    def __init__(self, kind: NormType | str, normalized_shape: tuple[int, ...], eps: float, weight: nn.Parameter,
                 bias: nn.Parameter | None = None, param: WeightParam | str = WeightParam.W,
                 out_dtype: torch.dtype | None = None, channel_dim: int = -1, autocast_readers: bool = False,
                 replaced: nn.Module | None = None) -> None:
        super().__init__()
        shape = tuple(int(s) for s in normalized_shape)
        if tuple(weight.shape) != shape or (bias is not None and tuple(bias.shape) != shape):
            raise ValueError(f"MSExactNorm: weight/bias must have shape {shape}")
        self.norm_type = NormType(kind)
        self.normalized_shape = shape
        self.eps = float(eps)
        self.param = WeightParam(param)
        self.affine = AffineState.KEPT
        self.out_dtype = out_dtype  # the dtype the replaced norm cast its output to (None: the input's)
        if channel_dim != -1 and len(shape) != 1:
            raise ValueError("MSExactNorm: a channel-first norm normalises one dim")
        self.channel_dim = int(channel_dim)  # 1: channel-first (NCHW), normalised over that dim
        #: every reader is a Linear reading y as it is (the planner's `NormExact.linear_readers_only`): under
        #: torch.compile with autocast, y is emitted in the autocast dtype, the values those Linears' own casts
        #: would make, so the partitioner rebuilds their copy from x̂ instead of saving a cast it cannot recompute
        self.autocast_readers = bool(autocast_readers)
        self._n = 1
        for s in shape:
            self._n *= s
        self.register_parameter("weight", weight)
        self.register_parameter("bias", bias)
        #: ``replaced``'s own forward (the module this one replaces), replayed for bitwise gradients in full
        #: precision; not a submodule: no state-dict entry, no Parameters of its own
        self.__dict__["_original"] = None if replaced is None else OriginalForward.of(replaced, weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._replays(x):
            y = replay_norm(self._original, x, self.weight, self.bias)
            if y is not None:
                return y
        if self.channel_dim == -1:
            return self._forward(x)
        if x.dim() <= self.channel_dim:
            raise ValueError(f"MSExactNorm: a norm over dim {self.channel_dim} needs more than {x.dim()} dims")
        # channels-last view in, channel-first view of the (channels-last) output out: the consumers' saved
        # views of it are views of the noted output, which the shared-saves region rebuilds
        return self._forward(x.movedim(self.channel_dim, -1)).movedim(-1, self.channel_dim)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.normalized_shape
        if x.dim() < len(shape) or tuple(x.shape[-len(shape):]) != shape:
            raise ValueError(f"MSExactNorm: normalized_shape {shape} does not match the trailing dims of the input "
                             f"of shape {tuple(x.shape)}")
        if self._input_is_cheaper(x):
            y = F.layer_norm(x, shape, self.weight, self.bias, self.eps)
            return y if self.out_dtype is None else y.to(self.out_dtype)
        one_plus, out, is_rms = self.param is WeightParam.ONE_PLUS_W, self.out_dtype or x.dtype, \
            self.norm_type is NormType.RMS
        fused = exact_norm_cpu(x, self._n, self.eps, is_rms, self.weight, self.bias, one_plus, out,
                               autocast_dtype_for(x))
        if fused is not None:  # CPU: one node, one pass (ops/exact_norm.py)
            y, xhat = fused
            # x̂ is an output of y's node (with a gradient, for double backward) and the region finds notes by node:
            # the note's source is x̂ detached, or packing it would look like a copy of y
            note(y, affine_rows, xhat.detach(), self.weight, self.bias, one_plus, out, self._n)
            return y
        xhat = ms_norm_unchecked(x, self._n, self.eps, is_rms)
        w, b = self.weight, self.bias
        if len(shape) > 1:  # the affine op works on the last dim: view the trailing dims as one
            xhat = xhat.reshape(*xhat.shape[:-len(shape)], self._n)
            w, b = w.reshape(-1), None if b is None else b.reshape(-1)
        if torch.compiler.is_compiling():
            # Dynamo does not trace the shared-saves hooks; a checkpoint region tags y "recompute" instead, so
            # AOTAutograd's partitioner keeps x̂ (which the norm's backward needs anyway) and rebuilds y from it
            if self.autocast_readers and self.out_dtype is None:
                out = autocast_dtype_for(x)  # a Linear's autocast cast of y is a node the partitioner would save
            y = checkpoint(norm_affine, xhat, w, b, one_plus, out, use_reentrant=False)
        else:
            y = norm_affine(xhat, w, b, one_plus, out)
            note(y, affine_forward, xhat, w, b, one_plus, out)
        return y if len(shape) == 1 else y.view(x.shape[:-len(shape)] + shape)

    def _replays(self, x: torch.Tensor) -> bool:
        """`replay_norm.replays`, over the trailing dims only: a channel-first norm's own output is channel-first,
        so a channels-last consumer's copy of it (a reshape of the permuted y) is no recipe of the noted y; the
        channels-last x̂ path keeps the fold's bytes there."""
        return self._original is not None and self.channel_dim == -1 and replays(x, self.weight, self.bias)

    def _input_is_cheaper(self, x: torch.Tensor) -> bool:
        """Autograd will save here and no note can share y (see the module doc): the plain LayerNorm's saves."""
        return (self.norm_type is NormType.LAYER and self.param is WeightParam.W and torch.is_grad_enabled()
                and (x.requires_grad or self.weight.requires_grad) and not torch.compiler.is_compiling()
                and not can_note())

    def extra_repr(self) -> str:
        return (f"norm_type={self.norm_type}, normalized_shape={self.normalized_shape}, eps={self.eps}, param={self.param}, "
                "exact" + (f", out_dtype={self.out_dtype}" if self.out_dtype is not None else "")
                + (", autocast_readers=True" if self.autocast_readers else "")
                + (", replays original" if self._original is not None else "")
                + (f", channel_dim={self.channel_dim}" if self.channel_dim != -1 else ""))

