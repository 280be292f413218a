"""Pure tensor maths of folding a norm's affine into the Linear layers that consume it.

y = W·(γ ⊙ x̂ + β) + b  =  (W·diag(γ))·x̂ + (b + W·β)

Computed in fp32 (fp64 for fp64 weights), stored in the weight's own dtype. ``layout`` is "out_in" for
nn.Linear (weight [out, in]) and "in_out" for Hugging Face Conv1D (weight [in, out]).
"""
from __future__ import annotations

import torch


def effective_scale(weight: torch.Tensor, param: str) -> torch.Tensor:
    """The multiplier a norm applies: ``w`` or, for Gemma-style norms, ``1 + w`` (fp32)."""
    w = weight.detach().to(torch.float64 if weight.dtype == torch.float64 else torch.float32)
    if param == "w":
        return w
    if param == "1+w":
        return 1.0 + w
    raise ValueError(f"unknown norm weight parameterisation {param!r}")


def identity_weight_value(param: str) -> float:
    """Weight value that makes the norm's affine the identity (1 for w, 0 for 1 + w)."""
    return {"w": 1.0, "1+w": 0.0}[param]


def fold_affine(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gamma: torch.Tensor,
    beta: torch.Tensor | None,
    layout: str = "out_in",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (W', b') with W' = W·diag(γ), b' = b + W·β; b' is None only if both b and β are None."""
    if layout not in ("out_in", "in_out"):
        raise ValueError(f"unknown weight layout {layout!r}")
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    w = weight.detach().to(acc)
    g = gamma.detach().to(device=w.device, dtype=acc)
    in_dim = w.shape[1] if layout == "out_in" else w.shape[0]
    if g.shape != (in_dim,):
        raise ValueError(f"norm has {tuple(g.shape)} channels but the Linear takes {in_dim} inputs")
    w_new = w * g if layout == "out_in" else w * g[:, None]
    b_new = None
    if beta is not None:
        be = beta.detach().to(device=w.device, dtype=acc)
        shift = w @ be if layout == "out_in" else be @ w
        b_new = shift if bias is None else bias.detach().to(acc) + shift
    elif bias is not None:
        b_new = bias.detach().to(acc)
    out_b = None
    if b_new is not None:
        out_b = b_new.to(bias.dtype if bias is not None else weight.dtype)
    return w_new.to(weight.dtype), out_b


def apply_affine(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor | None) -> torch.Tensor:
    """γ ⊙ x + β over the last dim, in the usual type-promotion (used where the affine is re-applied)."""
    y = x * gamma
    return y + beta if beta is not None else y


def shift_of(weight: torch.Tensor, beta: torch.Tensor, layout: str = "out_in") -> torch.Tensor:
    """W·β: what a shift β before a Linear adds to its output (differentiable; in the weight's dtype, so
    autocast casts it like the Linear's own weight)."""
    if layout == "out_in":
        return torch.nn.functional.linear(beta.to(weight.dtype), weight)
    if layout == "in_out":
        return beta.to(weight.dtype) @ weight
    raise ValueError(f"unknown weight layout {layout!r}")


def shift_through_scale(beta: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """β / γ: the shift that, placed *after* the scale, gives the same affine: γ·x̂ + β = γ·(x̂ + β/γ). A norm
    folded into bias-less Linears keeps this shift (W'·(x̂ + β/γ) = W·(γ·x̂ + β) with W' = W·diag(γ)). Channels
    with γ = 0 need β = 0 there (checked by the planner); they get 0. Computed in float64, stored as β."""
    b, g = beta.detach().double(), gamma.detach().double().to(beta.device)
    return torch.where(g == 0, torch.zeros_like(b), b / torch.where(g == 0, torch.ones_like(g), g)).to(beta.dtype)


def shift_is_expressible(beta: torch.Tensor, gamma: torch.Tensor) -> bool:
    """Can β move behind the scale (``shift_through_scale``)? Not where γ = 0 but β ≠ 0."""
    if beta.device.type == "meta" or gamma.device.type == "meta":
        return True
    return not bool(((gamma.detach() == 0) & (beta.detach().to(gamma.device) != 0)).any())
