"""convert() on tiny random-init models of every family the issue names: exact outputs, real byte savings,
training works, gradients as the paper says (MS-BP exact, approx-BP the step-derivative reference's)."""
import copy

import pytest
import torch

from lmbp_convert import SavedTensorLedger, convert
from lmbp_convert.match.norm_exact import NormExact
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.trace.tracer import call_model
from approx_reference import step_derivative, with_step_backward
from testsupport.families import FAMILIES, hf, hf_auto, timm_model


def _outputs(model, probe):
    with torch.no_grad():
        out = call_model(model, probe)
    return out.logits if hasattr(out, "logits") else (out.last_hidden_state if hasattr(out, "last_hidden_state") else out)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.compat
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_converts_with_exact_outputs(family):
    model = FAMILIES[family]().eval()
    ref_model = copy.deepcopy(model)
    probe, _, _ = make_probe(model, batch=3, seq=11)
    report = convert(model).lmbp_report
    assert report.verified, str(report)
    assert report.plan.of(NormExact) and not report.plan.norm_folds, str(report)  # the exact default
    assert report.plan.act_swaps or report.plan.gated_mlps, str(report)
    err = _rel(_outputs(model, probe), _outputs(ref_model, probe))
    assert err <= 1e-5, (family, err)
    # a training step runs
    model.train()
    out = call_model(model, probe)
    logits = out.logits if hasattr(out, "logits") else (out.last_hidden_state if hasattr(out, "last_hidden_state") else out)
    logits.float().pow(2).mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads if g is not None)
    assert sum(g is not None for g in grads) > len(grads) // 2


def _saved(model, probe, autocast):
    model.train()
    with SavedTensorLedger(model) as led:
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                call_model(model, probe)
        else:
            call_model(model, probe)
    return led.bytes


# (family, minimum relative reduction of saved-for-backward bytes) — issue 3's targets
TARGETS = [("llama", 0.30), ("timm_vit", 0.30), ("vit", 0.30), ("bert", 0.20)]


@pytest.mark.compat
@pytest.mark.parametrize("family,target", TARGETS)
@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast"])
def test_saved_bytes_reduction(family, target, mode):
    # BERT with eager attention: CPU's SDPA math fallback upcasts bf16 attention to fp32 copies that no GPU
    # kernel keeps, which would make the CPU count unrepresentative (both variants are in the benchmarks/ package).
    model = FAMILIES[family]() if family != "bert" else hf("bert", head="cls", attn_implementation="eager")
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    probe, _, _ = make_probe(model, batch=2, seq=32)
    torch.manual_seed(0)
    before = _saved(model, probe, mode == "autocast")
    convert(model)
    torch.manual_seed(0)
    after = _saved(model, probe, mode == "autocast")
    reduction = 1 - after / before
    print(f"{family} {mode}: {before} -> {after} bytes ({reduction:.1%})")
    assert reduction >= target, (family, mode, before, after)


def _named_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("fold", [False, True], ids=["exact", "fold"])
@pytest.mark.parametrize("family", ["llama", "gemma", "gpt2", "bert", "timm_vit", "timm_swin"])
def test_norm_only_gradients_equal_original(family, fold):
    """MS-BP is exact: with only norms converted, gradients match the original's (the fold's mapped back to the
    original parameterisation; the exact default's are the original parameters' own, every one of them)."""
    model = FAMILIES[family]().eval()  # eval: dropout off, so both runs see the same function
    ref = copy.deepcopy(model)
    probe, _, _ = make_probe(model)
    report = convert(model, activations=False, gated_mlp=False, fold_norms=fold).lmbp_report
    for m in (model, ref):
        out = _outputs_grad(m, probe)
        out.double().pow(2).mean().backward()
    g_new, g_ref = _named_grads(model), _named_grads(ref)
    folded = {t.name: f for f in report.plan.norm_folds for t in f.targets}
    ref_params = dict(ref.named_parameters())
    checked = 0
    scale = max(g.abs().max().item() for g in g_ref.values())
    for name, g in g_ref.items():
        mod_name, _, leaf = name.rpartition(".")
        if mod_name in folded and leaf == "weight":
            f = folded[mod_name]
            norm_w = ref_params[f.name + ".weight"].detach()
            gamma = norm_w + 1 if f.param == "1+w" else norm_w
            t = next(t for t in f.targets if t.name == mod_name)
            # W' = W·diag(γ), b' = b + W·β  ⇒  dL/dW = dL/dW'·diag(γ) + dL/db' ⊗ β
            # (β kept by the norm as β/γ for bias-less Linears: W'·(x̂ + β/γ) ⇒ dL/dW = dL/dW'·diag(γ))
            got = g_new[name] * (gamma if t.layout == "out_in" else gamma[:, None])
            if f.has_bias and f.beta == "fold":
                beta = ref_params[f.name + ".bias"].detach()
                g_b = g_new[mod_name + ".bias"]
                got = got + (torch.outer(g_b, beta) if t.layout == "out_in" else torch.outer(beta, g_b))
        elif mod_name in {f.name for f in report.plan.norm_folds}:
            continue  # γ, β kept only for re-applied branches (post-LN): part of the gradient moved to W'
        elif name in g_new:
            got = g_new[name]
        else:
            continue  # the norm's own γ, β: folded away
        rel = float((got - g).norm() / g.norm().clamp_min(1e-30))
        assert rel <= 1e-5 or float((got - g).abs().max()) <= 1e-6 * scale, (name, rel)
        checked += 1
    assert checked >= len(g_ref) // 2
    if not fold:  # nothing folded: every original parameter has its own gradient, equal to the original's
        assert report.plan.of(NormExact) and not report.plan.norm_folds, str(report)
        assert set(g_new) == set(g_ref) and checked == len(g_ref)


