"""The ops and converted models under ``torch.func`` transforms (ops/func_transforms.py).

Once every one of them raised "In order to use an autograd.Function with functorch transforms ... it must override
the setup_context staticmethod", a message for the op's author. Now grad, vmap, jvp and jacrev work: the
approx-BP activation with its own (approximate) backward, so per-sample gradients equal the eager per-sample
backward; the MS norms and the gated MLP as the same function through torch's ops, exact to any order.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tolerances import tol
from torch.func import functional_call, grad, jacrev, jvp, vmap

from lmbp_convert import convert
from lmbp_convert.ops import approx_act as A
from lmbp_convert.ops import gated_mlp as G
from lmbp_convert.ops import ms_norm as N
from lmbp_convert.ops.ms_norm_affine import ms_norm_affine, plain_norm_affine


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("kind", ["gelu", "silu"])
def test_approx_act_keeps_its_backward_under_grad_vmap_and_jvp(kind):
    x = torch.randn(4, 37, generator=_gen()) * 3
    w = torch.randn(4, 37, generator=_gen(1))
    xe = x.clone().requires_grad_()
    (A.approx_act(xe, kind, 2) * w).sum().backward()  # eager: the step derivative from the codes
    f = lambda t: (A.approx_act(t, kind, 2) * w).sum()  # noqa: E731
    assert torch.equal(grad(f)(x), xe.grad)
    per_row = vmap(grad(lambda r, wr: (A.approx_act(r, kind, 2) * wr).sum()))(x, w)
    assert torch.equal(per_row, xe.grad)
    y, y_t = jvp(lambda t: A.approx_act(t, kind, 2), (x,), (w,))  # forward mode: the same slope · tangent
    assert torch.equal(y, A.approx_act(x, kind, 2)) and torch.equal(y_t, xe.grad)


def _norm_cases():
    n = 16
    w = torch.rand(n, generator=_gen(2), dtype=torch.float64) + 0.5
    b = torch.randn(n, generator=_gen(3), dtype=torch.float64)
    return {
        "ms_layer_norm": (lambda t: N.ms_layer_norm(t, n, 1e-5), lambda t: F.layer_norm(t, (n,), eps=1e-5)),
        "ms_rms_norm": (lambda t: N.ms_rms_norm(t, n, 1e-6), lambda t: F.rms_norm(t, (n,), eps=1e-6)),
        "ms_norm_affine": (lambda t: ms_norm_affine(t, w, b, n, 1e-5, False),
                           lambda t: plain_norm_affine(t, w, b, n, 1e-5, False)),
        "gated_mlp": (lambda t: G.gated_mlp(t[..., :8], t[..., 8:], w[:12, None] * b[:8], b[:12], "silu"),
                      lambda t: F.linear(F.silu(t[..., :8]) * t[..., 8:], w[:12, None] * b[:8], b[:12])),
        "gated_act": (lambda t: G.gated_act(t[..., :8], t[..., 8:], "gelu"),
                      lambda t: F.gelu(t[..., :8]) * t[..., 8:]),
    }


@pytest.mark.parametrize("op", list(_norm_cases()))
def test_exact_ops_are_the_same_function_under_every_transform(op):
    """grad, per-row vmap(grad) and a second derivative (jacrev of grad, which the eager Functions refuse or
    would get wrong with rstd held constant) all equal torch's own ops."""
    ours, ref = _norm_cases()[op]
    x = torch.randn(3, 16, generator=_gen(4), dtype=torch.float64)
    c = torch.randn(3, ours(x).shape[-1], generator=_gen(5), dtype=torch.float64)
    loss = lambda fn: (lambda t: (fn(t) * c).sum())  # noqa: E731
    t64 = tol(torch.float64, "bwd")
    torch.testing.assert_close(grad(loss(ours))(x), grad(loss(ref))(x), **t64)
    row = lambda fn: (lambda r, cr: (fn(r[None])[0] * cr).sum())  # noqa: E731
    torch.testing.assert_close(vmap(grad(row(ours)))(x, c), vmap(grad(row(ref)))(x, c), **t64)
    torch.testing.assert_close(jacrev(grad(row(ours)))(x[0], c[0]), jacrev(grad(row(ref)))(x[0], c[0]), **t64)


def _family(name: str):
    from testsupport.families import FAMILIES, randomize_norms

    torch.manual_seed(0)
    model = randomize_norms(FAMILIES[name]()).eval()
    convert(model)
    return model


def _main_input(model):
    from lmbp_convert.trace.probe import make_probe

    probe = make_probe(model)[0]
    if not isinstance(probe, dict):
        return probe, None
    key = "input_ids" if "input_ids" in probe else "pixel_values"
    return probe[key], key


def _loss(model, key):
    def f(params, x):
        out = functional_call(model, params, (), {key: x}) if key else functional_call(model, params, (x,))
        out = out if isinstance(out, torch.Tensor) else out.logits if hasattr(out, "logits") else out[0]
        return out.float().pow(2).mean()
    return f


# llama: MS RMSNorms + gated MLPs; bert: post-LN re-apply hooks + approx GELU; gpt2: kept-affine norms (tied
# head); timm_vit: timm's modules, approx GELU
@pytest.mark.parametrize("family", ["llama", "bert", "gpt2", "timm_vit"])
def test_grad_and_per_sample_grads_of_a_converted_model_equal_its_backward(family):
    model = _family(family)
    kinds = {type(m).__name__ for m in model.modules() if type(m).__module__.startswith("lmbp_convert")}
    assert kinds, "nothing converted"
    x, key = _main_input(model)
    loss = _loss(model, key)
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = grad(loss)(params, x)
    per_sample = vmap(grad(lambda p, xi: loss(p, xi[None])), in_dims=(None, 0))(params, x)
    ref = copy.deepcopy(model)  # the eager backward of the same converted model
    live = dict(ref.named_parameters())
    loss(live, x).backward()
    scale = torch.sqrt(sum(p.grad.pow(2).sum() for p in live.values() if p.grad is not None))
    for k, p in live.items():
        if p.grad is not None:
            assert (g[k] - p.grad).norm() <= 1e-5 * scale, k
    for i in range(x.shape[0]):
        ref.zero_grad()
        loss(live, x[i:i + 1]).backward()
        scale = torch.sqrt(sum(p.grad.pow(2).sum() for p in live.values() if p.grad is not None))
        for k, p in live.items():
            if p.grad is not None:
                assert (per_sample[k][i] - p.grad).norm() <= 1e-5 * scale, (i, k)
