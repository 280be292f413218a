"""MoE decoders convert in either layout of their experts: a ModuleList of per-expert MLPs of Linear layers
(transformers 4.x, much other code) or 3-D expert parameters used through grouped matmuls (transformers 5).
Routing depends on the data, so each converted model is checked on an input other than the traced probe."""
import copy

import pytest
import torch
from torch import nn

from lmbp_convert import convert
from lmbp_convert.match.norm_exact import NormExact
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.trace.tracer import call_model
from testsupport.families import hf

MOE = dict(num_key_value_heads=2, num_experts_per_tok=2)
CASES = {
    "mixtral": dict(MOE, num_local_experts=4),
    "qwen2_moe": dict(MOE, num_experts=4, moe_intermediate_size=64, shared_expert_intermediate_size=128),
}


def _expert_lists(model: nn.Module) -> list[nn.ModuleList]:
    return [m for n, m in model.named_modules() if n.endswith(".experts") and isinstance(m, nn.ModuleList)]


@pytest.mark.compat
@pytest.mark.parametrize("arch", sorted(CASES))
def test_moe_family_converts_and_matches_on_another_input(arch):
    model = hf(arch, **CASES[arch]).eval()
    ref = copy.deepcopy(model)
    rep = convert(model).lmbp_report
    assert rep.verified, str(rep)
    pre_moe = {n for n, _ in model.named_modules() if n.endswith("post_attention_layernorm")}
    folded = {f.name for f in rep.plan.of(NormExact)}  # the exact default: no fold, the norms are exact
    assert not rep.plan.norm_folds, str(rep)
    if _expert_lists(ref):  # per-expert Linear layers: the norm before the MoE shares with router and experts
        assert pre_moe <= folded, str(rep)
        n_experts = sum(len(e) for e in _expert_lists(ref))
        assert len(rep.plan.gated_mlps) >= n_experts, str(rep)
    else:  # nothing is left out: the norm is exact or the report says why not
        skipped = {s.name for s in rep.plan.skips}
        assert pre_moe <= folded | skipped, str(rep)
    probe = make_probe(model, batch=2, seq=11)[0]  # other tokens than the traced probe: other routes
    with torch.no_grad():
        a, b = call_model(model, probe).logits, call_model(ref, probe).logits
    assert float((a - b).norm() / b.norm()) <= 1e-5
