"""Pure tensor maths of folding a norm's affine into the Linear layers that consume it, and of undoing it.

y = W·(γ ⊙ x̂ + β) + b  =  (W·diag(γ))·x̂ + (b + W·β)

Every fold and unfold of the package is computed here; the callers keep the module plumbing and the IO:
``apply/rewrite`` (convert()), ``apply/load_hooks`` (an original checkpoint loaded into a converted model),
``apply/hooks`` (an affine re-applied on another branch, a shift added after a bias-less Linear),
``checkpoint/api`` (the on-disk fold, a block of rows at a time) and ``export`` (unfolding for a plain checkpoint).

Conventions:

* ``param`` — how a norm's ``weight`` w gives its scale γ: ``"w"`` (γ = w) or ``"1+w"`` (Gemma-style γ = 1 + w).
  A str-valued enum with these values is accepted wherever a ``param`` is.
* ``layout`` — ``"out_in"`` for nn.Linear (weight [out, in]) and ``"in_out"`` for Hugging Face Conv1D (weight
  [in, out]); also accepted as a str-valued enum. It names the *last two* dims: a weight with leading dims is a
  stack of such matrices (MoE experts held as one parameter, [experts, out, in] or [experts, in, out]), folded
  expert by expert along the same input dim, with biases [experts, out].
* precision — folds compute in fp32 (fp64 for fp64 weights) and round once to the weight's dtype; unfolds compute
  and return fp64, leaving the one rounding to the caller (after its checks); the differentiable helpers the
  forward hooks use stay in the parameters' dtype, so autograd and autocast see ordinary ops.
"""
from __future__ import annotations

from enum import Enum
from typing import Literal, NamedTuple, Sequence, Union

import torch

from .errors import LmbpError
from .enums import WeightParam

__all__ = [
    "BETA_RATIO", "BiasMove", "GAMMA_FLOOR", "Layout", "Param", "UnfoldError", "Scratch", "accumulation_dtype", "apply_affine", "effective_scale",
    "fold_affine", "fold_bias", "fold_lora_a", "fold_rows", "fold_scale", "identity_weight_value", "matvec",
    "norm_scale", "relative_residual", "remove_shift", "shift_behind_scale", "shift_is_expressible", "shift_of",
    "shift_through_scale", "unfold_added_bias", "unfold_affine", "unfold_bias", "unfold_scale", "unreliable_channels",
]

#: a norm weight parameterisation: "w" or "1+w" (or a str-valued enum member with one of these values)
Param = Union[Literal["w", "1+w"], str]
#: a Linear weight layout: "out_in" (nn.Linear) or "in_out" (HF Conv1D) (or a str-valued enum member)
Layout = Union[Literal["out_in", "in_out"], str]

_PARAMS = frozenset(p.value for p in WeightParam)
_LAYOUTS = ("out_in", "in_out")


class UnfoldError(LmbpError, ValueError):
    """A folded weight has no unfolded equivalent (γ = 0 on a channel it still reads)."""


def _param(param: Param) -> str:
    p = param.value if isinstance(param, Enum) else param
    if p not in _PARAMS:
        raise ValueError(f"unknown norm weight parameterisation {param!r}")
    return p


def _layout(layout: Layout) -> str:
    lay = layout.value if isinstance(layout, Enum) else layout
    if lay not in _LAYOUTS:
        raise ValueError(f"unknown weight layout {layout!r}")
    return lay


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a fold computes in: fp64 for fp64 weights, fp32 for everything else (bf16/fp16 products would
    round twice)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- the norm's parameterisation --------------------------------------------------------------------------------
def norm_scale(weight: torch.Tensor, param: Param) -> torch.Tensor:
    """The scale γ a norm multiplies by, as a differentiable expression of its ``weight`` in that tensor's dtype:
    ``w`` or ``1 + w``. (What hooks reading live parameters and reference formulas use.)"""
    return 1.0 + weight if _param(param) == "1+w" else weight


def effective_scale(weight: torch.Tensor, param: Param) -> torch.Tensor:
    """The scale γ a norm multiplies by, detached, in the fold's accumulation dtype (fp32, or fp64)."""
    return norm_scale(weight.detach().to(accumulation_dtype(weight.dtype)), param)


def identity_weight_value(param: Param) -> float:
    """Weight value that makes the norm's affine the identity (1 for w, 0 for 1 + w)."""
    return WeightParam(_param(param)).identity