def _outputs_grad(model, probe):
    out = call_model(model, probe)
    return out.logits if hasattr(out, "logits") else (out.last_hidden_state if hasattr(out, "last_hidden_state") else out)


def _worst_grad_error(got: dict, want: dict) -> float:
    """max over parameters of ‖Δg‖ / max(‖g‖, 1e-5 · the largest ‖g‖) (the floor: gradients that are zero in exact
    arithmetic, such as attention key biases, are rounding noise in both runs)."""
    assert set(got) == set(want)
    floor = 1e-5 * max(float(g.double().norm()) for g in want.values())
    return max(float((got[n].double() - g.double()).norm()) / max(float(g.double().norm()), floor)
               for n, g in want.items())


APPROX_FAMILIES = ["llama", "gpt2", "bert", "vit", "clip_vision", "timm_vit"]


def _approx_grads(family, slope=step_derivative):
    """Gradients of the converted model (approximate activations on) and of the unconverted one whose swapped
    activations have the plain-PyTorch reference backward (tests/approx_reference.py) with ``slope``."""
    model = FAMILIES[family]().eval()
    ref = copy.deepcopy(model)
    probe, _, _ = make_probe(model)
    report = convert(model, gated_mlp=False, measure=False).lmbp_report  # LLaMA: approx SiLU, not the fused MLP
    assert report.plan.act_swaps and report.verified, str(report)
    with_step_backward(ref, report.plan.act_swaps, slope)
    for m in (model, ref):
        _outputs_grad(m, probe).double().pow(2).mean().backward()
    return _named_grads(model), _named_grads(ref)


@pytest.mark.parametrize("family", APPROX_FAMILIES)
def test_approx_activation_gradients_equal_the_step_reference(family):
    """Approx-BP's gradients are the reference's: exact forward, grad · slope[code] backward, every parameter
    within fp32 rounding (1e-4 relative; exact norms and the swapped activations change only sum orders)."""
    got, want = _approx_grads(family)
    assert _worst_grad_error(got, want) <= 1e-4, family


@pytest.mark.parametrize("slope", [lambda x, k, b: torch.ones_like(x, dtype=torch.float64),
                                   lambda x, k, b: torch.zeros_like(x, dtype=torch.float64)],
                         ids=["straight_through", "zero_slopes"])
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_the_step_reference_tells_wrong_slopes_apart(family, slope):
    """The comparison above can fail: a straight-through (slope 1) or zero-slope backward is far outside it."""
    got, want = _approx_grads(family, slope)
    assert _worst_grad_error(got, want) > 1e-2, family


@pytest.mark.parametrize("build, size", [
    (lambda: timm_model("swin_tiny_patch4_window7_224", depths=(1, 1, 1, 1), embed_dim=32, num_heads=(1, 1, 1, 1),
                        strict_img_size=False), 256),
    (lambda: hf_auto("AutoModelForImageClassification", "swin", image_size=32, patch_size=4, embed_dim=16,
                     depths=[1, 1], num_heads=[1, 1], window_size=4, num_labels=10), 40),
], ids=["timm_swin", "hf_swin"])
def test_swin_window_padding_is_exact_at_another_image_size(build, size):
    """Swin pads each block's normed tokens up to whole windows: a no-op at the size the model was built for
    (the probe's), not at others. A fold of the norm's β through that pad would give the padded positions W·β;
    the fold is refused there with the reason, so every image size gives the original's outputs."""
    model = build().eval()
    ref_model = copy.deepcopy(model)
    report = convert(model).lmbp_report
    assert report.verified, str(report)
    refused = [s for s in report.plan.skips if "no-op at the probe's shape" in s.reason]
    assert refused and all("W·β" in s.reason for s in refused), str(report)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    assert _rel(_outputs(model, x), _outputs(ref_model, x)) <= 1e-5
