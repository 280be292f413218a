"""Issue 21's Done-when 1: with approximate activations off, a default conversion (exact norms) trains the same
model. On every family of the conversion matrix, with and without PEFT LoRA, the loss and the gradient of every
original parameter equal the unconverted model's up to fp32 rounding, and the same parameters get gradients. No
norm is folded under the default: channel-first norms and norms read by functional consumers (timm ConvNeXt,
BEiT, EVA02, PVT-v2) are exact norms too, so ``inexact_training`` is empty on every family. (A rewrite that
cannot be exact must be named there, and only its own tensors may differ: the helpers below keep that check.)

Tolerance: ‖Δg‖ ≤ 1e-4·‖g‖ per parameter (the rewrites reorder fp32 sums: measured worst 1.9e-6 over the
matrix), with a floor of 1e-5 × the largest gradient norm of the model for gradients that are zero in exact
arithmetic (attention key biases: softmax is shift-invariant, so both runs give rounding noise there, which scales with the cancelling terms, not with the zero).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lmbp_convert import convert
from lmbp_convert.apply.verify import float_tensors
from lmbp_convert.match.plan import NormFold
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.trace.tracer import call_model
from testsupport.families import FAMILIES as DENSE, lora_on_every_linear, nonzero_init, registry

RTOL = 1e-4
FLOOR = 1e-5
FAMILIES = registry()


def _train_adapters(*models: nn.Module) -> None:
    """The same random B in every model, as after some training steps: with B = 0 the A matrices would get no
    gradient, and a rewrite that is exact only at initialisation would pass."""
    for m in models:
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for n, p in sorted(m.named_parameters()):
                if "lora_B" in n:
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _loss_and_grads(model: nn.Module, probe) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = call_model(model, probe)
    loss = sum(t.double().pow(2).mean() for t in float_tensors(out))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _folded_tensors(report) -> list[str]:
    """Names (and prefixes) of every tensor a reparameterising rewrite changes: the norm's own γ, β, the weights
    and biases its affine went into (LoRA wrappers: the whole wrapped layer, adapters included)."""
    names = []
    for kind in report.plan.kinds():
        if not issubclass(kind, NormFold):
            continue
        for f in report.plan.of(kind):
            names.append(f.name + ".")
            names += [t.name + "." for t in f.targets]
            for p in getattr(f, "params", []):
                names.append(p.weight)
                names += [b.tensor for b in p.bias]
    return names


def check_exact(family: str, lora: bool) -> None:
    model = nonzero_init(FAMILIES[family]())
    if lora:
        model = lora_on_every_linear(model)  # converted before training, as documented
    model.eval()  # dropout off: both runs compute one function
    ref = copy.deepcopy(model)
    probe = make_probe(ref)[0]
    report = convert(model, activations=False, measure=False).lmbp_report
    assert report.verified, str(report)
    assert report.plan.kinds(), str(report)  # something was rewritten
    if lora and not report.inexact_training:
        _train_adapters(model, ref)  # a fold into a LoRA layer drops B·A·β once B ≠ 0 (it is named, see below)
    loss, got = _loss_and_grads(model, probe)
    ref_loss, want = _loss_and_grads(ref, probe)
    assert float((loss - ref_loss).abs()) <= 1e-6 * float(ref_loss.abs()), (family, float(loss), float(ref_loss))
    assert want, family
    inexact = report.inexact_training
    assert not inexact, (family, inexact)  # the exact default folds nothing
    assert set(inexact) == {f.name for k in report.plan.kinds() if issubclass(k, NormFold) for f in report.plan.of(k)}
    assert all(f"training not exact ({why}): " in str(report) for why in inexact.values()), str(report)
    folded = _folded_tensors(report)

    def excused(name: str) -> bool:
        return any(name == t or name.startswith(t) for t in folded)

    assert {n for n in set(want) ^ set(got) if not excused(n)} == set(), (family, set(want) ^ set(got))
    scale = max(float(g.double().norm()) for g in want.values())
    for name, g in want.items():
        if name not in got or excused(name):
            continue
        err = float((got[name].double() - g.double()).norm())
        assert err <= RTOL * float(g.double().norm()) or err <= FLOOR * scale, (family, name, err, float(g.norm()))



#: over 3 s a family on a 2-core CPU (windowed attention, the timm CNN-hybrids, ALBERT's shared layer)
SLOW = {"albert", "timm_convnext", "timm_hiera_160", "timm_pvt_v2", "timm_swin"}
CASES = [pytest.param(f, marks=pytest.mark.slow) if f in SLOW else f for f in sorted(FAMILIES)]
#: with LoRA, the fast loop runs the dense families (testsupport.families.FAMILIES); the slow stage all of them
LORA_CASES = [f if f in DENSE and f not in SLOW else pytest.param(f, marks=pytest.mark.slow) for f in sorted(FAMILIES)]


@pytest.mark.parametrize("family", CASES)
def test_exact_gradients_without_lora(family):
    check_exact(family, lora=False)


@pytest.mark.parametrize("family", LORA_CASES)
def test_exact_gradients_with_lora(family):
    pytest.importorskip("peft")
    check_exact(family, lora=True)


@pytest.mark.parametrize("family", ["bert", "vit", "clip_vision"])
def test_exact_norms_under_trained_adapters_with_dropout(family):
    """Adapter dropout and a trained B stop only a fold (the norm's β would have to enter the adapter); exact norms
    leave the adapter alone, so LayerNorms feeding such LoRA layers convert, and training (train mode, the same
    dropout draws) gives the original's gradients."""
    from peft import LoraConfig, get_peft_model

    from lmbp_convert.match.norm_exact import NormExact

    model = nonzero_init(FAMILIES[family]())
    targets = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.1))
    _train_adapters(model)
    ref = copy.deepcopy(model)
    probe = make_probe(ref)[0]
    report = convert(model, activations=False, measure=False).lmbp_report
    assert len(report.plan.of(NormExact)) >= 4 and not report.inexact_training, str(report)
    assert not any("lora_dropout" in s.reason or "already trained" in s.reason for s in report.plan.skips), str(report)
    model.train(), ref.train()
    torch.manual_seed(5)
    loss, got = _loss_and_grads(model, probe)
    torch.manual_seed(5)
    ref_loss, want = _loss_and_grads(ref, probe)
    assert float((loss - ref_loss).abs()) <= 1e-6 * float(ref_loss.abs()), (float(loss), float(ref_loss))
    assert set(got) == set(want) and want
    scale = max(float(g.double().norm()) for g in want.values())
    for name, g in want.items():
        err = float((got[name].double() - g.double()).norm())
        assert err <= RTOL * float(g.double().norm()) or err <= FLOOR * scale, (name, err, float(g.norm()))


def test_a_fold_still_refuses_adapter_dropout():
    """With fold_norms=True the β-into-adapter refusal stands."""
    from peft import LoraConfig, get_peft_model

    model = FAMILIES["vit"]()
    targets = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    model = get_peft_model(model, LoraConfig(r=4, target_modules=targets, lora_dropout=0.1))
    report = convert(model, fold_norms=True, activations=False, measure=False).lmbp_report
    assert any("lora_dropout=0.1" in s.reason for s in report.plan.skips), str(report)
