import pytest
import torch
from torch import nn

from lmbp_convert.catalogue import load_catalogue
from lmbp_convert.match.roles import assign_roles, is_leaf_factory
from lmbp_convert.trace import TraceError, trace
from lmbp_convert.trace.probe import ProbeError, make_probe
from tiny_models import hf


def _trace(model, probe=None):
    roles = assign_roles(model, load_catalogue())
    probe = probe if probe is not None else make_probe(model)[0]
    return trace(model, probe, is_leaf_factory(model, roles))[0]


def test_records_leaf_modules_ops_and_scopes():
    g = _trace(hf("llama"))
    (norm,) = g.module_nodes("model.layers.0.input_layernorm")
    users = {n.target for n in g.consumers(norm.outputs[0]) if n.kind == "module"}
    assert {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
            "model.layers.0.self_attn.v_proj"} <= users
    assert not [n for n in g.nodes if n.kind == "op" and n.target.endswith("functional.linear")]  # inside leaves
    assert g.module_calls["model.layers.0.self_attn.q_proj"] == 1
    assert any(sc.module == "model.layers.0.mlp" for sc in g.scopes)
    assert g.root_outputs  # the logits


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_traces_on_meta_device(arch):
    with torch.device("meta"):
        model = hf(arch, head="base" if arch == "bert" else "causal")
    g = _trace(model)
    assert sum(n.kind == "module" for n in g.nodes) > 5
    assert all(t.shape is not None for t in g.tensors.values())


def test_probe_errors_are_actionable():
    with pytest.raises(ProbeError, match="probe="):
        make_probe(nn.Linear(3, 3))
    model = hf("llama")
    with pytest.raises(TraceError, match="probe="):
        _trace(model, {"input_ids": torch.zeros(2, 3)})  # float ids: the embedding refuses them


def test_hooks_are_removed_after_tracing():
    model = hf("gpt2")
    _trace(model)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
