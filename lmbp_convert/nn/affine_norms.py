"""Memory-sharing norm that keeps its affine: the original γ, β Parameters (same objects, same state_dict keys),
applied in forward, with a backward computed from the output (`lmbp_convert.ops.ms_norm_affine`).

Used where the affine cannot be folded into the next Linears but a consumer keeps the norm's output anyway (a
post-LN residual add in the same forward, a tied head): the norm's input is then no longer kept.

The guard: channels whose x̂ cannot be recovered from y to the documented bound (|γ| tiny, or |β| ≫ |γ|) keep their
input columns instead. Which channels those are is recomputed on the device at every forward, from γ and β as they
are then: an O(n) elementwise test and a sort of n flags, small beside the norm itself. No key on version counters
or data pointers decides it, since ``p.data.copy_(t)`` and ``p.data = t`` (master-weight copy-back, EMA,
hand-written optimisers) move neither, and a key would keep a stale set for every later step. When more than half
the channels would need it, the forward is the plain norm (saving its input, as the original did): exact, nothing
gained, nothing lost.

No host sync in a training step. The channel mask is computed on the device, and the index set is the first k of
the channels ordered unreliable-first (a static-shape sort, no ``nonzero``), k being the count the host knows.
Each forward copies the new count to the host without blocking (`HostCount`), read once it has arrived, so a GPU
step never waits on it. While the set's size stays the same — every step but the rare one where a channel crosses
the guard's threshold — the kept columns, the saved bytes and the gradients are exactly those of a guard read at
every forward. When the size changes, the host learns it by the next forward: a shrinking set keeps a few reliable
columns more for that step (exact); a growing one recovers the new channels from y for that step (a channel with
γ = 0 gives x̂ = 0, never inf). ``deferred_guard = False`` reads the count at every forward instead (one host sync
per forward), for exact guarding from the very first step. The first forward (and one after a move to another
device) reads the count once.

Under torch.compile the forward is that plain norm as well: the guard's channel choice (a data-dependent count)
cannot be traced into a graph, and a guess at it could go stale after an optimizer step. Outputs are identical and gradients exact; the input is saved, as the original norm did.
"""
from __future__ import annotations

import torch
from torch import nn

from ..deprecation import renamed_attribute
from ..enums import AffineState, ConvertedModule, NormType, WeightParam
from ..ops import func_transforms
from ..ops.ms_norm_affine import ms_norm_affine, plain_norm_affine, unreliable_channels

__all__ = ["HostCount", "MSAffineNorm"]


class HostCount:
    """A count on ``device`` copied to the host without blocking: `post` starts the copy (into pinned memory, with
    an event, on CUDA); `take` returns it once it has arrived (None before, or when nothing is pending), reading host
    memory, never waiting on the device. On the CPU the copy has arrived when `post` returns. The buffer and the
    event are made here, at the first forward, not in a training step."""

    def __init__(self, device: torch.device) -> None:
        cuda = torch.device(device).type == "cuda"
        self._buf = torch.zeros((), dtype=torch.int64, pin_memory=cuda)
        self._event = torch.cuda.Event() if cuda else None
        self._pending = False

    def post(self, count: torch.Tensor) -> None:
        self._buf.copy_(count, non_blocking=self._event is not None)
        if self._event is not None:
            self._event.record()
        self._pending = True

    def ready(self) -> bool:
        return self._pending and (self._event is None or self._event.query())

    def take(self) -> int | None:
        if not self.ready():
            return None
        self._pending = False
        return int(self._buf.numpy())  # host memory the copy has written: no device op


