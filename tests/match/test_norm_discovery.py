"""Norms are found by behaviour, not by class name: renamed and 1 + w subclasses, hand-written affine-free and RMS
norms with eps under any attribute name convert; containers and decoys named like norms do not."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmbp_convert import SavedTensorLedger, convert
from lmbp_convert.catalogue import load_catalogue
from lmbp_convert.enums import NormType, WeightParam
from lmbp_convert.match.norm_exact import NormExact
from lmbp_convert.match.plan import NormSwap
from lmbp_convert.match.roles import NormRole, ModuleRole, assign_roles, identify_norm
from lmbp_convert.reasons import ReasonCode

D = 16


class Renamed(nn.LayerNorm):
    """A LayerNorm subclass whose name says nothing."""


class Shifted1P(nn.LayerNorm):
    """Weight stored as w, applied as 1 + w (Nemotron's LayerNorm1P)."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight + 1.0, self.bias, self.eps)


class BareLN(nn.Module):
    """No parameters at all, eps only in the code (OLMo v1)."""

    def __init__(self, d):
        super().__init__()
        self.normalized_shape = (d,)

    def forward(self, x):
        return F.layer_norm(x.float(), self.normalized_shape, None, None, 1e-5).to(x.dtype)


class Scaler(nn.Module):
    """An RMSNorm written by hand; eps under a name no catalogue lists."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.jitter = 1e-6

    def forward(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(v + self.jitter)).to(x.dtype)


class FooLayerNorm(nn.Module):
    """A container named like a norm: never a norm candidate."""

    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(self.proj(x))


class DecoyLayerNorm(nn.Module):
    """Named like a norm, has a per-channel weight, but does not normalise."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = 1e-5

    def forward(self, x):
        return x * self.weight


class Net(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.norms = nn.ModuleList([Renamed(d), Shifted1P(d), BareLN(d), Scaler(d)])
        self.lins = nn.ModuleList([nn.Linear(d, d) for _ in self.norms])
        self.box = FooLayerNorm(d)
        self.decoy = DecoyLayerNorm(d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        h = self.inp(x)
        for norm, lin in zip(self.norms, self.lins):
            h = h + lin(norm(h))
        return self.out(self.decoy(self.box(h)))


def _net():
    torch.manual_seed(0)
    net = Net()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in net.modules():
            for name in ("weight", "bias"):
                t = mod._parameters.get(name)
                if t is not None and t.dim() == 1:
                    t.copy_(torch.rand(t.shape, generator=gen) + 0.5 if name == "weight" else torch.randn(t.shape))
    return net


@pytest.mark.parametrize("module,kind,param,eps,affine", [
    (Renamed(D, eps=1e-5), NormType.LAYER, WeightParam.W, 1e-5, True),
    (Shifted1P(D, eps=1e-6), NormType.LAYER, WeightParam.ONE_PLUS_W, 1e-6, True),
    (BareLN(D), NormType.LAYER, WeightParam.W, 1e-5, False),  # eps fitted: no attribute holds it
    (Scaler(D), NormType.RMS, WeightParam.W, 1e-6, True),  # eps fitted: "jitter" is no known attribute
    (nn.RMSNorm(D, eps=1e-12, elementwise_affine=False), NormType.RMS, WeightParam.W, 1e-12, False),
    (nn.LayerNorm(D, eps=0.1), NormType.LAYER, WeightParam.W, 0.1, True),
])
def test_behaviour_identifies_kind_parameterisation_and_eps(module, kind, param, eps, affine):
    role = identify_norm(module, None, None)
    assert isinstance(role, NormRole), role
    assert (role.norm_type, role.param, role.affine) == (kind, param, affine)
    assert role.eps == pytest.approx(eps, rel=1e-3)


@pytest.mark.parametrize("module,why", [
    (DecoyLayerNorm(D), "behaviour does not match"),
    (nn.GroupNorm(1, D), "behaviour check failed to run"),  # normalises dim 1 of a (N, C, L) input, not the last
    (nn.BatchNorm1d(D), "buffer"),
])
def test_modules_that_do_not_act_as_last_dim_norms_are_not_norms(module, why):
    found = identify_norm(module, None, None)
    assert found.code is ReasonCode.BEHAVIOUR and why in found.text


def test_a_norm_that_returns_another_dtype_is_refused():
    class Upcasting(nn.LayerNorm):
        def forward(self, x):
            return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps)

    found = identify_norm(Upcasting(D), None, None)
    assert found.code is ReasonCode.BEHAVIOUR and "returns torch.float32 for bfloat16 input" in found.text


def test_roles_find_norms_by_behaviour_and_never_containers():
    roles = assign_roles(_net(), load_catalogue())
    assert [roles[f"norms.{i}"].plays for i in range(4)] == [ModuleRole.NORM] * 4
    assert roles["box"].plays is ModuleRole.OTHER and roles["box"].why is None  # container: not a candidate
    assert roles["box.norm"].plays is ModuleRole.NORM
    assert roles["decoy"].plays is ModuleRole.OTHER and "behaviour does not match" in roles["decoy"].why.text
    assert roles["inp"].plays is ModuleRole.LINEAR


def _saved(model, x):
    model.train()
    with SavedTensorLedger(model) as led:
        model(x).pow(2).mean().backward()
    return led.bytes


def test_convert_by_behaviour_verifies_and_saves_exact_bytes():
    net = _net()
    ref = copy.deepcopy(net)
    x = torch.randn(2, 8, D)
    rep = convert(net, probe=x).lmbp_report
    assert rep.verification == "passed", str(rep)
    folded = {f.name: f for f in rep.plan.of(NormExact)}  # the exact default: the norms a fold would rewrite
    assert set(folded) == {"norms.0", "norms.1", "norms.3"} and not rep.plan.norm_folds, str(rep)
    assert folded["norms.1"].param is WeightParam.ONE_PLUS_W and folded["norms.3"].norm_type is NormType.RMS
    (bare,) = rep.plan.of(NormSwap)
    assert bare.name == "norms.2" and bare.readers == ["lins.2"] and bare.eps == pytest.approx(1e-5)
    skipped = {s.name: s.reason for s in rep.plan.skips}
    assert set(skipped) == {"decoy", "box.norm"} and "behaviour does not match" in skipped["decoy"]
    assert "reaches out only through mul in decoy" in skipped["box.norm"]  # the decoy's x·w, truthfully
    assert "box" not in skipped and isinstance(net.decoy, DecoyLayerNorm)
    with torch.no_grad():
        torch.testing.assert_close(net(x), ref(x), rtol=1e-5, atol=1e-5)
    before, after = _saved(ref, x), _saved(net, x)
    rows = 2 * 8
    assert before - after == _expected_saving(rows) == 5632, (before, after)


def _expected_saving(rows):
    """What the ledger must see: each memory-sharing norm keeps its output (which the Linear keeps anyway) and a
    per-row rstd, nothing else; an exact norm that replays the original in fp32 keeps its input instead, no rstd."""
    x, per_row = rows * D * 4, rows * 4
    layer = x + per_row  # F.layer_norm kept x, mean and rstd: x and the mean go
    replayed = per_row  # ... and rstd, where an fp32 exact norm replays the original (ops/replay_norm.py)
    one_plus_w = D * 4  # ... and the 1P subclass's (1 + w) tensor
    rms = 2 * x + per_row  # the hand-written RMSNorm kept x (pow, mul), rsqrt and x·rsqrt (the weight's mul)
    return 3 * layer + 3 * replayed + one_plus_w + rms  # Renamed, Shifted1P, BareLN (replayed); Scaler


def test_an_eps_that_is_not_a_round_number_is_fitted_as_it_is():
    role = identify_norm(BareLNWithEps(D, 1.2345678e-5), None, None)
    assert isinstance(role, NormRole) and role.eps == pytest.approx(1.2345678e-5, rel=1e-3)


class BareLNWithEps(BareLN):
    def __init__(self, d, hidden):
        super().__init__(d)
        self._hidden = hidden

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, None, None, self._hidden)


def test_affine_free_swap_round_trips_through_a_plan_file():
    import json

    from lmbp_convert.match.plan import Plan

    plan = Plan(items=[NormSwap("n", "x:BareLN", "layer", 1e-5, [16], ["lin"], 64)])
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and again.items[0].norm_type is NormType.LAYER


def test_norms_of_one_kind_are_checked_once(monkeypatch):
    """The behaviour check depends on the class, plain attributes and tensor shapes (it draws its own γ, β): a deep
    model's identical norms share one check; a norm that differs in any of those gets its own."""
    from lmbp_convert.catalogue import load_catalogue
    from lmbp_convert.match import roles as R

    calls = []
    real = R.identify_norm
    monkeypatch.setattr(R, "identify_norm", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    model = nn.Sequential(*[nn.LayerNorm(16) for _ in range(6)], nn.LayerNorm(16, eps=1e-3), nn.LayerNorm(8),
                          nn.RMSNorm(16))
    model[0].register_forward_hook(lambda m, a, y: y * 2)  # a hooked norm behaves otherwise: its own check
    got = R.assign_roles(model, load_catalogue())
    assert len(calls) == 5  # LayerNorm(16) once, the hooked one, eps 1e-3, width 8, RMSNorm
    assert all(got[str(i)].plays is R.ModuleRole.NORM for i in range(1, 9))
    assert got["6"].norm.eps == 1e-3 and got["1"].norm.eps == 1e-5
