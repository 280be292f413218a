"""Which rewrites ran (issue 36, item 3): `count_runs` counts each applied rewrite's calls over a training step and
writes them to the report, which then names the rewrites in place that never ran (the LM-head loss where the
caller computes its own loss from the logits); the counters change nothing and leave nothing behind."""
import copy

import pytest
import torch
import torch.nn.functional as F

from lmbp_convert import convert
from lmbp_convert.apply.runs import count_runs
from lmbp_convert.match.loss import LossSwap
from lmbp_convert.nn.loss import MSCrossEntropyLoss
from testsupport.families import hf, lora_on_every_linear

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))


def _hooks(model):
    return [h for m in model.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]


def test_a_step_with_the_models_own_loss_runs_every_rewrite():
    model = convert(hf("llama")).train()
    report = model.lmbp_report
    assert report.ran is None and "ran in the counted" not in str(report)  # nothing counted yet
    hooks_before = _hooks(model)
    loss_fn = model.loss_function
    with count_runs(model):
        model(input_ids=IDS, labels=IDS).loss.backward()
    assert _hooks(model) == hooks_before and model.loss_function is loss_fn  # the counters are gone
    assert isinstance(loss_fn, MSCrossEntropyLoss)
    assert report.ran["loss_swaps"] == {"": 1}
    assert report.ran["gated_mlps"] == {f"model.layers.{i}.mlp": 1 for i in range(2)}
    assert set(report.ran["norm_exact"]) == {it.name for it in report.plan.items if it.tag == "norm_exact"}
    assert report.never_ran == []
    line = next(ln for ln in str(report).splitlines() if ln.startswith("ran in the counted training step"))
    assert "1 of 1 loss" in line and "2 of 2 gated MLPs" in line and "never called" not in line
    assert report.to_dict()["ran"] == report.ran


def test_a_loss_computed_from_the_logits_by_the_caller_leaves_the_lm_head_loss_unrun():
    """What TRL's trainers do (from the hidden states): the model's loss_function is never called. The report says
    so; a second count replaces the first."""
    model = convert(hf("llama")).train()
    report = model.lmbp_report
    with count_runs(model) as counter:
        logits = model(input_ids=IDS).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), IDS[:, 1:].flatten()).backward()
    assert counter.total() > 0
    assert report.ran["loss_swaps"] == {"": 0}
    assert [type(it) for it in report.never_ran] == [LossSwap]
    text = str(report)
    assert "in place but never called: 1 loss (<model>)" in text, text
    assert "0 of 1" not in text  # kinds that never ran are named, not counted

    with count_runs(model):
        model(input_ids=IDS, labels=IDS).loss.backward()
    assert report.ran["loss_swaps"] == {"": 1} and report.never_ran == []


def test_counting_changes_no_value_and_counts_recomputed_forwards():
    """bf16 LoRA on every Linear (fp32 adapters: each LoRA layer shares its input). The fused gated MLP computes
    its LoRA down projection itself, which a hook that does more than note would switch off: gradients bitwise
    those of the uncounted step, and the down projections' input sharing, in place for when the fused op cannot
    take them, is named as never called. Under gradient checkpointing the norms run again in backward: counted."""
    model = hf("llama").to(torch.bfloat16)
    model = convert(lora_on_every_linear(model)).train()
    twin = copy.deepcopy(model)

    def step(m):
        m.zero_grad(set_to_none=True)
        m(input_ids=IDS, labels=IDS).loss.backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    want = step(twin)
    with count_runs(model):
        got = step(model)
    assert want.keys() == got.keys() and all(torch.equal(got[n], want[n]) for n in want)
    report = model.lmbp_report
    idle = sorted(it.name for it in report.never_ran)
    assert idle == [f"base_model.model.model.layers.{i}.mlp.down_proj" for i in range(2)], idle
    assert report.ran["lora_inputs"]["base_model.model.model.layers.0.mlp.gate_proj"] == 1
    plain = dict(report.ran["norm_exact"])

    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with count_runs(model):
        step(model)
    again = report.ran["norm_exact"]
    layer_norm = "base_model.model.model.layers.0.input_layernorm"
    assert plain[layer_norm] == 1 and again[layer_norm] == 2, again


def test_a_conversion_under_a_wrapper_is_counted_through_it():
    """convert() before get_peft_model: the report is the inner model's, its names under the wrapper's prefix."""
    from peft import LoraConfig, get_peft_model

    inner = convert(hf("llama"))
    model = get_peft_model(inner, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).train()
    with count_runs(model):
        model(input_ids=IDS, labels=IDS).loss.backward()
    ran = inner.lmbp_report.ran
    assert ran["gated_mlps"] == {f"model.layers.{i}.mlp": 1 for i in range(2)} and ran["loss_swaps"] == {"": 1}


def test_an_unconverted_model_is_refused():
    with pytest.raises(ValueError, match="was not converted"):
        count_runs(hf("llama"))
