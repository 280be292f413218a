"""Consumers only other data reaches: MoE experts the probe routed no token to, branches the probe did not take.

The trace sees one input's branches. An expert in a ModuleList that the probe's router never picked is folded
like its siblings (structural rule, `lmbp_convert.match.siblings`) or the norm is refused naming it; any other
consumer the trace missed shows up on the second verification input, and its rewrite is rolled back.
"""
import copy
import warnings

import pytest
import torch
from torch import nn

from lmbp_convert import Probes, SavedTensorLedger, convert
from lmbp_convert.match.norm_exact import NormExact
from lmbp_convert.trace.tracer import call_model
from moe_models import Expert, RMSNorm, TinyMoE, routing, silent_probe

D = 16


def _fresh(seed=5, shape=(2, 6, D)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _saved_bytes(model, x):
    model.train()
    with SavedTensorLedger(model) as ledger:
        out = call_model(model, x)
        (out if isinstance(out, torch.Tensor) else out.logits).float().pow(2).sum().backward()
    model.zero_grad(set_to_none=True)
    return ledger.bytes


@pytest.mark.parametrize("fold", [True, False], ids=["fold", "exact"])
@pytest.mark.parametrize("linear", [False, True], ids=["mlp-experts", "linear-experts"])
@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_expert_the_probe_never_routed_to_is_folded_too(linear, fold):
    torch.manual_seed(0)
    model = TinyMoE(D, linear=linear).eval()
    original = copy.deepcopy(model)
    probe, fresh = silent_probe(D), _fresh()
    unrouted = sorted(set(range(4)) - set(routing(model, probe).flatten().tolist()))
    assert 3 in unrouted and 3 in routing(model, fresh).flatten().tolist()  # the setup does what it says
    before = _saved_bytes(copy.deepcopy(original), probe)

    # activations stay exact here (approx-BP activations change gradients by design), so gradients can be compared
    report = convert(model, probe=probe, activations=False, fold_norms=fold).lmbp_report
    rel = [""] if linear else ["gate_proj", "up_proj"]
    names = [f"moe.experts.{e}" + (f".{r}" if r else "") for e in range(4) for r in rel]
    if fold:
        item = next(f for f in report.plan.norm_folds if f.name == "norm")
        targets = {t.name: t.unseen for t in item.targets}
        for name in names:
            assert targets[name] is (int(name.split(".")[2]) in unrouted), name
        assert "not run by the probe" in str(report)
    else:  # the exact norm shares its output with every expert, the unrouted one too
        item = next(f for f in report.plan.of(NormExact) if f.name == "norm")
        assert set(names) <= set(item.readers), item.readers
    assert len(report.verified_on) == 2

    model.eval()
    with torch.no_grad():
        assert _rel(model(fresh), original(fresh)) <= 1e-5  # an input that routes tokens to expert 3
        assert torch.equal(routing(model, probe), routing(original, probe))  # routing unchanged
        assert torch.equal(routing(model, fresh), routing(original, fresh))
    after = _saved_bytes(model, probe)
    print(f"saved bytes before {before} after {after}")
    assert after < before

    # fp32 gradients: the input's gradient on a fresh input, original vs converted
    xs = [fresh.clone().requires_grad_(True) for _ in range(2)]
    for m, x in zip((original.eval(), model.eval()), xs):
        m(x).pow(2).sum().backward()
    assert torch.allclose(xs[0].grad, xs[1].grad, rtol=1e-5, atol=1e-6)


def test_unseen_expert_of_another_shape_refuses_the_fold_naming_it():
    torch.manual_seed(0)
    model = TinyMoE(D).eval()
    model.moe.experts[3] = Expert(D, 8)  # not shaped like its siblings: its consumers are unknown
    original = copy.deepcopy(model)
    report = convert(model, probe=silent_probe(D)).lmbp_report
    skip = next(s for s in report.plan.skips if s.name == "norm")
    assert "moe.experts.3" in skip.reason and "not all known" in skip.reason
    with torch.no_grad():
        assert _rel(model.eval()(_fresh()), original(_fresh())) <= 1e-5


class Branchy(nn.Module):
    """A consumer reached only when the data says so (not in any container the structural rule could see)."""

    def __init__(self):
        super().__init__()
        self.norm, self.a, self.b = RMSNorm(D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.norm(x)
        y = self.a(h)
        if bool((x[..., 0] > 0).any()):  # never true on the traced probe
            y = y + self.b(h)
        return y


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_second_input_catches_a_consumer_the_trace_missed_and_rolls_the_fold_back():
    torch.manual_seed(0)
    model = Branchy().eval()
    original = copy.deepcopy(model)
    probe = silent_probe(D)
    report = convert(model, probe=probe, norms=True, fold_norms=True).lmbp_report
    assert report.verified and len(report.verified_on) == 2, report
    assert [label for label, _ in report.rolled_back] == ["norm norm"]
    assert any(s.name == "norm" and "rolled back" in s.reason for s in report.plan.skips)
    with torch.no_grad():
        assert _rel(model(_fresh()), original(_fresh())) <= 1e-5
    # the exact norm is right whatever the consumers are: nothing to roll back
    exact = copy.deepcopy(original)
    report = convert(exact, probe=probe).lmbp_report
    assert report.verified and len(report.verified_on) == 2 and not report.rolled_back, report
    assert [it.name for it in report.plan.of(NormExact)] == ["norm"]
    with torch.no_grad():
        assert _rel(exact(_fresh()), original(_fresh())) <= 1e-5


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_user_given_probes_are_all_verified():
    torch.manual_seed(0)
    model = Branchy().eval()
    probe = silent_probe(D)
    report = convert(model, probe=Probes(probe, _fresh()), fold_norms=True).lmbp_report  # a fold to roll back
    assert report.verified_on == ["the traced probe", "probe 2 of 2"] and report.rolled_back
    assert "verification: passed on 2 inputs" in str(report)


def test_probe_without_data_to_vary_says_it_verified_on_one_input():
    model = nn.Sequential(nn.Embedding(10, D), RMSNorm(D), nn.Linear(D, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = convert(model, probe=torch.zeros(2, 5, dtype=torch.long)).lmbp_report
    assert report.verified_on == ["the traced probe"] and "on the traced probe only" in str(report)
    assert any("Probes(" in str(w.message) for w in caught)


# -- transformers 5.x MoE families: experts are 3-D parameters ------------------------------------------------------
MOE = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
       "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                         shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[]),
       "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
                         mlp_only_layers=[])}


def _routes(model, probe):
    """The top-k expert indices every router picks on ``probe`` (its last integer output)."""
    picked, handles = [], []
    for name, mod in model.named_modules():
        if name.endswith("mlp.gate"):
            handles.append(mod.register_forward_hook(
                lambda m, a, out: picked.append([o for o in out if not o.is_floating_point()][-1].clone())))
    with torch.no_grad():
        model.eval()(**probe)
    for h in handles:
        h.remove()
    return picked


@pytest.mark.parametrize("arch", list(MOE))
def test_moe_families_verify_on_a_second_probe_keep_routing_and_fold_into_the_parameter_experts(arch):
    from lmbp_convert.trace.probe import make_probe
    from testsupport.families import hf

    model = hf(arch, num_key_value_heads=2, **MOE[arch]).eval()
    original = copy.deepcopy(model)
    probe, fresh = make_probe(model)[0], make_probe(model, seed=2)[0]
    routes = _routes(model, probe)
    before = _saved_bytes(copy.deepcopy(original), probe)
    report = convert(model, fold_norms=True).lmbp_report
    assert report.verified and report.verified_on == ["the traced probe", "a second automatic probe (seed 1)"]
    assert "verification: passed on 2 inputs" in str(report)
    # the norm before the experts folds into the router's weight and the 3-D expert parameter (issue 11.1; before,
    # it was skipped: "holds its experts as 3-D parameters ... not supported")
    folds = {f.name: {t.weight_key for t in f.targets} for f in report.plan.norm_folds}
    into = folds["model.layers.0.post_attention_layernorm"]
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.gate.weight"} <= into, into
    assert all(torch.equal(a, b) for a, b in zip(_routes(model, probe), routes))
    with torch.no_grad():
        assert _rel(model.eval()(**fresh).logits, original(**fresh).logits) <= 1e-5  # approx-BP forwards are exact
    after = _saved_bytes(model, probe)
    print(f"{arch}: saved bytes before {before} after {after}")
    assert after < before


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_unseen_targets_serialise_and_the_layer_stack_a_norm_lives_in_is_not_mirrored():
    from lmbp_convert import plan_conversion
    from lmbp_convert.match.plan import Plan
    from testsupport.families import hf

    torch.manual_seed(0)
    plan = plan_conversion(TinyMoE(D).eval(), probe=silent_probe(D), fold_norms=True)
    again = Plan.from_dict(plan.to_dict())
    assert again == plan and any(t.unseen for f in again.norm_folds for t in f.targets)
    # decoder layers are a ModuleList too, but each layer's norms live inside it: no sibling layer is a consumer
    llama = plan_conversion(hf("llama", num_hidden_layers=3), fold_norms=True)
    assert llama.norm_folds and not any(t.unseen for f in llama.norm_folds for t in f.targets)
