"""What the planner folds, blocks and re-applies, on small hand-made modules (one pattern each): the fold's
analysis (``fold_norms=True``, `FOLD`); the exact default turns the norms it plans into exact norms."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmbp_convert import convert, plan_conversion
from lmbp_convert.match.norm_exact import NormExact

FOLD = dict(fold_norms=True)


class NormThen(nn.Module):
    """x → LayerNorm → f(·) → Linear; f is the pattern under test."""

    def __init__(self, f, d=8, extra=None):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 5)
        self.f = f
        self.extra = extra
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.normal_()

    def forward(self, x):
        h = self.norm(x)
        return self.fc(self.f(h, self))


def _plan(f, x=None, **kw):
    m = NormThen(f, **kw)
    x = torch.randn(2, 6, 8) if x is None else x
    plan = plan_conversion(m, probe=x, activations=False, gated_mlp=False, **FOLD)
    return m, plan, x


COMMUTING = {
    "reshape": lambda h, m: h.reshape(-1, 8),
    "permute_and_back": lambda h, m: h.permute(2, 0, 1).permute(1, 2, 0),
    "transpose_tokens": lambda h, m: h.transpose(0, 1),
    "roll_tokens": lambda h, m: torch.roll(h, 1, dims=1),
    "token_slice": lambda h, m: h[:, 1:],
    "cls_token": lambda h, m: h[:, 0],
    "mean_tokens": lambda h, m: h.mean(dim=1),
    "dropout_p0": lambda h, m: F.dropout(h, p=0.0, training=True),
    "cast": lambda h, m: h.to(torch.float64).to(torch.float32),
    "replicate_pad_tokens": lambda h, m: F.pad(h.unsqueeze(0), (0, 0, 1, 0), mode="replicate"),
}


@pytest.mark.parametrize("name", sorted(COMMUTING))
@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_affine_commuting_paths_fold_exactly(name):
    m, plan, x = _plan(COMMUTING[name])
    assert [f.name for f in plan.norm_folds] == ["norm"], plan.skips
    ref = m(x)
    rep = convert(m, probe=x, activations=False, gated_mlp=False, **FOLD).lmbp_report
    assert rep.verified
    assert torch.allclose(m(x), ref, atol=1e-5)


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_zero_pad_folds_a_norm_without_beta():
    """γ·0 = 0: a zero pad commutes with a norm that has no β, at every shape."""
    f = lambda h, m: F.pad(h, (0, 0, 0, 2 - h.shape[1] % 2))  # noqa: E731 - pads odd token counts
    m, _, x = _plan(f)
    m.norm = nn.LayerNorm(8, bias=False)
    with torch.no_grad():
        m.norm.weight.uniform_(0.5, 1.5)
    plan = plan_conversion(m, probe=x, activations=False, gated_mlp=False, **FOLD)
    assert [f.name for f in plan.norm_folds] == ["norm"] and not plan.norm_folds[0].caveats, plan.skips
    other = torch.randn(2, 5, 8)
    ref = m(other)
    convert(m, probe=x, activations=False, gated_mlp=False, **FOLD)
    assert torch.allclose(m(other), ref, atol=1e-5)


def _bytes_and_grads(m, x):
    from lmbp_convert import SavedTensorLedger

    m.train()
    m.zero_grad(set_to_none=True)
    with SavedTensorLedger(m) as led:
        out = m(x)
    out.pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    if x.requires_grad:
        grads["<input>"], x.grad = x.grad.clone(), None
    return led.bytes, grads


@pytest.mark.parametrize("name", sorted(COMMUTING))
def test_affine_commuting_paths_are_exact_norms_by_default_with_the_folds_bytes(name):
    """The exact default on the same paths: an exact norm, the original's gradients for every parameter (γ, β
    included) and for the input, at most the saved bytes of the fold."""
    import copy

    torch.manual_seed(0)
    ref = NormThen(COMMUTING[name])
    x = torch.randn(2, 6, 8, requires_grad=True)  # as in a model: the norm's input needs its gradient
    exact, folded = copy.deepcopy(ref), copy.deepcopy(ref)
    rep = convert(exact, probe=x, activations=False, gated_mlp=False).lmbp_report
    assert [f.name for f in rep.plan.of(NormExact)] == ["norm"] and rep.verified, str(rep)
    convert(folded, probe=x, activations=False, gated_mlp=False, **FOLD)
    (b_ref, g_ref), (b_exact, g_exact) = _bytes_and_grads(ref, x), _bytes_and_grads(exact, x)
    assert g_exact.keys() == g_ref.keys()
    for n in g_ref:
        torch.testing.assert_close(g_exact[n], g_ref[n], rtol=1e-5, atol=1e-6, msg=n)
    b_fold = _bytes_and_grads(folded, x)[0]
    assert b_exact <= b_fold < b_ref, (b_exact, b_fold, b_ref)  # equal but for the fp64 round trip: exact keeps less


BLOCKED = {
    "dropout": (lambda h, m: F.dropout(h, p=0.1, training=m.training), "dropout"),
    "zero_pad_tokens": (lambda h, m: F.pad(h, (0, 0, 0, 2))[:, :6], "padding"),
    # a no-op at the probe's shape, not at others (Swin's window padding): judged at every shape
    "zero_pad_noop": (lambda h, m: F.pad(h, (0, 0, 0, 0)), "no-op at the probe's shape"),
    "channel_slice": (lambda h, m: F.pad(h[..., :4], (0, 4)), "channel"),
    "sum_tokens": (lambda h, m: h.sum(dim=1), "no Linear consumer"),
    "channel_mix": (lambda h, m: h @ torch.ones(8, 8), "no Linear consumer"),
    "residual_in_same_forward": (lambda h, m: h + m.fc.weight.new_ones(8) * 0 + h, "no Linear consumer"),
}


@pytest.mark.parametrize("name", sorted(BLOCKED))
def test_inexact_paths_are_skipped_with_reason(name):
    f, why = BLOCKED[name]
    _, plan, _ = _plan(f)
    assert not plan.norm_folds
    (skip,) = [s for s in plan.skips if s.name == "norm"]
    assert why in skip.reason, skip.reason


class SameScopeResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.norm(x)
        return self.fc(h) + h  # no module boundary between the norm and the add


def test_other_consumer_without_module_boundary_blocks_the_fold():
    plan = plan_conversion(SameScopeResidual(), probe=torch.randn(2, 8), activations=False, gated_mlp=False,
                           keep_affine=False, **FOLD)
    (skip,) = plan.skips
    assert "no module boundary" in skip.reason
    # by default the norm keeps its affine instead (fc keeps its output anyway), with the fold's refusal as reason
    plan = plan_conversion(SameScopeResidual(), probe=torch.randn(2, 8), activations=False, gated_mlp=False, **FOLD)
    (keep,) = plan.items
    assert not plan.skips and not plan.norm_folds and keep.tag == "norm_keeps"
    assert "no module boundary" in keep.fold_refused and keep.keepers == ["fc"]


class Residual(nn.Module):
    def forward(self, a, b):
        return a + b


class PostLN(nn.Module):
    """BERT-style: the norm output goes to a Linear and, as an argument, to another module's residual."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.res = Residual()
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.normal_()

    def forward(self, x):
        h = self.norm(x)
        return self.res(self.fc(h), h)


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_other_branch_at_module_boundary_gets_affine_reapplied():
    m, x = PostLN(), torch.randn(3, 8)
    ref = m(x)
    rep = convert(m, probe=x, activations=False, gated_mlp=False, **FOLD).lmbp_report
    (fold,) = rep.plan.norm_folds
    assert [r.describe() for r in fold.reapply] == ["input arg 1 of res"]
    assert torch.allclose(m(x), ref, atol=1e-6)
    # training the norm's γ still reaches the re-applied branch
    m(x).sum().backward()
    assert m.norm.weight.grad is not None and m.norm.weight.grad.abs().sum() > 0


class QKNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.q_norm = nn.LayerNorm(8)

    def forward(self, x):
        q = self.q_norm(self.q(x))
        return q @ q.transpose(-1, -2)


def test_norm_without_linear_consumer_is_left_with_reason():
    plan = plan_conversion(QKNorm(), probe=torch.randn(2, 4, 8), activations=False, gated_mlp=False, **FOLD)
    assert plan.skips and "no Linear consumer" in plan.skips[0].reason


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(self.norm(self.fc(self.norm(x))))


def test_shared_modules_are_not_folded():
    plan = plan_conversion(Shared(), probe=torch.randn(2, 8), activations=False, gated_mlp=False, **FOLD)
    assert "called 2 times" in plan.skips[0].reason


class Gemmaish(nn.Module):
    """A norm class the catalogue does not list, scaling by (1 + w): identified by behaviour."""

    class MyRMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(d) * 0.3)
            self.eps = 1e-6

        def forward(self, x):
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return y * (1 + self.weight)

    def __init__(self):
        super().__init__()
        self.norm = self.MyRMSNorm(8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.norm(x))


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_unlisted_norm_class_is_identified_by_behaviour():
    m, x = Gemmaish(), torch.randn(4, 8)
    ref = m(x)
    rep = convert(m, probe=x, **FOLD).lmbp_report
    (fold,) = rep.plan.norm_folds
    assert (fold.norm_type, fold.param) == ("rms", "1+w")
    assert torch.allclose(m(x), ref, atol=1e-5)
    assert torch.all(m.norm.weight == 0)  # identity of the (1 + w) parameterisation
