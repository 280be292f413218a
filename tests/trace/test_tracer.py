import pytest
import torch
from torch import nn

from lmbp_convert.catalogue import load_catalogue
from lmbp_convert.match.roles import assign_roles, is_leaf_factory
from lmbp_convert.trace import TraceError, trace
from lmbp_convert.trace.probe import ProbeError, make_probe
from testsupport.families import hf


def _trace(model, probe=None):
    roles = assign_roles(model, load_catalogue())
    probe = probe if probe is not None else make_probe(model)[0]
    return trace(model, probe, is_leaf_factory(model, roles))[0]


def test_records_leaf_modules_ops_and_scopes():
    g = _trace(hf("llama"))
    (norm,) = g.module_nodes("model.layers.0.input_layernorm")
    users = {n.target for n in g.consumers(norm.outputs[0]) if n.callee == "module"}
    assert {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
            "model.layers.0.self_attn.v_proj"} <= users
    assert not [n for n in g.nodes if n.callee == "op" and n.target.endswith("functional.linear")]  # inside leaves
    assert g.module_calls["model.layers.0.self_attn.q_proj"] == 1
    assert any(sc.module == "model.layers.0.mlp" for sc in g.scopes)
    assert g.root_outputs  # the logits


# Tiny configs (testsupport/families.py): probe batch 2 x 8 tokens, hidden 64, 4 heads; LLaMA has 2 KV heads
# (k/v width 32) and a 172-wide gated MLP, GPT-2 and BERT a 256-wide MLP; vocab 128.
_EXPECTED_SHAPES = {  # module -> (input shapes, output shapes) the trace must record
    "llama": {
        "model.layers.0.input_layernorm": ([(2, 8, 64)], [(2, 8, 64)]),
        "model.layers.0.self_attn.k_proj": ([(2, 8, 64)], [(2, 8, 32)]),
        "model.layers.0.mlp.gate_proj": ([(2, 8, 64)], [(2, 8, 172)]),
        "model.layers.0.mlp.act_fn": ([(2, 8, 172)], [(2, 8, 172)]),
        "model.layers.1.mlp.down_proj": ([(2, 8, 172)], [(2, 8, 64)]),
        "lm_head": ([(2, 8, 64)], [(2, 8, 128)]),
    },
    "gpt2": {
        "transformer.h.0.ln_1": ([(2, 8, 64)], [(2, 8, 64)]),
        "transformer.h.0.attn.c_attn": ([(2, 8, 64)], [(2, 8, 192)]),
        "transformer.h.0.mlp.c_fc": ([(2, 8, 64)], [(2, 8, 256)]),
        "transformer.h.1.mlp.c_proj": ([(2, 8, 256)], [(2, 8, 64)]),
        "lm_head": ([(2, 8, 64)], [(2, 8, 128)]),
    },
    "bert": {
        "embeddings.LayerNorm": ([(2, 8, 64)], [(2, 8, 64)]),
        "encoder.layer.0.intermediate.dense": ([(2, 8, 64)], [(2, 8, 256)]),
        "encoder.layer.1.output.dense": ([(2, 8, 256)], [(2, 8, 64)]),
        "pooler.dense": ([(2, 64)], [(2, 64)]),  # the first token only
    },
}
_ROOT_OUTPUT_SHAPES = {"llama": [(2, 8, 128)], "gpt2": [(2, 8, 128)], "bert": [(2, 8, 64), (2, 64)]}


def _module_shapes(g):
    def shapes(tids):
        return [g.tensors[t].shape for t in tids]

    return [(n.target, shapes(n.inputs), shapes(n.outputs)) for n in g.nodes if n.callee == "module"]


@pytest.mark.compat
@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_traces_on_meta_device(arch):
    head = "base" if arch == "bert" else "causal"
    with torch.device("meta"):
        model = hf(arch, head=head)
    g = _trace(model)
    assert sum(n.callee == "module" for n in g.nodes) > 5
    recorded = {target: (ins, outs) for target, ins, outs in _module_shapes(g)}
    for name, shapes in _EXPECTED_SHAPES[arch].items():
        assert recorded[name] == shapes, name
    # The KV cache is a Cache object in transformers 5 and a tuple of tensors in 4.x: not a model output here.
    outputs = [t for t, paths in g.root_outputs.items() if any(p[:1] != ("past_key_values",) for p in paths)]
    assert sorted(g.tensors[t].shape for t in outputs) == sorted(_ROOT_OUTPUT_SHAPES[arch])
    # Every leaf call records what a real forward on CPU records: meta shapes are the true shapes.
    assert _module_shapes(g) == _module_shapes(_trace(hf(arch, head=head)))


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


class _RealTensorCode(nn.Module):
    """Code written for real tensors, as transformers 4.x's is: a check on the input's values, a mask built "on
    the input's device" and read, an autocast region opened for the input's device."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, ids):
        if 0 in ids[:, [-1, 0]]:
            ids = ids.clamp(min=1)
        x = self.emb(ids)
        mask = torch.ones(ids.shape, device=x.device)
        scale = 1.0 if torch.all(mask == 1) else 0.5
        with torch.autocast(device_type=x.device.type, enabled=False):
            pos = torch.arange(ids.shape[1], device=x.device).float()
        h = self.norm(x * scale + pos[:, None])
        return self.q(h) + self.k(h)


def test_meta_trace_of_code_written_for_real_tensors():
    """On the meta device such code fails as it is (autocast has no meta device, a meta tensor has no values to
    test); the trace shows it the meta device as the CPU and records what a CPU trace records."""
    torch.manual_seed(0)
    cpu = _RealTensorCode()
    with torch.device("meta"):
        meta = _RealTensorCode()
    g_meta = _trace(meta, torch.zeros((2, 5), dtype=torch.long, device="meta"))
    g_cpu = _trace(cpu, torch.ones((2, 5), dtype=torch.long))
    assert _module_shapes(g_meta) == _module_shapes(g_cpu)
    (norm,) = g_meta.module_nodes("norm")
    assert {n.target for n in g_meta.consumers(norm.outputs[0]) if n.callee == "module"} == {"q", "k"}


class _ReadsWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y if y.sum() > 0 else -y  # depends on the weights: no value exists on the meta device


def test_meta_trace_of_a_weight_dependent_branch_fails_with_the_first_error():
    with torch.device("meta"):
        model = _ReadsWeights()
    with pytest.raises(TraceError, match="meta tensors"):
        trace(model, torch.zeros((2, 4), device="meta"), lambda m: m is not model)
