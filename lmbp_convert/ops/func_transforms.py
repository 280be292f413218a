"""The ops under ``torch.func`` transforms (grad, vmap, jacrev, jvp, functional_call + grad ...).

Why a separate path: the ops' eager ``autograd.Function``s save their outputs and statistics through ``ctx`` and
launch kernels (native CPU, Triton, C++) on raw memory, which functorch cannot run ("must override the
setup_context staticmethod"), and their backward formulas treat saved statistics (rstd) as constants, which is
exact for one backward but wrong for a second one (a Hessian). Inside a transform each op's entry point calls
here instead (`active`):

- MS norms (with or without γ, β) and the gated MLP compute the same function with torch's own ops, which every
  transform differentiates and batches exactly, to any order; inside a transform nothing is saved the lean way
  (functorch keeps what those ops keep).
- Approx-BP activations keep their semantics: exact forward, backward ``grad · slope[code(x)]`` from the packed
  codes, the same codes as the eager path; a setup_context Function with a generated vmap rule and a jvp (the
  same slope times the tangent), so per-sample gradients (``vmap(grad(...))``) equal the per-sample eager
  gradients.

Nothing here runs outside transforms: the eager path and its numbers are unchanged.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = ["active", "approx_act", "ms_norm", "ms_norm_affine", "gated_act", "gated_mlp"]


def active() -> bool:
    """True inside a ``torch.func`` transform (its tensors are functorch wrappers the eager ops cannot take)."""
    return torch._C._are_functorch_transforms_active()


class _ApproxAct(torch.autograd.Function):
    """Exact activation; the codes are a second, non-differentiable output so functorch can save and batch
    them."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, kind: str, bits: int):
        from . import approx_act as A

        return A._fwd_torch(x, kind, bits)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, kind, bits = inputs
        _, packed = output
        ctx.mark_non_differentiable(packed)
        ctx.save_for_backward(packed)
        ctx.spec = (kind, bits)
        ctx.packed = packed  # (jvp reads it: forward-mode saves nothing through save_for_backward)

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _grad_packed):
        from . import approx_act as A

        (packed,) = ctx.saved_tensors
        kind, bits = ctx.spec
        return A._bwd_torch(grad, packed, bits, kind), None, None

    @staticmethod
    def jvp(ctx, x_t: torch.Tensor, _kind_t, _bits_t):
        from . import approx_act as A

        kind, bits = ctx.spec
        return A._bwd_torch(x_t, ctx.packed, bits, kind), None


def approx_act(x: torch.Tensor, kind: str, bits: int) -> torch.Tensor:
    return _ApproxAct.apply(x, kind, bits)[0]


def ms_norm(x: torch.Tensor, n: int, eps: float, is_rms: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """Normalised rows of ``n`` (no affine), statistics in fp32 (fp64 for fp64), as the eager op."""
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(cdt)
    y = F.rms_norm(xf, (n,), eps=eps) if is_rms else F.layer_norm(xf, (n,), eps=eps)
    return y.to(out_dtype)


def ms_norm_affine(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], n: int, eps: float,
                   is_rms: bool, one_plus: bool, out_dtype: torch.dtype) -> torch.Tensor:
    from .ms_norm_affine import plain_norm_affine

    return plain_norm_affine(x, weight, bias, n, eps, is_rms, one_plus, out_dtype)


def gated_act(g: torch.Tensor, u: torch.Tensor, act: str) -> torch.Tensor:
    from .activations import ACTIVATIONS

    md = torch.promote_types(g.dtype, u.dtype)
    return ACTIVATIONS[act].torch_fwd(g.to(md)) * u.to(md)


def gated_mlp(g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: str,
              lora_meta: Sequence[tuple[float, bool]], lora: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    """``down(act(g)·u)`` plus the LoRA adapters, with the eager op's casts (`gated_mlp.GatedMLPFunction`)."""
    from . import gated_mlp as G

    dev = "cuda" if g.is_cuda else g.device.type
    ac = G._autocast_dtype(dev)
    with G._no_autocast(dev):
        return G._down(gated_act(g, u, act), weight, bias, lora_meta, lora, ac)
