"""What the user attached to the model survives convert(): hooks on swapped modules, and a clear word about
optimizers built before it and about Linear consumers that are quantized."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lmbp_convert import convert
from lmbp_convert.match.norm_exact import NormExact
from lmbp_convert.nn.activations import ApproxActivation
from lmbp_convert.trace.tracer import call_model
from testsupport.families import FAMILIES, hf


def test_hooks_on_a_swapped_activation_and_gated_mlp_move_to_the_new_module():
    model = hf("llama").eval()
    act, mlp = model.model.layers[0].mlp.act_fn, model.model.layers[1].mlp
    seen = []
    act.register_forward_pre_hook(lambda m, args: seen.append(("act pre", type(m).__name__)))
    h_act = act.register_forward_hook(lambda m, args, out: seen.append(("act post", type(m).__name__)) or out * 2)
    mlp.register_forward_hook(lambda m, args, out: seen.append(("mlp post", type(m).__name__)))
    mlp.register_forward_pre_hook(lambda m, args, kwargs: seen.append(("mlp pre", type(m).__name__)),
                                  with_kwargs=True)
    ref = copy.deepcopy(model)
    probe = {"input_ids": torch.tensor([[1, 2, 3, 4]])}
    rep = convert(model, probe=probe).lmbp_report
    assert rep.verified, str(rep)
    # the activation inside a gated MLP with hooks is swapped on its own (the fused op would not call it)
    assert isinstance(model.model.layers[0].mlp.act_fn, ApproxActivation)
    assert "model.layers.0.mlp" in {s.name: s.reason for s in rep.plan.skips}
    assert "model.layers.1.mlp" in [g.name for g in rep.plan.gated_mlps]
    seen.clear()
    with torch.no_grad():
        out, expected = call_model(model, probe).logits, call_model(ref, probe).logits
    assert torch.allclose(out, expected, rtol=1e-4, atol=1e-5)
    assert ("act pre", "ApproxActivation") in seen and ("act post", "ApproxActivation") in seen
    assert ("mlp pre", "MSGatedMLP") in seen and ("mlp post", "MSGatedMLP") in seen
    h_act.remove()  # the user's handle still removes the hook from the new module
    seen.clear()
    with torch.no_grad():
        assert not torch.allclose(call_model(model, probe).logits, expected, rtol=1e-4, atol=1e-5)
    assert ("act post", "ApproxActivation") not in seen and ("act pre", "ApproxActivation") in seen


def test_backward_hook_on_a_swapped_activation_still_runs():
    model = FAMILIES["bert"]()
    act = model.bert.encoder.layer[0].intermediate.intermediate_act_fn
    grads = []
    act.register_full_backward_hook(lambda m, gin, gout: grads.append(type(m).__name__))
    convert(model)
    assert isinstance(model.bert.encoder.layer[0].intermediate.intermediate_act_fn, ApproxActivation)
    model.train()
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([1])).loss.backward()
    assert grads == ["ApproxActivation"]


def test_norm_with_output_hooks_is_refused_with_reason_and_pre_hooks_are_carried():
    model = hf("llama").eval()
    layer = model.model.layers[0]
    captured = []
    layer.input_layernorm.register_forward_hook(lambda m, a, out: captured.append(out))
    pre = []
    layer.post_attention_layernorm.register_forward_pre_hook(lambda m, args: pre.append(type(m).__name__))
    layer.self_attn.q_proj.register_forward_pre_hook(lambda m, args: None)
    rep = convert(model).lmbp_report
    skips = {s.name: s.reason for s in rep.plan.skips}
    assert "forward hook" in skips["model.layers.0.input_layernorm"]
    assert type(layer.input_layernorm).__name__ == "LlamaRMSNorm"
    assert "model.layers.0.post_attention_layernorm" in rep.swapped
    pre.clear()
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert pre == ["MSExactNorm"]



def test_linear_with_pre_hooks_is_not_folded_into_and_its_hooks_see_the_original_input():
    """A pre-hook on a Linear would see the normalised input without γ: the affine is re-applied there instead
    (before the user's hook runs), and the other Linears are folded."""
    model = hf("llama").eval()
    inputs = []
    model.model.layers[1].self_attn.k_proj.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
    model.model.register_forward_hook(lambda m, args, out: inputs.append(out.last_hidden_state))
    probe = {"input_ids": torch.tensor([[1, 2, 3]])}
    with torch.no_grad():
        call_model(model, probe)
    exact = copy.deepcopy(model)
    rep = convert(model, fold_norms=True).lmbp_report
    fold = next(f for f in rep.plan.norm_folds if f.name == "model.layers.1.input_layernorm")
    assert [t.name for t in fold.targets] == ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    assert [r.module for r in fold.reapply] == ["model.layers.1.self_attn.k_proj"]
    del inputs[2:]
    with torch.no_grad():
        call_model(model, probe)
    assert torch.allclose(inputs[2], inputs[0], rtol=1e-5, atol=1e-6)
    # the exact default converts the norm and the hook (the copy's, on the same list) sees the original input
    rep = convert(exact, probe=probe).lmbp_report
    assert "model.layers.1.input_layernorm" in [it.name for it in rep.plan.of(NormExact)], str(rep)
    del inputs[2:]
    with torch.no_grad():
        call_model(exact, probe)
    assert len(inputs) == 4 and torch.allclose(inputs[2], inputs[0], rtol=1e-5, atol=1e-6)


class _Capture:
    """A user's callable-object pre-hook from a module whose name merely starts like this package's."""

    __module__ = "lmbp_convert_plugins.capture"

    def __call__(self, module, args):
        return None


def test_a_users_hook_is_told_from_ours_by_class_not_by_module_name():
    model = hf("llama").eval()
    model.model.layers[1].self_attn.k_proj.register_forward_pre_hook(_Capture())
    rep = convert(model, fold_norms=True).lmbp_report
    fold = next(f for f in rep.plan.norm_folds if f.name == "model.layers.1.input_layernorm")
    assert "model.layers.1.self_attn.k_proj" not in [t.name for t in fold.targets]
    assert [r.module for r in fold.reapply] == ["model.layers.1.self_attn.k_proj"]


def test_convert_after_an_optimizer_step_warns_about_orphaned_parameters():
    model = hf("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    exact = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"model\.layers\.0\.input_layernorm\.weight.*no longer parameters.*"
                                         r"build \(or rebuild\) it after convert\(\)"):
        convert(model, fold_norms=True)
    import warnings

    # the exact default keeps every parameter: an optimizer built before convert() still holds the model's
    opt = torch.optim.AdamW(exact.parameters(), lr=1e-3)
    exact(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rep = convert(exact).lmbp_report
    assert rep.plan.of(NormExact), str(rep)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(p) in held for p in exact.parameters())
    fresh = hf("llama")
    torch.optim.AdamW(fresh.parameters(), lr=1e-3)  # an optimizer, but no step yet: nothing to tell from
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert(fresh)


class FakeLinear4bit(nn.Linear):
    """Like bitsandbytes' Linear4bit: an nn.Linear subclass whose weight is stored packed as uint8."""

    def __init__(self, lin: nn.Linear):
        super().__init__(lin.in_features, lin.out_features, bias=lin.bias is not None)
        scale = lin.weight.detach().abs().amax() / 7
        codes = torch.clamp(torch.round(lin.weight.detach() / scale), -8, 7).to(torch.int16) + 8
        self.weight = nn.Parameter(codes.to(torch.uint8), requires_grad=False)
        self.register_buffer("scale", scale)
        if lin.bias is not None:
            self.bias = nn.Parameter(lin.bias.detach().clone())

    def forward(self, x):
        return nn.functional.linear(x, (self.weight.float() - 8) * self.scale, self.bias)


class FakeQuantLinear(nn.Module):
    """Like a GPTQ QuantLinear: not an nn.Linear, no ``weight``, an int32 ``qweight`` buffer."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.register_buffer("qweight", torch.round(lin.weight.detach() * 1000).to(torch.int32))
        self.bias = lin.bias

    def forward(self, x):
        return nn.functional.linear(x, self.qweight.float() / 1000, self.bias)


class QuantizedParam(nn.Parameter):
    """A float-stored parameter that carries quantization state (bitsandbytes Params4bit with a bf16 storage)."""


class FakeLinear4bitFloatStorage(nn.Linear):
    def __init__(self, lin: nn.Linear):
        super().__init__(lin.in_features, lin.out_features, bias=lin.bias is not None)
        self.weight = QuantizedParam(lin.weight.detach().clone(), requires_grad=False)
        self.weight.quant_state = {"blocksize": 64}
        if lin.bias is not None:
            self.bias = nn.Parameter(lin.bias.detach().clone())


@pytest.mark.parametrize("quantize, what", [(FakeLinear4bit, "weight stored as torch.uint8"),
                                            (FakeQuantLinear, "qweight stored as torch.int32"),
                                            (FakeLinear4bitFloatStorage, "quantized QuantizedParam")])
def test_quantized_linear_consumer_is_named_as_the_cause(quantize, what):
    model = hf("llama").eval()
    attn = model.model.layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, quantize(getattr(attn, name)))
    rep = convert(model).lmbp_report
    reason = {s.name: s.reason for s in rep.plan.skips}["model.layers.0.input_layernorm"]
    assert reason.startswith("consumer model.layers.0.self_attn.k_proj is a quantized Linear"), reason
    assert what in reason and "its weight cannot be folded" in reason
    assert rep.verified
