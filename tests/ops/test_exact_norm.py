"""The exact norm's one CPU node (ops/exact_norm.py) against its two-op composition, norm_affine(ms_norm(x)):
bitwise the same y and x̂, bitwise the same dx, dw and dβ (the same kernels on the same tensors), with the native
kernels and on the PyTorch path (`cpu_native.disabled`, as under LMBP_CPU_NATIVE=0)."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from lmbp_convert.ops.backends import cpu_native as N
from lmbp_convert.ops.exact_norm import exact_norm_cpu
from lmbp_convert.ops.ms_norm import ms_norm_unchecked
from lmbp_convert.ops.norm_affine import norm_affine

LOW = (torch.float32, torch.bfloat16, torch.float16)


def _two_ops(x, n, eps, is_rms, w, b, one_plus, out):
    xhat = ms_norm_unchecked(x, n, eps, is_rms)
    rows = xhat.reshape(*x.shape[:x.dim() - w.dim()], n)
    y = norm_affine(rows, w.reshape(-1), None if b is None else b.reshape(-1), one_plus, out)
    return y.view(x.shape), xhat


def _grads(fn, x, w, b, g):
    y, xhat = fn()
    ins = [t for t in (x, w, b) if t is not None and t.requires_grad]
    return (y.detach(), xhat.detach(), *torch.autograd.grad(y, ins, g))


@pytest.mark.parametrize("native", (True, False))
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("is_rms,bias,one_plus", [(False, True, False), (False, False, False), (True, False, True),
                                                  (True, False, False)])
def test_one_node_is_bitwise_the_two_ops(native, dtype, is_rms, bias, one_plus):
    if native and not N.available():
        pytest.skip(f"native CPU kernels unavailable: {N.status()}")
    for shape, norm_shape, autocast in (((3, 5, 37), (37,), False), ((2, 9, 768), (768,), True),
                                        ((4, 3, 6, 5), (6, 5), False), ((7, 33), (33,), True)):
        torch.manual_seed(len(shape) + shape[-1])
        x0 = (torch.randn(*shape) * 2 + 1).to(dtype)
        w = (torch.rand(norm_shape) + 0.5).to(dtype).requires_grad_()
        b = torch.randn(norm_shape).to(dtype).requires_grad_() if bias else None
        n = 1
        for s in norm_shape:
            n *= s
        outs = []
        for fused in (True, False):
            x = x0.clone().requires_grad_()
            g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
            ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
            with (contextlib.nullcontext() if native else N.disabled()), ctx:
                xdt = torch.bfloat16 if autocast and dtype != torch.float64 else dtype
                out = torch.float32 if autocast else dtype
                if fused:
                    run = (lambda: exact_norm_cpu(x, n, 1e-5, is_rms, w, b, one_plus, out, xdt))
                else:
                    run = (lambda: _two_ops(x, n, 1e-5, is_rms, w, b, one_plus, out))
                outs.append(_grads(run, x, w, b, g.to(out)))
        for a, e in zip(*outs):
            assert a.dtype == e.dtype and a.shape == e.shape
            assert torch.equal(a, e)


def test_not_for_other_devices_dtypes_or_transforms():
    w = torch.ones(8)
    assert exact_norm_cpu(torch.randn(2, 8).double(), 8, 1e-5, False, w.double(), None, False, torch.float64,
                          torch.float64) is None
    assert exact_norm_cpu(torch.randn(2, 8, device="meta"), 8, 1e-5, False, w.to("meta"), None, False,
                          torch.float32, torch.float32) is None
    seen = []
    torch.func.grad(lambda t: seen.append(exact_norm_cpu(t, 8, 1e-5, False, w, None, False, torch.float32,
                                                         torch.float32)) or t.sum())(torch.randn(2, 8))
    assert seen == [None]


def test_double_backward_is_the_norms_own():
    """create_graph=True: x̂ and rstd are outputs of the node, so the backward's torch ops differentiate back to x
    (tests/ops/test_double_backward.py compares every variant with torch's norm)."""
    x = torch.randn(3, 16, requires_grad=True)
    w = (torch.rand(16) + 0.5).requires_grad_()
    y, _ = exact_norm_cpu(x, 16, 1e-5, False, w, None, False, torch.float32, torch.float32)
    gx, gw = torch.autograd.grad(y.square().sum(), (x, w), create_graph=True)
    got = torch.autograd.grad(gx.pow(3).sum() + gw.pow(2).sum(), (x, w))
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    gxr, gwr = torch.autograd.grad(F.layer_norm(xr, (16,), wr, None, 1e-5).square().sum(), (xr, wr), create_graph=True)
    for a, b in zip(got, torch.autograd.grad(gxr.pow(3).sum() + gwr.pow(2).sum(), (xr, wr))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
