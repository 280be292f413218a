"""Behaviour checks beyond the probe (match/roles.py): a module that acts as a norm on the behaviour probe but runs
code the probe does not reach (a train-time noise term, a NaN guard, a clamp for large values, a branch on the batch
or sequence size, a hook that changes its gradient) is refused, naming its class, unless ``accept_norms`` names it;
the norms of the families pass them."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmbp_convert import ConvertOptions, convert, plan_conversion
from lmbp_convert.match.roles import NormRole, identify_norm
from lmbp_convert.reasons import ReasonCode

D = 16


class NoisyLN(nn.LayerNorm):
    """A train-only noise term."""

    def forward(self, x):
        y = super().forward(x)
        return y + 0.05 * torch.randn_like(y) if self.training else y


class GuardLN(nn.LayerNorm):
    """A guard that turns non-finite input into finite numbers."""

    def forward(self, x):
        return super().forward(torch.nan_to_num(x))


class ClampRMS(nn.RMSNorm):
    """A clamp for large values (an fp16 overflow guard): the probe's rows never reach it."""

    def forward(self, x):
        return super().forward(x.clamp(-1e6, 1e6))


class DropoutLN(nn.LayerNorm):
    def forward(self, x):
        return F.dropout(super().forward(x), 0.1, self.training)


class BatchLN(nn.LayerNorm):
    """Code for batches larger than the probe's (2)."""

    def forward(self, x):
        y = super().forward(x)
        return y * 0.9 if x.size(0) > 2 else y


class LongLN(nn.LayerNorm):
    """Code for sequences longer than the probe's rows: before, its refusal blamed train mode."""

    def forward(self, x):
        return super().forward(x.clamp(-0.5, 0.5) if x.size(-2) > 10 else x)


class HalvedGradLN(nn.LayerNorm):
    """Same values, another backward (a gradient hook on the output): swapped, its gradients were 3.8x off."""

    def forward(self, x):
        y = super().forward(x)
        if y.requires_grad:
            y.register_hook(lambda g: g * 0.5)
        return y


class Block(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm = norm(D)
        self.fc = nn.Linear(D, D)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            if getattr(self.norm, "bias", None) is not None:
                self.norm.bias.normal_()

    def forward(self, x):
        return self.fc(self.norm(x))


X = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(0))
REFUSED = {NoisyLN: "in train mode", GuardLN: "on non-finite input", ClampRMS: "on extreme input",
           DropoutLN: "in train mode", BatchLN: "at input shape (12, 1)", LongLN: "at input shape (1, 12)",
           HalvedGradLN: "input gradient"}


@pytest.mark.parametrize("cls", list(REFUSED), ids=lambda c: c.__name__)
def test_norm_with_code_beyond_the_probe_is_refused_naming_its_class(cls):
    found = identify_norm(cls(D), None, None)
    assert found.code is ReasonCode.BEYOND_PROBE and REFUSED[cls] in found.text, found
    assert isinstance(identify_norm(cls(D), None, None, beyond=False), NormRole)  # the probe alone takes it
    plan = plan_conversion(Block(cls), probe=X, activations=False, gated_mlp=False)
    (skip,) = [s for s in plan.skips if s.name == "norm"]
    key = f"{cls.__module__}:{cls.__qualname__}"
    assert key in skip.reason and REFUSED[cls] in skip.reason and "accept_norms" in skip.reason, skip.reason
    assert not plan.items


def test_refusal_keeps_train_mode_and_nan_behaviour():
    """What the refusal protects: converted, the noise would vanish in training and NaN would pass the guard."""
    for cls in (NoisyLN, GuardLN):
        model = Block(cls)
        with pytest.raises(Exception, match=cls.__name__):  # nothing else to convert: NothingToConvertError
            convert(model, probe=X, activations=False, gated_mlp=False)
        assert type(model.norm) is cls


@pytest.mark.parametrize("accept", ["NoisyLN", f"{__name__}:NoisyLN"])
@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_accept_norms_swaps_it_anyway(accept):
    model = Block(NoisyLN)
    ref = copy.deepcopy(model).eval()
    rep = convert(model, probe=X, activations=False, gated_mlp=False, accept_norms=[accept], fold_norms=True).lmbp_report
    assert [f.name for f in rep.plan.norm_folds] == ["norm"] and rep.verified
    # its training forward differs by design (the noise): verification runs in eval mode only, and says so
    assert rep.train_draws == 0 and any("accept_norms accepts norm" in n for n in rep.notes), rep.notes
    with torch.no_grad():
        assert torch.allclose(model.eval()(X), ref(X), atol=1e-5)  # eval: the same function


def test_accept_norms_is_checked():
    assert ConvertOptions(accept_norms="GuardLN").accept_norms == ["GuardLN"]
    with pytest.raises(ValueError, match="accept_norms"):
        ConvertOptions(accept_norms=[3])


def test_the_check_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    identify_norm(NoisyLN(D), None, None)
    assert torch.equal(torch.random.get_rng_state(), state)


def _family_norms():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    return {"LayerNorm": lambda: nn.LayerNorm(D), "RMSNorm": lambda: nn.RMSNorm(D, eps=1e-6),
            "LlamaRMSNorm": lambda: LlamaRMSNorm(D), "GemmaRMSNorm": lambda: GemmaRMSNorm(D),
            "T5LayerNorm": lambda: T5LayerNorm(D), "LayerNorm_no_bias": lambda: nn.LayerNorm(D, bias=False)}


@pytest.mark.parametrize("name", sorted(_family_norms()))
def test_plain_norms_pass_beyond_the_probe(name):
    """NaN / inf rows give NaN (or 0 beside an inf, for RMSNorm) as the memory-sharing norm does; 1e15, 1e-15 and
    an outlier row are normalised; train mode is eval mode."""
    assert isinstance(identify_norm(_family_norms()[name](), None, None), NormRole)


def _all_families():
    from testsupport.families import FAMILIES, MORE_FAMILIES, PROBE_FAMILIES

    return {**FAMILIES, **PROBE_FAMILIES, **MORE_FAMILIES}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(_all_families()))
def test_no_family_norm_fails_the_checks_beyond_the_probe(family):
    """Every norm of the conversion families acts as its norm in train mode and on non-finite and extreme input:
    the checks cost no family a norm (their plans are the same with and without them)."""
    from lmbp_convert.catalogue import load_catalogue
    from lmbp_convert.match.roles import assign_roles

    roles = assign_roles(_all_families()[family](), load_catalogue())
    beyond = {n: r.why for n, r in roles.items() if r.probe_norm}
    assert not beyond, beyond
    assert any(r.plays.value == "norm" for r in roles.values())
