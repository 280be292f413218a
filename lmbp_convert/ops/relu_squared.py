"""Squared ReLU whose backward reads only its output: a memory-sharing activation (arXiv 2406.16282, §4).

y = relu(x)² (Primer; Nemotron's and Persimmon's ``relu2``). Its derivative 2·relu(x) is 2·√y, a function of the
output, and the output is what the following Linear keeps for its own backward anyway. So the op saves y — the
very storage that Linear saves — and nothing else: 0 bytes of its own where the unfused ops keep relu(x) (their
``relu`` and ``square`` both save it), one activation-sized tensor less per MLP.

Numerics: the forward is ``torch.square(torch.relu(x))``, bit for bit (computed in fp32 and rounded once for
bf16 / fp16, as ATen does). The backward computes grad · 2 · √y in fp32 (fp64 for fp64) with a correctly rounded
square root and rounds once to grad's dtype. In fp32 and fp64 this is the unfused gradient bit for bit: for
binary floating point sqrt(fl(r·r)) = r exactly when r² neither overflows nor underflows (|r| in about
[1.1e-19, 1.8e19] for fp32). In bf16 / fp16, y was rounded to 8 / 11 bits, so √y is r to within half that
rounding (2^-10 / 2^-12 relative) and the gradient is off from the unfused one by at most one unit in its last
place (see tests/ops/test_relu_squared.py for the measured share). Where r² overflows (y = inf) the gradient is
inf, where the unfused one is finite; the loss is then inf anyway. NaN in gives NaN out and NaN gradient, as
unfused; x ≤ 0 gives exactly 0.

Dispatch: Triton kernels for CUDA tensors of fp32 / fp16 / bf16 (one pass each way, no temporaries), the
PyTorch path everywhere else, and under ``torch.compile`` (inductor fuses its elementwise ops). Double backward
(create_graph) takes the PyTorch path, whose ops are differentiable (with √y guarded at y = 0, where d√y/dy is
infinite).
"""
from __future__ import annotations

from typing import Any

import torch

from ._common import HAS_TRITON, check_dtype, use_triton
from ._launch import LeanKernel, spec_key

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["relu_squared", "ReluSquaredFunction"]

_BLOCK = 1024
_HALF = (torch.bfloat16, torch.float16)  # √y is rounded to these before use, as torch.sqrt does


def _fwd_torch(x: torch.Tensor) -> torch.Tensor:
    return torch.square(torch.relu(x))


def _bwd_torch(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """grad · (2·√y) with the ops of the unfused backward (``grad * (2 * r)``), √y standing in for r = relu(x):
    ``torch.sqrt`` is correctly rounded in fp32 / fp64 and computes in fp32, rounded once, for bf16 / fp16, where
    that rounding gives r back. Differentiable for double backward (create_graph), with √y guarded at y = 0."""
    if torch.is_grad_enabled():  # double backward: d√y/dy is infinite at 0, keep NaN out of the graph
        pos = y > 0
        root = torch.where(pos, torch.sqrt(torch.where(pos, y, torch.ones_like(y))), torch.zeros_like(y))
        return (grad * (root * 2)).to(y.dtype)
    return torch.sqrt(y).mul_(2).mul_(grad)  # in place on the fresh √y: one tensor allocated, not three


if HAS_TRITON:

    @triton.jit
    def _relu2_fwd_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        r = tl.where(x > 0.0, x, 0.0)
        r = tl.where(x != x, x, r)  # NaN stays NaN, as torch.relu
        tl.store(y_ptr + idx, (r * r).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _relu2_bwd_kernel(g_ptr, y_ptr, dx_ptr, n, BLOCK: tl.constexpr, ROUND: tl.constexpr):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        root = tl.sqrt_rn(y)
        if ROUND:  # bf16 / fp16: relu(x) was a number of that dtype, √y rounded to it recovers it
            root = root.to(y_ptr.dtype.element_ty).to(tl.float32)
        tl.store(dx_ptr + idx, (g * 2.0 * root).to(dx_ptr.dtype.element_ty), mask=mask)

    _FWD = LeanKernel(_relu2_fwd_kernel)
    _BWD = LeanKernel(_relu2_bwd_kernel)


def _launch(kernel: Any, args: tuple, n: int, device: torch.device, consts: tuple) -> None:
    grid = (-(-n // _BLOCK), 1, 1)
    dev = device.index if device.type == "cuda" else None
    kernel.launch(spec_key(args, dev, consts, 4), grid, args, dev, consts, 4)


def _fwd_triton(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        _launch(_FWD, (x, y, x.numel()), x.numel(), x.device, (_BLOCK,))
    return y


def _bwd_triton(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    grad = grad.contiguous()
    dx = torch.empty_like(y, memory_format=torch.contiguous_format)
    if y.numel():
        _launch(_BWD, (grad, y, dx, y.numel()), y.numel(), y.device, (_BLOCK, y.dtype in _HALF))
    return dx


class ReluSquaredFunction(torch.autograd.Function):
    """relu(x)²; saves its output only (``setup_context`` style, so torch.func transforms work)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, triton_path: bool) -> torch.Tensor:
        return _fwd_triton(x) if triton_path else _fwd_torch(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(output)
        ctx.triton_path = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (y,) = ctx.saved_tensors
        fast = ctx.triton_path and grad.dtype == y.dtype and not torch.is_grad_enabled()  # create_graph: PyTorch
        return (_bwd_triton(grad, y) if fast else _bwd_torch(grad, y)), None


def relu_squared(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """relu(x)², in x's dtype, whose backward keeps only the output (see the module docstring).

    backend: None/"auto" (Triton for CUDA tensors, PyTorch otherwise), "torch" or "triton" (e.g. to run the
    kernel under TRITON_INTERPRET=1 on CPU tensors)."""
    if backend not in (None, "auto", "torch", "triton"):
        raise ValueError(f"relu_squared: backend must be None, 'auto', 'torch' or 'triton', got {backend!r}")
    check_dtype(x, "relu_squared")
    triton_path = use_triton(x) if backend in (None, "auto") else backend == "triton"
    if triton_path and backend in (None, "auto") and torch.compiler.is_compiling():
        triton_path = False  # inductor fuses the PyTorch path's elementwise ops into kernels of its own
    if triton_path and (not HAS_TRITON or x.dtype == torch.float64):
        raise ValueError(f"relu_squared: the Triton path takes fp32 / fp16 / bf16 tensors with Triton installed, "
                         f"got {x.dtype}")
    if not (x.requires_grad and torch.is_grad_enabled()):  # nothing to save
        return _fwd_triton(x) if triton_path else _fwd_torch(x)
    return ReluSquaredFunction.apply(x, triton_path)
