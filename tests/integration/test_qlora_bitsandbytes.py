"""Issue 36 item 4: real bitsandbytes 4-bit on CPU (its CPU backend ships in the index's wheels since 0.48; where it
does not run, these tests skip saying why). The QLoRA flow as docs/recipes.md gives it — fold on disk, load in 4
bits, ``prepare_model_for_kbit_training`` (which turns on gradient checkpointing and freezes every weight), LoRA,
``convert()`` — and a 4-bit layer width bitsandbytes' CPU inference path refuses."""
from __future__ import annotations

import pytest
import torch

from lmbp_convert import TraceError, cli, convert
from lmbp_convert.apply.measure import measure_saved
from lmbp_convert.match.plan import GatedMLPSwap, NormFold
from lmbp_convert.trace.probe import make_probe
from testsupport.bnb import cpu_4bit_problem, load_4bit
from testsupport.families import hf

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.skipif(cpu_4bit_problem() is not None, reason=str(cpu_4bit_problem()))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _folded_checkpoint(tmp_path, intermediate: int):
    hf("llama", intermediate_size=intermediate).save_pretrained(tmp_path / "src")
    assert cli.main([str(tmp_path / "src"), str(tmp_path / "dst"), "-q", "--no-progress"]) == 0
    return tmp_path / "dst"


def _qlora(path):
    model = peft.prepare_model_for_kbit_training(load_4bit(path))
    torch.manual_seed(3)  # the same adapters for every model built here
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM",
                          init_lora_weights="gaussian")
    return peft.get_peft_model(model, cfg).train()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
def test_qlora_flow_on_real_4bit_weights(tmp_path):
    path = _folded_checkpoint(tmp_path, 192)  # widths bitsandbytes' CPU blocks divide
    plain, ours = _qlora(path), _qlora(path)
    # bitsandbytes repacks a 4-bit weight for its CPU kernel at the first eval-mode forward under no_grad (on CPUs
    # with AVX512-BF16), which convert()'s trace is; any evaluation does it too, and the plain model has one here
    with torch.no_grad():
        plain.eval()(input_ids=torch.zeros(2, 8, dtype=torch.long))
    plain.train()
    inner = ours.get_base_model().model
    assert type(inner.layers[0].mlp.gate_proj.base_layer).__name__ == "Linear4bit"
    rep = convert(ours).lmbp_report
    text = str(rep)
    assert rep.verified and not rep.plan.skips, text
    assert len(rep.plan.of(NormFold)) == 5 and all(f.prefolded for f in rep.plan.of(NormFold))
    assert len(rep.plan.of(GatedMLPSwap)) == 2
    # every weight the swapped norms touch is frozen (4-bit, or frozen by prepare_model_for_kbit_training)
    assert rep.inexact_training == {} and "training not exact" not in text and "trains the folded" not in text
    # prepare_model_for_kbit_training turned gradient checkpointing on: the report says so, and what it does
    m = rep.measurement
    assert m.checkpointing == "HF gradient checkpointing on 2 modules", m
    assert "activation checkpointing is on (HF gradient checkpointing on 2 modules)" in text
    probe = make_probe(ours)[0]
    assert measure_saved(ours, probe).bytes == m.after  # the headline: the forward as it trains, checkpointed
    before, after = m.without_checkpointing
    assert after < 0.8 * before, m
    (inner.activation_checkpointing_disable if hasattr(inner, "activation_checkpointing_disable")
     else inner.gradient_checkpointing_disable)()
    assert measure_saved(ours, probe).bytes == after  # the same forward, checkpointing off for real
    assert "with checkpointing off keeps" in text
    # a training step: plain QLoRA's loss and adapter gradients
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    (inner.activation_checkpointing_enable if hasattr(inner, "activation_checkpointing_enable")
     else inner.gradient_checkpointing_enable)()
    losses, grads = [], []
    for model in (plain, ours):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(float(loss))
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert grads[0].keys() == grads[1].keys() and all(g is not None for g in grads[1].values())
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
def test_a_width_the_4bit_inference_path_refuses_is_named_not_blamed_on_the_probe(tmp_path):
    model = _qlora(_folded_checkpoint(tmp_path, 172))  # gate/up: 172 output features, not a multiple of 32
    ids = torch.zeros(2, 8, dtype=torch.long)
    model.eval()
    try:
        with torch.no_grad():
            model(input_ids=ids)
    except Exception:  # noqa: BLE001 - the case under test
        pass
    else:
        pytest.skip("bitsandbytes' CPU inference path takes this width on this CPU (it repacks 4-bit weights only "
                    "with AVX512-BF16)")
    model.train()
    with pytest.raises(TraceError) as info:
        convert(model)
    msg = str(info.value)
    assert "own forward fails in eval mode under torch.no_grad()" in msg and "no probe would help" in msg, msg
    assert "pass probe=" not in msg and "mlp.gate_proj.base_layer (bitsandbytes.nn.modules.Linear4bit)" in msg, msg
    assert "stored as torch.uint8 (quantized)" in msg, msg
