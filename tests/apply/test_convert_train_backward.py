"""Train-mode verification runs a backward (issue 20, item 2): a rewrite whose backward fails — a tensor it keeps
for backward modified in place by code that runs in training only, as Switch Transformers' router multiplies its
input by jitter noise — or whose gradients differ where it claims exact training, is rolled back with a reason
that says so (by code), and training then runs; the check leaves ``.grad``, requires_grad, RNG and modes alone."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lmbp_convert import convert
from lmbp_convert.nn.exact_norms import MSExactNorm
from lmbp_convert.reasons import ReasonCode
from testsupport.families import randomize_norms


class _JitterBlock(nn.Module):
    """norm → (train mode: its output multiplied in place by noise, as a router's jitter) → Linear, inside a block
    (a fold in the model's own frame would be kept exact for the doors: match/doors.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(16)  # no β: the noise commutes with the fold's affine, so outputs stay equal
        self.proj = nn.Linear(16, 16)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.training:
            h *= torch.empty_like(h).uniform_(0.99, 1.01)
        return self.proj(h)


class JitterInTraining(nn.Module):
    """embed → block (norm, jitter, Linear) → head (the embedding makes the norm's input need a gradient, so the
    norm keeps its output for backward)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(16, 16)
        self.block = _JitterBlock()
        self.head = nn.Linear(16, 4)

    @property
    def norm(self) -> nn.Module:
        return self.block.norm

    @property
    def proj(self) -> nn.Module:
        return self.block.proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)))


PROBE = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))


def _rolled_back(report, code: ReasonCode) -> list[str]:
    return [s.name for s in report.plan.skips
            if s.why.code == ReasonCode.ROLLED_BACK and code in s.why.codes()]


def _train_loss(model: nn.Module, x: torch.Tensor, seed: int = 7) -> torch.Tensor:
    model.train()
    torch.manual_seed(seed)
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach()


def test_fold_whose_saved_output_is_modified_in_training_is_rolled_back():
    model = JitterInTraining()
    ref = copy.deepcopy(model)
    report = convert(model, probe=PROBE, fold_norms=True).lmbp_report
    assert _rolled_back(report, ReasonCode.BACKWARD_FAILED) == ["block.norm"], str(report)
    assert "training's backward failed" in str(report) and report.train_backward, str(report)
    assert type(model.norm) is nn.RMSNorm
    torch.testing.assert_close(_train_loss(model, PROBE), _train_loss(ref, PROBE), rtol=0, atol=0)


def test_the_check_leaves_grads_flags_rng_and_modes_alone():
    """The exact default keeps the rewrite (and the parameters): the backward it ran left a ``.grad`` set before
    as it was and set none, every requires_grad flag, the caller's RNG stream and every module's mode as before."""
    model = JitterInTraining().eval()
    model.head.weight.requires_grad_(False)
    model.proj.weight.grad = torch.full_like(model.proj.weight, 0.5)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    fired = []
    handle = model.proj.register_full_backward_hook(lambda m, gin, gout: fired.append(1))
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    report = convert(model, probe=PROBE).lmbp_report
    assert not fired  # the user's hook is held back for convert()'s backward
    assert report.train_backward and not report.rolled_back and type(model.norm) is not nn.RMSNorm, str(report)
    assert torch.equal(torch.rand(3), expected)
    assert torch.equal(model.proj.weight.grad, torch.full_like(model.proj.weight, 0.5))
    assert all(p.grad is None for n, p in model.named_parameters() if n != "block.proj.weight")
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert not any(m.training for m in model.modules())
    _train_loss(model, PROBE.clone().requires_grad_(True))
    assert fired == [1]  # back in place for training, and its handle still removes it
    handle.remove()
    assert not model.proj._backward_hooks


def test_frozen_model_is_checked_with_every_parameter_trainable_and_left_frozen():
    """No parameter requires grad: the backward differentiates the floating-point vectors (norm weights, biases)
    for the check, then they are frozen again; the failing fold is still found."""
    model = JitterInTraining().requires_grad_(False)
    report = convert(model, probe=PROBE, fold_norms=True).lmbp_report
    assert _rolled_back(report, ReasonCode.BACKWARD_FAILED) == ["block.norm"], str(report)
    assert not any(p.requires_grad for p in model.parameters())


class _RaisingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("injected backward failure")


class _ScaledBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return 1.5 * g


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(16)
        self.proj = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


@pytest.mark.parametrize("fault, code", [(_RaisingBackward, ReasonCode.BACKWARD_FAILED),
                                         (_ScaledBackward, ReasonCode.GRADIENTS_CHANGED)])
def test_exact_norm_whose_backward_fails_or_changes_gradients_is_rolled_back(monkeypatch, fault, code):
    """Fault injection: an exact norm whose forward is right but whose backward raises, or scales the gradient
    (it claims exact training, so its gradients are compared with the original's)."""
    real = MSExactNorm.forward
    monkeypatch.setattr(MSExactNorm, "forward", lambda self, x: fault.apply(real(self, x)))
    model = Plain()
    ref = copy.deepcopy(model)
    x = PROBE.clone().requires_grad_(True)
    report = convert(model, probe=PROBE).lmbp_report
    assert _rolled_back(report, code) == ["norm"], str(report)
    assert type(model.norm) is nn.LayerNorm and report.verified
    torch.testing.assert_close(_train_loss(model, x), _train_loss(ref, x), rtol=0, atol=0)


def test_exact_norm_passes_with_its_gradients_compared():
    report = convert(Plain(), probe=PROBE).lmbp_report
    assert not report.rolled_back and report.gradient_error is not None and report.gradient_error < 1e-6, str(report)


SWITCH = dict(d_model=32, d_ff=64, d_kv=16, num_layers=1, num_decoder_layers=1, num_heads=2, num_experts=4,
              vocab_size=96, encoder_sparse_step=1, decoder_sparse_step=1, router_jitter_noise=0.01,
              decoder_start_token_id=0, pad_token_id=0)


@pytest.mark.parametrize("fold", [True, False])
def test_switch_transformers_trains_after_convert(fold):
    """The router's jitter multiplies the folded norm's output in place in training: with ``fold_norms=True`` those
    norms are rolled back (their backward fails), the others fold, and a training step runs and gives the
    original's loss; the exact default converts them and trains as the original."""
    import transformers

    cfg = transformers.AutoConfig.for_model("switch_transformers", **SWITCH)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return randomize_norms(transformers.SwitchTransformersForConditionalGeneration(cfg))

    model, ref = build(), build()
    report = convert(model, fold_norms=fold).lmbp_report
    rolled = _rolled_back(report, ReasonCode.BACKWARD_FAILED)
    if fold:
        assert rolled == ["encoder.block.0.layer.1.layer_norm", "decoder.block.0.layer.2.layer_norm"], str(report)
        assert report.plan.items, str(report)
    else:
        assert not rolled and not report.rolled_back and report.gradient_error is not None, str(report)
    ids = torch.tensor([[3, 17, 42, 9, 5, 77, 1, 2]])
    labels = torch.tensor([[5, 9, 4, 2, 8, 1, 3, 2]])
    losses = []
    for m in (model, ref):
        m.train()
        torch.manual_seed(3)
        out = m(input_ids=ids, labels=labels)
        out.loss.backward()
        losses.append(out.loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)


def test_no_backward_runs_when_verification_is_off(monkeypatch):
    """verify=False: the injected raising backward is never reached, the rewrite stays."""
    real = MSExactNorm.forward
    monkeypatch.setattr(MSExactNorm, "forward", lambda self, x: _RaisingBackward.apply(real(self, x)))
    model = Plain()
    report = convert(model, probe=PROBE, verify=False).lmbp_report
    assert not report.rolled_back and not report.train_backward and isinstance(model.norm, MSExactNorm)


class _Raises(torch.autograd.Function):
    error: type[BaseException] = RuntimeError

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise _Raises.error("the model's own backward fails")


class OwnBackwardFails(Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Raises.apply(self.proj(self.norm(x)))


@pytest.mark.parametrize("error, said", [(RuntimeError, "failed"), (torch.OutOfMemoryError, "ran out of memory")])
def test_the_originals_own_backward_failing_is_noted_and_not_held_against_the_rewrite(monkeypatch, error, said):
    monkeypatch.setattr(_Raises, "error", error)
    model = OwnBackwardFails()
    report = convert(model, probe=PROBE).lmbp_report
    assert isinstance(model.norm, MSExactNorm) and report.verified and not report.train_backward, str(report)
    assert any(n.startswith("train mode verified without a backward") and said in n for n in report.notes)
