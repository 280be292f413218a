"""Double backward through a converted model (issue 33, item 5): an input-gradient penalty,
``g = autograd.grad(loss, inputs, create_graph=True)[0]; g.pow(2).sum().backward()``, on tiny LLaMA, BERT (its LM
head: a LayerNorm before the tied decoder, kept-affine under fold_norms=True) and a timm ViT in fp32, against the
unconverted model.

- exact rewrites (``activations=False``: approx-BP off): every parameter's penalty gradient is the original's
  within 1e-4 relative (the first-order tolerance of test_convert_exact_gradients.py);
- the defaults run (approx-BP activations give the derivative of their approximate backward, see docs/usage.md);
  LLaMA, which has no standalone GELU / SiLU (its gated MLP is exact), matches too;
- ``fold_norms=True`` (folded memory-sharing norms, kept-affine norms): every parameter no fold rewrote matches.

Attention runs as eager ops: torch's CPU flash attention has no double backward, so the original cannot compute
the penalty with it either.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmbp_convert import convert
from lmbp_convert.match.plan import NormFold
from testsupport.families import hf, nonzero_init, timm_vit

RTOL = 1e-4
FLOOR = 1e-5  # × the largest gradient norm: gradients that are 0 in exact arithmetic (rounding noise on both sides)


def _vit() -> nn.Module:
    model = timm_vit()
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False  # F.scaled_dot_product_attention: no double backward on CPU
    return model


#: family -> (model, input name or None for a positional input, input, loss of the output)
def _case(family: str):
    gen = torch.Generator().manual_seed(4)
    if family == "llama":
        labels = torch.randint(0, 128, (2, 8), generator=gen)
        return (hf("llama", attn_implementation="eager"), "inputs_embeds", torch.randn(2, 8, 64, generator=gen),
                dict(labels=labels), lambda out: out.loss)
    if family == "bert":  # the LM head: a tied decoder after a LayerNorm (kept-affine under fold_norms=True)
        labels = torch.randint(0, 128, (2, 8), generator=gen)
        return (hf("bert", is_decoder=True, attn_implementation="eager"), "inputs_embeds",
                torch.randn(2, 8, 64, generator=gen), dict(labels=labels), lambda out: out.loss)
    labels = torch.tensor([3, 7])
    return _vit(), None, torch.randn(2, 3, 32, 32, generator=gen), {}, lambda out: F.cross_entropy(out, labels)


def _penalty_grads(model: nn.Module, key, inp: torch.Tensor, extra: dict, loss_of) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    x = inp.clone().requires_grad_()
    out = model(**{key: x}, **extra) if key else model(x)
    (g,) = torch.autograd.grad(loss_of(out), x, create_graph=True)
    penalty = g.pow(2).sum()
    penalty.backward()
    return float(penalty), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _folded(report) -> list[str]:
    """Names (prefixes) of every tensor a fold rewrote: the norm and the modules its affine went into."""
    names = []
    for kind in report.plan.kinds():
        if issubclass(kind, NormFold):
            for f in report.plan.of(kind):
                names += [f.name + "."] + [t.name + "." for t in f.targets]
                for p in getattr(f, "params", []):
                    names += [p.weight] + [b.tensor for b in p.bias]
    return names


def _compare(family: str, **options) -> tuple[float, list[str]]:
    """Max relative error of the converted model's penalty gradients (parameters no fold rewrote) against the
    original's, and the names compared."""
    model, key, inp, extra, loss_of = _case(family)
    model = nonzero_init(model).eval()
    ref = copy.deepcopy(model)
    report = convert(model, measure=False, **options).lmbp_report
    assert report.plan.kinds(), str(report)
    p_ref, want = _penalty_grads(ref, key, inp, extra, loss_of)
    p_got, got = _penalty_grads(model, key, inp, extra, loss_of)
    folded = _folded(report)
    names = [n for n in want if not any(n == t or n.startswith(t) for t in folded)]
    assert names and set(names) <= set(got), (family, set(names) - set(got))
    scale = max(float(want[n].double().norm()) for n in names)
    worst = 0.0
    for n in names:
        err = float((got[n].double() - want[n].double()).norm())
        norm = float(want[n].double().norm())
        if err > FLOOR * scale:
            worst = max(worst, err / norm)
    if not folded:
        assert abs(p_got - p_ref) <= 1e-4 * abs(p_ref), (family, p_got, p_ref)
    return worst, names


FAMILIES = ("llama", "bert", "timm_vit")


@pytest.mark.parametrize("family", FAMILIES)
def test_penalty_with_exact_rewrites_is_the_originals(family):
    worst, _ = _compare(family, activations=False)
    assert worst <= RTOL, (family, worst)


@pytest.mark.parametrize("family", FAMILIES)
def test_penalty_runs_with_the_defaults(family):
    model, key, inp, extra, loss_of = _case(family)
    model = nonzero_init(model).eval()
    ref = copy.deepcopy(model)
    convert(model, measure=False)
    _, want = _penalty_grads(ref, key, inp, extra, loss_of)
    penalty, got = _penalty_grads(model, key, inp, extra, loss_of)
    assert set(got) == set(want) and all(torch.isfinite(g).all() for g in got.values())
    if family == "llama":  # no standalone activation: the default conversion is exact
        worst, _ = _compare(family)
        assert worst <= RTOL, worst


@pytest.mark.parametrize("family", FAMILIES)
def test_penalty_with_folded_norms(family):
    worst, names = _compare(family, activations=False, fold_norms=True)
    assert worst <= RTOL, (family, worst)
