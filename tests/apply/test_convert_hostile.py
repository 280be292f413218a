"""Hostile uses of convert(): ambient modes, odd output containers, hooks that only observe."""
from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from torch import nn

from lmbp_convert import convert
from lmbp_convert.errors import NothingToConvertError
from lmbp_convert.trace.probe import make_probe
from testsupport.families import hf


def test_convert_inside_inference_mode_leaves_a_trainable_model():
    """Folded weights made under ``torch.inference_mode()`` would be inference tensors: training then fails
    with "Inference tensors cannot be saved for backward"."""
    model = hf("llama")
    with torch.inference_mode():
        convert(model)
    assert model.lmbp_report.verified, str(model.lmbp_report)
    assert not any(p.is_inference() for p in model.parameters())
    assert not any(b.is_inference() for b in model.buffers())
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    model.train()
    model(ids, labels=ids).loss.backward()
    assert model.model.layers[0].mlp.down_proj.weight.grad is not None


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    hidden: torch.Tensor


class _DataclassHead(nn.Module):
    """Returns its final norm's output (also fed to the head) in a dataclass field, not a ModelOutput."""

    def __init__(self, frozen: bool = False):
        super().__init__()
        self.a, self.n, self.h = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)
        self.out_cls = _FrozenOut if frozen else _Out
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            self.n.weight.copy_(torch.rand(16, generator=gen) + 0.5)
            self.n.bias.copy_(torch.randn(16, generator=gen))

    def forward(self, x):
        h = self.n(self.a(x))
        return self.out_cls(self.h(h), h)


@dataclasses.dataclass(frozen=True)
class _FrozenOut:
    logits: torch.Tensor
    hidden: torch.Tensor


@pytest.mark.parametrize("frozen", [False, True])
def test_dataclass_output_fields_are_traced_verified_and_get_the_affine_back(frozen):
    """Before: the trace did not see the returned norm output inside the dataclass (so no re-apply: hidden off
    by ~2) and verification found no tensor to compare ("cannot verify" blaming NaN outputs)."""
    torch.manual_seed(0)
    model = _DataclassHead(frozen).eval()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cannot verify" warning
        rep = convert(model, probe=x).lmbp_report
    assert rep.verification == "passed" and rep.verified, str(rep)
    with torch.no_grad():
        got, want = model(x), ref(x)
    torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)


class _NoFloatOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.act, self.h = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)

    def forward(self, x):
        return self.h(self.act(self.a(x))).argmax(-1)  # integer output: nothing to compare


def test_output_without_float_tensors_cannot_verify_and_says_why():
    model = _NoFloatOutput()
    with pytest.warns(UserWarning, match="holds no floating-point tensor"):
        rep = convert(model, probe=torch.randn(2, 8)).lmbp_report
    assert rep.verification == "cannot verify" and rep.verified is None
    assert "holds no floating-point tensor" in str(rep) and "NaN" not in str(rep)


