"""The one activation table shared by every op (approx-BP activations, the gated MLP).

Each kind has one integer code (the kernels' ``ACT`` constexpr), one PyTorch forward (ATen's fused kernels in
the input's own dtype: fp32 math inside, one rounding), one exact PyTorch derivative, and one Triton branch in
`act_f32` / `act_and_grad_f32`. Unknown names raise (`act_code`); an unknown code fails Triton's compile
(``tl.static_assert``) instead of falling through to another activation. Fitted approx-BP constants live in
``data/approx_constants.json`` under the same names (``ops/fit.py`` fits a new kind).

Adding a kind: one `Activation` entry below, one branch in each Triton helper, its constants in the JSON.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from ._common import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["Activation", "ACTIVATIONS", "ACT_NAMES", "act_code", "get_activation"]


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x·sigmoid(1.702 x), computed in fp32 (fp64 for fp64) and rounded once, like the fused kernels."""
    xf = x if x.dtype == torch.float64 else x.to(torch.float32)
    return (xf * torch.sigmoid(1.702 * xf)).to(x.dtype)


def _quick_gelu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(1.702 * x)
    return grad * (s + 1.702 * x * s * (1 - s))


class Activation(NamedTuple):
    """One activation kind. ``code``: the kernels' ACT constexpr. ``torch_fwd(x)``: the activation in x's dtype.
    ``torch_grad(grad, x)``: grad · act'(x) (exact), in the promoted dtype."""

    name: str
    code: int
    torch_fwd: Callable[[torch.Tensor], torch.Tensor]
    torch_grad: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


ACTIVATIONS: dict[str, Activation] = {a.name: a for a in (
    Activation("gelu", 0, F.gelu, lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="none")),
    Activation("gelu_tanh", 1, lambda x: F.gelu(x, approximate="tanh"),
               lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh")),
    Activation("silu", 2, F.silu, torch.ops.aten.silu_backward),
    Activation("quick_gelu", 3, _quick_gelu, _quick_gelu_backward),
)}
ACT_NAMES: tuple[str, ...] = tuple(ACTIVATIONS)
if sorted(a.code for a in ACTIVATIONS.values()) != list(range(len(ACTIVATIONS))):  # pragma: no cover
    raise AssertionError("activation codes must be 0..n-1, each once")


def get_activation(name: str, allowed: tuple[str, ...] = ACT_NAMES, op: str = "activation") -> Activation:
    """The table entry for ``name``; ValueError naming the op and the allowed kinds otherwise."""
    if name not in allowed or name not in ACTIVATIONS:
        raise ValueError(f"{op}: unknown activation kind {name!r}; expected one of {', '.join(allowed)}")
    return ACTIVATIONS[name]


def act_code(name: str, allowed: tuple[str, ...] = ACT_NAMES, op: str = "activation") -> int:
    """The kernels' ACT code for ``name`` (ValueError for unknown names)."""
    return get_activation(name, allowed, op).code


if HAS_TRITON:

    @triton.jit
    def act_f32(x, ACT: tl.constexpr):
        """The activation of fp32 ``x`` by table code; saturates cleanly at ±inf."""
        if ACT == 0:  # gelu (erf)
            y = x * 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
        elif ACT == 1:  # gelu (tanh): 0.5 x (1 + tanh(u)) == x * sigmoid(2u)
            u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            y = x / (1.0 + tl.exp(-2.0 * u))
        elif ACT == 2:  # silu, as ATen: x / (1 + exp(-x))
            y = x / (1.0 + tl.exp(-x))
        elif ACT == 3:  # quick_gelu: x * sigmoid(1.702 x)
            y = x / (1.0 + tl.exp(-1.702 * x))
        else:
            tl.static_assert(False, "unknown activation code")
        return y

    @triton.jit
    def act_and_grad_f32(x, ACT: tl.constexpr):
        """(act(x), act'(x)); act(x) is `act_f32`'s very expression, so a recompute is bitwise the forward."""
        y = act_f32(x, ACT)
        if ACT == 0:
            cdf = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
            dy = cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
        elif ACT == 1:
            u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            s = 1.0 / (1.0 + tl.exp(-2.0 * u))  # (1 + tanh(u)) / 2
            dy = s + 2.0 * x * s * (1.0 - s) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
        elif ACT == 2:
            s = 1.0 / (1.0 + tl.exp(-x))
            dy = s * (1.0 + x * (1.0 - s))
        elif ACT == 3:
            s = 1.0 / (1.0 + tl.exp(-1.702 * x))
            dy = s + 1.702 * x * s * (1.0 - s)
        else:
            tl.static_assert(False, "unknown activation code")
        return y, dy