# -- fold -------------------------------------------------------------------------------------------------------
def matvec(weight: torch.Tensor, v: torch.Tensor, layout: Layout = "out_in") -> torch.Tensor:
    """W·v for a weight stored in ``layout`` (``weight @ v``, or ``v @ weight`` for Conv1D), in the inputs' dtype."""
    return weight @ v if _layout(layout) == "out_in" else v @ weight


def fold_affine(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gamma: torch.Tensor,
    beta: torch.Tensor | None,
    layout: Layout = "out_in",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (W', b') with W' = W·diag(γ), b' = b + W·β; b' is None only if both b and β are None.
    W' has the weight's dtype, b' the bias's (the weight's when there was no bias)."""
    lay = _layout(layout)
    acc = accumulation_dtype(weight.dtype)
    w = weight.detach().to(acc)
    g = gamma.detach().to(device=w.device, dtype=acc)
    in_dim = w.shape[-1] if lay == "out_in" else w.shape[-2]
    if g.shape != (in_dim,):
        raise ValueError(f"norm has {tuple(g.shape)} channels but the Linear takes {in_dim} inputs")
    w_new = w * g if lay == "out_in" else w * g[:, None]
    b_new = None
    if beta is not None:
        shift = matvec(w, beta.detach().to(device=w.device, dtype=acc), lay)
        b_new = shift if bias is None else bias.detach().to(acc) + shift
    elif bias is not None:
        b_new = bias.detach().to(acc)
    out_b = None
    if b_new is not None:
        out_b = b_new.to(bias.dtype if bias is not None else weight.dtype)
    return w_new.to(weight.dtype), out_b


def fold_scale(weight: torch.Tensor, gamma: torch.Tensor, layout: Layout = "out_in") -> torch.Tensor:
    """W·diag(γ) alone, bit for bit the weight of ``fold_affine`` (a Linear whose bias is left as it is)."""
    return fold_affine(weight, None, gamma, None, layout)[0]


def fold_lora_a(a_weight: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """A·diag(γ) for a LoRA ``lora_A`` weight [r, in]: A(γ·x̂) = (A·diag(γ))·x̂. β never reaches an adapter: it
    only shifts the base layer's bias (the planner refuses a fold that would need it elsewhere)."""
    return fold_scale(a_weight, gamma, "out_in")


def fold_bias(bias: torch.Tensor, weight: torch.Tensor, beta: torch.Tensor, layout: Layout = "out_in"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(b + W·β, W·β) in fp64 from the *unfolded* W: the bias a fold of β gives, and the part of it that β added
    (kept by a caller that may have to replace it when another β arrives). Unrounded."""
    w = weight.detach().double()
    shift = shift_of(w, beta.detach().double().to(w.device), layout).to(bias.device)
    return bias.detach().double() + shift, shift


def remove_shift(bias: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
    """b' − W·β in fp64 given the shift W·β that ``fold_bias`` returned for b' (None: nothing was added): the
    bias before that fold, for a caller that must fold another β in its place."""
    return bias.detach().double() - (shift if shift is not None else 0.0)


class Scratch:
    """Buffers reused block after block by ``fold_rows``: a fresh multi-MB allocation per block page-faults every
    time, which made the on-disk fold several times slower than the arithmetic."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        b = self._bufs.get((name, dtype))
        if b is None or b.numel() < numel:
            b = self._bufs[name, dtype] = torch.empty(numel, dtype=dtype)
        return b[:numel]

    def accumulator(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The unrounded product of the last ``fold_rows`` call of this shape (its fp32 / fp64 W·diag(γ))."""
        n = 1
        for s in shape:
            n *= s
        return self.get("acc", n, dtype).view(shape)


def fold_rows(x: torch.Tensor, gamma: torch.Tensor, layout: Layout, r0: int, scratch: Scratch,
              in_place: bool = False) -> torch.Tensor:
    """Rows r0:r0+len(x) of ``fold_scale(W, gamma, layout)``, bit for bit (same casts, same fp32 or fp64 product,
    same rounding), computed in ``scratch``: the fold of a weight streamed a block of rows at a time. ``gamma`` is
    the full effective scale; ``in_place``: x may be overwritten. The result may be a view of ``scratch`` (copy it
    before the next call with the same scratch)."""
    acc = accumulation_dtype(x.dtype)
    g = gamma.to(acc)
    if _layout(layout) == "in_out":  # 2-D: the rows are the input dim; stacked experts: whole experts per block
        g = g[r0:r0 + x.shape[0], None] if x.dim() == 2 else g[:, None]
    if in_place and x.dtype == acc:
        a = x
    else:
        a = scratch.accumulator(x.shape, acc)
        a.copy_(x)
    a.mul_(g)
    if x.dtype == acc:
        return a
    out = scratch.get("out", x.numel(), x.dtype).view(x.shape)
    out.copy_(a)
    return out


# -- inverting the affine (memory-sharing norms that keep it) ---------------------------------------------------
#: a channel whose |γ| is below this cannot be inverted (γ = 0 loses x̂; tiny γ amplifies y's rounding)
GAMMA_FLOOR = 1e-3
#: ... nor one where |β| > R·|γ|: y's rounding error u·|y| ≈ u·|β| becomes u·R after dividing by γ
BETA_RATIO = 2.0


def unreliable_channels(weight: torch.Tensor, bias: torch.Tensor | None, one_plus: bool,
                        gamma_floor: float = GAMMA_FLOOR, beta_ratio: float = BETA_RATIO) -> torch.Tensor:
    """Bool mask of the channels whose x̂ cannot be recovered from y = x̂·γ + β to within u·(|x̂| + R) (u: the
    output dtype's rounding): |γ| < ``gamma_floor`` or |β| > R·|γ|. See `lmbp_convert.ops.ms_norm_affine`."""
    gamma = weight.detach().float()
    gamma = gamma + 1.0 if one_plus else gamma
    bad = gamma.abs() < gamma_floor
    if bias is not None:
        bad |= bias.detach().float().abs() > beta_ratio * gamma.abs()
    return bad


# -- the shift β --------------------------------------------------------------------------------------------------
def apply_affine(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor | None) -> torch.Tensor:
    """γ ⊙ x + β over the last dim, in the usual type-promotion (used where the affine is re-applied). One op
    (``addcmul``: one rounding, one autograd node; on a GPU one launch) where there is a β."""
    return x * gamma if beta is None else torch.addcmul(beta, x, gamma)


def shift_of(weight: torch.Tensor, beta: torch.Tensor, layout: Layout = "out_in") -> torch.Tensor:
    """W·β: what a shift β before a Linear adds to its output (differentiable; in the weight's dtype, so
    autocast casts it like the Linear's own weight)."""
    if _layout(layout) == "out_in":
        return torch.nn.functional.linear(beta.to(weight.dtype), weight)
    return beta.to(weight.dtype) @ weight


def shift_through_scale(beta: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """β / γ: the shift that, placed *after* the scale, gives the same affine: γ·x̂ + β = γ·(x̂ + β/γ). A norm
    folded into bias-less Linears keeps this shift (W'·(x̂ + β/γ) = W·(γ·x̂ + β) with W' = W·diag(γ)). Channels
    with γ = 0 need β = 0 there (checked by the planner); they get 0. Computed in float64, stored as β."""
    b, g = beta.detach().double(), gamma.detach().double().to(beta.device)
    return torch.where(g == 0, torch.zeros_like(b), b / torch.where(g == 0, torch.ones_like(g), g)).to(beta.dtype)


def shift_behind_scale(beta: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """β / γ as ``shift_through_scale``, but differentiable and in the parameters' dtype: for hooks that read a
    norm's live γ, β while they train (a channel with γ = 0 divides by 1)."""
    return beta / torch.where(gamma == 0, torch.ones_like(gamma), gamma)


def shift_is_expressible(beta: torch.Tensor, gamma: torch.Tensor) -> bool:
    """Can β move behind the scale (``shift_through_scale``)? Not where γ = 0 but β ≠ 0."""
    if beta.device.type == "meta" or gamma.device.type == "meta":
        return True
    return not bool(((gamma.detach() == 0) & (beta.detach().to(gamma.device) != 0)).any())


# -- unfold -------------------------------------------------------------------------------------------------------
def unfold_scale(weight: torch.Tensor, gamma: torch.Tensor, layout: Layout = "out_in") -> torch.Tensor:
    """W'·diag(1/γ) in fp64, the inverse of ``fold_scale``. A zero γ is allowed only on channels whose column of W'
    is zero too (they unfold to 0); otherwise ``UnfoldError``."""
    lay = _layout(layout)
    w = weight.detach().to(torch.float64)
    g = gamma.detach().to(device=w.device, dtype=torch.float64)
    zero = g == 0
    if bool(zero.any()):
        cols = w[..., zero] if lay == "out_in" else w[..., zero, :]
        if bool(cols.ne(0).any()):
            raise UnfoldError("a norm scale γ is exactly 0 but the folded Linear still reads that channel: "
                              "a plain model cannot express it")
    safe = torch.where(zero, torch.ones_like(g), g)
    return w / safe if lay == "out_in" else w / safe[:, None]


def unfold_bias(bias: torch.Tensor, weight: torch.Tensor, beta: torch.Tensor, layout: Layout = "out_in"
                ) -> torch.Tensor:
    """b' − W·β in fp64, with W the *unfolded* weight: the inverse of the bias part of ``fold_affine``."""
    w = weight.detach().to(torch.float64)
    return bias.detach().to(torch.float64) - matvec(w, beta.detach().to(device=w.device, dtype=torch.float64),
                                                     layout)


def unfold_affine(weight: torch.Tensor, bias: torch.Tensor | None, gamma: torch.Tensor, beta: torch.Tensor | None,
                  layout: Layout = "out_in") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The inverse of ``fold_affine``: (W'·diag(1/γ), b' − W·β) in fp64, unrounded. With ``beta`` None the bias is
    b' as it is (None stays None). Raises ``UnfoldError`` as ``unfold_scale``."""
    w = unfold_scale(weight, gamma, layout)
    b = bias.detach().to(torch.float64) if bias is not None else None
    if b is not None and beta is not None:
        b = unfold_bias(b, w, beta, layout)
    return w, b


def relative_residual(residual: torch.Tensor, reference: torch.Tensor) -> float:
    """‖residual‖ / ‖reference‖ in fp64 (NaN for non-finite inputs; a zero reference counts as 1e-30)."""
    ref = reference.detach().to(device=residual.device, dtype=torch.float64)
    return float(residual.detach().to(torch.float64).norm() / ref.norm().clamp_min(1e-30))


class BiasMove(NamedTuple):
    """What ``unfold_added_bias`` found (all fp64, unrounded)."""

    shift: torch.Tensor  # the norm's new shift: the old one + β*
    biases: list[torch.Tensor | None]  # the other Linears' new biases b' − W'·β* (None where they have none)
    residual: torch.Tensor  # W'·β* − b' over the Linears whose bias the fold created, stacked
    added: torch.Tensor  # those biases b', stacked (the scale of the residual)

    @property
    def relative_residual(self) -> float:
        """‖W'·β* − b'‖ / ‖b'‖: 0 where β* reproduces the biases exactly."""
        return relative_residual(self.residual, self.added)


def unfold_added_bias(shift: torch.Tensor, added: Sequence[tuple[torch.Tensor, torch.Tensor, Layout]],
                      others: Sequence[tuple[torch.Tensor, torch.Tensor | None, Layout]]) -> BiasMove:
    """Move the biases a fold gave bias-less Linears back into the norm's shift.

    ``added``: (W', b', layout) of the Linears whose bias b' the fold created; ``others``: (W', b' or None,
    layout) of the norm's other Linears. Solves W'·β* = b' for all ``added`` at once (least squares, fp64, LAPACK
    ``gelsd`` on the CPU); the norm's shift becomes ``shift`` + β* and every other bias b' − W'·β*, so that
    W'·(x̂ + β*) + (b' − W'·β*) keeps the function where the residual is 0.
    """
    rows = [w.detach().to(torch.float64) if _layout(lay) == "out_in" else w.detach().to(torch.float64).t()
            for w, _, lay in added]
    a = torch.cat(rows)
    y = torch.cat([b.detach().to(torch.float64) for _, b, _ in added])
    beta = torch.linalg.lstsq(a.cpu(), y.cpu()[:, None], driver="gelsd").solution[:, 0].to(a.device)
    old = shift.detach().to(torch.float64)
    biases = [unfold_bias(b, w, beta, lay) if b is not None else None for w, b, lay in others]
    return BiasMove(old + beta.to(old.device), biases, a @ beta - y, y)


# -- functional consumers: a block of a weight's rows, the parts of an assembled bias, convolutions ---------------
def fold_weight_rows(weight: torch.Tensor, gamma: torch.Tensor, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """W with rows ``rows`` = [start, stop) (None: all) scaled as ``fold_scale`` (out_in layout), the others as
    they are: the weight of an op whose input projection reads the norm only in some rows (nn.MultiheadAttention's
    ``in_proj_weight`` when only the query, or only key and value, come from the norm)."""
    a, b = rows if rows is not None else (0, weight.shape[0])
    out = weight.detach().clone()
    out[a:b] = fold_scale(weight[a:b], gamma, "out_in")
    return out


def rows_shift(weight: torch.Tensor, beta: torch.Tensor, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """W[rows]·β in the fold's accumulation dtype, from the *unfolded* W: what the norm's shift adds to those
    outputs, to be added to whatever bias the op adds there (`add_shift`)."""
    a, b = rows if rows is not None else (0, weight.shape[0])
    acc = accumulation_dtype(weight.dtype)
    return weight.detach()[a:b].to(acc) @ beta.detach().to(device=weight.device, dtype=acc)


def add_shift(part: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """part + shift, computed in the accumulation dtype and rounded once to the part's dtype: one piece of a bias
    that an op assembles in forward (EVA's ``cat(q_bias, k_bias, v_bias)``) taking its share of W·β."""
    acc = accumulation_dtype(part.dtype)
    return (part.detach().to(acc) + shift.to(device=part.device, dtype=acc)).to(part.dtype)


def fold_conv_input(weight: torch.Tensor, bias: torch.Tensor | None, gamma: torch.Tensor,
                    beta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W', b') of a convolution (weight [out, in / groups = in, *kernel]) whose input channels are a norm's
    output: W'[o, i, k] = W[o, i, k]·γ_i and b'[o] = b[o] + Σ_{i,k} W[o, i, k]·β_i. Exact only when every output
    reads only real (un-padded) input positions: padding would see 0, not β. Rounded like ``fold_affine``."""
    acc = accumulation_dtype(weight.dtype)
    w = weight.detach().to(acc)
    g = gamma.detach().to(device=w.device, dtype=acc)
    if w.shape[1] != g.shape[0]:
        raise ValueError(f"norm has {g.shape[0]} channels but the convolution takes {w.shape[1]} per group")
    view = (1, -1) + (1,) * (w.dim() - 2)
    w_new = (w * g.view(view)).to(weight.dtype)
    if beta is None:
        return w_new, bias
    shift = conv_shift(weight, beta)
    b_new = shift if bias is None else bias.detach().to(acc) + shift
    return w_new, b_new.to(bias.dtype if bias is not None else weight.dtype)


def conv_shift(weight: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Σ_{i,k} W[o, i, k]·β_i in the accumulation dtype, from the *unfolded* W: what a per-input-channel shift β adds
    to every output of a convolution that reads no padding."""
    acc = accumulation_dtype(weight.dtype)
    w = weight.detach().to(acc)
    view = (1, -1) + (1,) * (w.dim() - 2)
    return (w * beta.detach().to(device=w.device, dtype=acc).view(view)).flatten(1).sum(1)


def unfold_weight_rows(weight: torch.Tensor, gamma: torch.Tensor, rows: tuple[int, int] | None = None
                       ) -> torch.Tensor:
    """The inverse of ``fold_weight_rows`` in fp64: rows [start, stop) of W' times diag(1/γ) (``unfold_scale``,
    with its ``UnfoldError``), the other rows as they are."""
    a, b = rows if rows is not None else (0, weight.shape[0])
    out = weight.detach().to(torch.float64).clone()
    out[a:b] = unfold_scale(weight[a:b], gamma, "out_in")
    return out


def unfold_conv_input(weight: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """The inverse of the weight part of ``fold_conv_input`` in fp64: W'[o, i, k] / γ_i (``UnfoldError`` where
    γ_i = 0 but the convolution still reads channel i)."""
    flat = weight.detach().to(torch.float64).transpose(0, 1).flatten(1).t()  # [out·k, in]: out_in over channels
    cols = unfold_scale(flat, gamma, "out_in")
    return cols.t().reshape(weight.transpose(0, 1).shape).transpose(0, 1).contiguous()