def test_pre_hooks_on_blocks_that_receive_a_norm_output_refuse_that_fold():
    """A forward pre-hook on ``self_attn`` / ``mlp`` (activation capture, steering) sees the norm's output: with
    the affine folded into q/k/v it would silently see x̂ instead of γ·x̂ (an observing hook passes verification)."""
    model = hf("llama").eval()
    probe, _, _ = make_probe(model)
    seen = {}
    for name in ("model.layers.0.self_attn", "model.layers.1.mlp"):
        model.get_submodule(name).register_forward_pre_hook(
            lambda m, args, kwargs, n=name: seen.__setitem__(n, args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True)
    with torch.no_grad():
        model(**probe)
    before = dict(seen)
    rep = convert(model).lmbp_report
    skips = {s.name: s.reason for s in rep.plan.skips}
    assert "forward pre-hooks" in skips["model.layers.0.input_layernorm"], str(rep)
    assert "forward pre-hooks" in skips["model.layers.1.post_attention_layernorm"], str(rep)
    assert "model.layers.1.input_layernorm" in rep.swapped  # unwatched norms are still converted
    with torch.no_grad():
        model(**probe)
    for name, value in before.items():
        torch.testing.assert_close(seen[name], value, rtol=1e-5, atol=1e-5)


class _DropoutBetween(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.n, self.d, self.h = nn.Linear(8, 16), nn.LayerNorm(16), nn.Dropout(0.0), nn.Linear(16, 4)
        with torch.no_grad():
            self.n.weight.uniform_(0.5, 1.5)
            self.n.bias.normal_()

    def forward(self, x):
        return self.h(self.d(self.n(self.a(x))))


def test_forward_hook_on_a_module_returning_the_norm_output_refuses_the_fold():
    torch.manual_seed(0)
    model = _DropoutBetween()
    model.d.register_forward_hook(lambda m, args, out: None)  # observes x̂ vs γ·x̂ + β
    with pytest.raises(NothingToConvertError, match="d returns the norm's output and has forward hooks"):
        convert(model, probe=torch.randn(2, 8), keep_affine=False)
    assert isinstance(model.n, nn.LayerNorm)
    bare = _DropoutBetween()
    bare.d.register_forward_pre_hook(lambda m, args: None)
    with pytest.raises(NothingToConvertError, match="d has forward pre-hooks"):
        convert(bare, probe=torch.randn(2, 8), keep_affine=False)
    # by default the norm keeps its affine instead (h keeps its output anyway): the hook sees γ·x̂ + β as before
    seen = []
    watched = _DropoutBetween()
    watched.d.register_forward_hook(lambda m, args, out: seen.append(out.detach().clone()))
    x = torch.randn(2, 8)
    watched(x)
    (keep,) = convert(watched, probe=x, fold_norms=True).lmbp_report.plan.items
    assert keep.tag == "norm_keeps" and "forward hooks" in keep.fold_refused
    watched(x)
    torch.testing.assert_close(seen[-1], seen[0])
    assert "n" in convert(_DropoutBetween(), probe=torch.randn(2, 8), fold_norms=True).lmbp_report.swapped
    # the exact default swaps it too (nothing is folded, so nothing for the hook to see differently)
    seen.clear()
    exact = _DropoutBetween()
    exact.d.register_forward_hook(lambda m, args, out: seen.append(out.detach().clone()))
    exact(x)
    (item,) = convert(exact, probe=x).lmbp_report.plan.items
    assert item.tag == "norm_exact"
    exact(x)
    torch.testing.assert_close(seen[-1], seen[0])


@pytest.mark.parametrize("fold", [False, True], ids=["exact", "fold"])
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_output_hidden_states_match_the_original(family, fold):
    """The hidden states are module outputs (a post-LN layer's is its norm's output; the last is the final norm's,
    which leaves the backbone): with ``fold_norms=True`` those norms stay exact (match/doors.py)."""
    model = hf("llama") if family == "llama" else hf("bert", head="cls")
    model.eval()
    ref = copy.deepcopy(model)
    probe, _, _ = make_probe(model)
    convert(model, fold_norms=fold)
    with torch.no_grad():
        got, want = model(**probe, output_hidden_states=True), ref(**probe, output_hidden_states=True)
    for a, b in zip(got.hidden_states, want.hidden_states):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _scripted_case(family: str, what: str):
    """A family model (random γ, β) with one module replaced by its ``torch.jit.script`` version: the first norm the
    plan folds (``what="norm"``) or the first Linear that norm folds into (``"linear"``)."""
    from testsupport.families import FAMILIES, randomize_norms
    from lmbp_convert import plan_conversion
    from lmbp_convert.match.plan import NormFold

    torch.manual_seed(0)
    model = randomize_norms(FAMILIES[family]()).eval()
    fold = next(i for i in plan_conversion(model, fold_norms=True).items if isinstance(i, NormFold) and i.targets)
    name = fold.name if what == "norm" else fold.targets[0].name
    parent, _, child = name.rpartition(".")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script is deprecated, and still used
        setattr(model.get_submodule(parent), child, torch.jit.script(model.get_submodule(name)))
    return model, name


@pytest.mark.parametrize("excluded", [False, True])
@pytest.mark.parametrize("what", ["norm", "linear"])
@pytest.mark.parametrize("family", ["llama", "bert", "timm_vit"])
@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_scripted_submodules_are_left_alone_with_the_reason(family, what, excluded):
    """Once a raw RuntimeError from the tracer ("register_forward_pre_hook is not supported on ScriptModules"),
    excluded or not. Now the scripted module is one opaque call in the trace, kept as it is and listed with the
    reason (unless excluded); everything else converts and verifies, and the outputs are the original's."""
    from lmbp_convert.match.roles import SCRIPTED_WHY

    model, name = _scripted_case(family, what)
    scripted = model.get_submodule(name)
    probe = make_probe(model)[0]
    with torch.no_grad():
        ref = model(**probe) if isinstance(probe, dict) else model(probe)
    convert(model, exclude=[name] if excluded else None, fold_norms=True)
    report = model.lmbp_report
    assert model.get_submodule(name) is scripted
    assert report.verification == "passed" and report.plan.items
    skips = {s.name: s.reason for s in report.plan.skips}
    assert (skips.get(name) == SCRIPTED_WHY) is not excluded, skips
    with torch.no_grad():
        out = model(**probe) if isinstance(probe, dict) else model(probe)
    got, want = (out if isinstance(out, torch.Tensor) else out[0]), (ref if isinstance(ref, torch.Tensor) else ref[0])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_scripted_model_has_nothing_to_convert_and_says_why():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.proj = nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(self.norm(x))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = torch.jit.script(Tiny())
    with pytest.raises(NothingToConvertError, match="torch.jit.script-ed") as err:
        convert(model, probe=torch.randn(2, 8))
    assert str(err.value).count("torch.jit.script-ed") == 1  # the outermost one, not each of its children