class MSAffineNorm(ConvertedModule, nn.Module):
    """LayerNorm / RMSNorm over the last dim with its own γ (= w or 1 + w) and β, backward from its output."""

    #: 0.1.0's names (DeprecationWarning): ``norm_kind`` is ``norm_type``; ``kind`` was ``f"{norm_type}_norm"``
    norm_kind = renamed_attribute("norm_kind", "norm_type")
    kind = renamed_attribute("kind", "norm_type", read=lambda t: f"{t}_norm", note=' (kind was f"{norm_type}_norm")')

    #: fall back to the plain norm when more than this fraction of the channels must keep their input column
    max_kept_fraction = 0.5
    #: read the guard's channel count without blocking, one forward late (False: at every forward, a host sync)
    deferred_guard = True

    def __init__(self, kind: NormType | str, n: int, eps: float, weight: nn.Parameter,
                 bias: nn.Parameter | None = None, param: WeightParam | str = WeightParam.W,
                 out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if weight.shape != (n,) or (bias is not None and bias.shape != (n,)):
            raise ValueError(f"MSAffineNorm: weight/bias must have shape ({n},)")
        self.norm_type = NormType(kind)
        self.normalized_shape = (int(n),)
        self.eps = float(eps)
        self.param = WeightParam(param)
        self.affine = AffineState.KEPT
        #: the dtype the replaced norm cast its output to (None: the input's, or autocast's compute dtype)
        self.out_dtype = out_dtype
        self.register_parameter("weight", weight)
        self.register_parameter("bias", bias)
        self._reset_guard()

    def _reset_guard(self) -> None:
        self._device: torch.device | None = None  # where the guard last ran (a move re-reads the count)
        self._keep_idx: torch.Tensor | None = None
        self._bad: torch.Tensor | None = None  # the unreliable channels, on the device
        self._k = 0  # how many channels the index set holds (the count the host last knew)
        self._count: HostCount | None = None  # the count after the last update, on its way to the host

    def kept_channels(self, device: torch.device) -> torch.Tensor | None:
        """Indices of the channels whose input column is kept (None: too many, use the plain norm), from γ and β
        as they are now, however they were last written. Computed on the device; no host read in the steady state
        (see the module doc)."""
        w, b = self.weight, self.bias
        moved = self._device != device
        self._device = device
        self._bad = unreliable_channels(w.detach(), None if b is None else b.detach(),
                                        self.param is WeightParam.ONE_PLUS_W).to(device)
        count = self._bad.sum()
        if moved:
            self._count = HostCount(device)
        if moved or not self.deferred_guard:
            self._k = int(count)  # the first forward (or exact mode): one host read
        else:
            if self._count.ready():  # the count an earlier forward posted has arrived
                self._k = self._count.take()
            self._count.post(count)  # arrives later; the next forward's index set uses it
        self._keep_idx = self._indices()
        return self._keep_idx

    def _indices(self) -> torch.Tensor | None:
        """``_k`` channels, the unreliable ones first (exactly the unreliable set when the count is current),
        sorted, from sorts of static shape: no data-dependent size on the device. Its own storage: backward keeps
        k indices, not the whole order."""
        if self._k > self.max_kept_fraction * self._bad.numel():
            return None
        order = torch.sort((~self._bad).to(torch.uint8), stable=True).indices
        return torch.sort(order[: self._k]).values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.normalized_shape[0]
        if x.dim() == 0 or x.shape[-1] != n:
            raise ValueError(f"MSAffineNorm: normalized_shape ({n},) does not match the last dim of the input of "
                             f"shape {tuple(x.shape)}")
        is_rms, one_plus = self.norm_type is NormType.RMS, self.param is WeightParam.ONE_PLUS_W
        # the guard (too many channels cannot be inverted), or a graph or a torch.func transform that cannot hold
        # it (γ there may be a functorch tensor, with no storage to key on): the plain norm, exactly
        keep = None if torch.compiler.is_compiling() or func_transforms.active() else self.kept_channels(x.device)
        if keep is None:
            return plain_norm_affine(x, self.weight, self.bias, n, self.eps, is_rms, one_plus, self.out_dtype)
        return ms_norm_affine(x, self.weight, self.bias, n, self.eps, is_rms, one_plus, keep, self.out_dtype)

    def __getstate__(self) -> dict:
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state.update(_device=None, _keep_idx=None, _bad=None, _k=0, _count=None)  # recomputed after a copy
        return state

    def extra_repr(self) -> str:
        return (f"norm_type={self.norm_type}, normalized_shape={self.normalized_shape}, eps={self.eps}, param={self.param}, "
                f"affine={self.affine}" + (f", out_dtype={self.out_dtype}" if self.out_dtype is not None else ""))
