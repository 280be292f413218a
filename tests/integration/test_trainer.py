"""A converted model trains under transformers.Trainer (accelerate underneath) with bf16 autocast on CPU."""
import copy

import pytest
import torch

from lmbp_convert import convert
from lmbp_convert.export import save_pretrained
from lmbp_convert.nn.exact_norms import MSExactNorm
from testsupport.families import hf

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
try:  # the compat stage's transformers 4.45 imports the installed datasets, newer than its huggingface_hub allows
    from transformers import Trainer, TrainingArguments
except (ImportError, RuntimeError) as e:
    pytest.skip(f"transformers' Trainer cannot be imported here: {e}", allow_module_level=True)

pytestmark = pytest.mark.slow  # transformers Trainer runs


class _Rows(torch.utils.data.Dataset):
    """A tiny in-memory dataset of fixed-length token rows."""

    def __init__(self, n, seq, vocab, causal, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=gen)
        self.labels = self.ids if causal else torch.randint(0, 2, (n,), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _args(tmp_path, max_steps=3):
    return TrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True, max_steps=max_steps,
                             per_device_train_batch_size=2, report_to=[], save_strategy="no", logging_steps=1,
                             learning_rate=1e-3, dataloader_num_workers=0, seed=0)


def _run(model, tmp_path, causal):
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=_Rows(8, 12, 128, causal))
    result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    changed = [n for n, p in model.named_parameters() if n in before and not torch.equal(p.detach(), before[n])]
    return result, losses, changed, before


@pytest.mark.parametrize("arch,causal", [("llama", True), ("bert", False)])
def test_converted_model_trains_under_trainer_bf16(arch, causal, tmp_path):
    model = hf(arch) if causal else hf(arch, head="cls")
    reference = copy.deepcopy(model)
    convert(model)
    assert any(isinstance(m, MSExactNorm) for m in model.modules())  # the exact default
    result, losses, changed, before = _run(model, tmp_path / "conv", causal)
    assert result.global_step == 3
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))), losses
    assert len(changed) == len(before), sorted(set(before) - set(changed))[:5]

    # same data, same seed, unconverted: the first loss (before any update) agrees up to bf16 autocast noise
    _, ref_losses, _, _ = _run(reference, tmp_path / "ref", causal)
    assert abs(losses[0] - ref_losses[0]) <= 0.02 * abs(ref_losses[0]), (losses, ref_losses)

    # the Trainer-trained converted model exports to a checkpoint plain transformers loads with its outputs
    # (accelerate left its bf16 autocast wrapper on model.forward: compare in fp32 without it)
    from accelerate.utils import extract_model_from_parallel

    model = extract_model_from_parallel(model, keep_fp32_wrapper=False)
    save_pretrained(model, tmp_path / "export")
    loaded = type(reference).from_pretrained(tmp_path / "export").eval()
    ids = _Rows(2, 12, 128, causal, seed=5).ids
    with torch.no_grad():
        want, got = model.eval()(input_ids=ids).logits, loaded(input_ids=ids).logits
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_trainer_autocast_keeps_norm_output_shared(tmp_path):
    """Under the Trainer's bf16 autocast the MS norms emit bf16, so the Linear saves the norm's storage (no
    cast copy): the converted step keeps fewer bytes than the unconverted one, measured inside Trainer."""
    from lmbp_convert import SavedTensorLedger

    model = hf("llama")
    reference = copy.deepcopy(model)
    convert(model)

    def ledger_of_one_step(m):
        class _Measure(Trainer):
            ledger = None

            def compute_loss(self, model, inputs, *args, **kw):
                with SavedTensorLedger(model) as led:
                    out = super().compute_loss(model, inputs, *args, **kw)
                _Measure.ledger = led
                return out

        _Measure(model=m, args=_args(tmp_path, max_steps=1), train_dataset=_Rows(8, 12, 128, True)).train()
        return _Measure.ledger

    conv, ref = ledger_of_one_step(model), ledger_of_one_step(reference)
    # the norms' x̂ in bf16 (on CPU the exact norm's second output; elsewhere the MS norm's output)
    assert any(e.dtype == torch.bfloat16 and e.grad_fn in ("MSNormFunctionBackward", "_ExactNormBackward", "NoneType")
               and tuple(e.shape) == (2, 12, 64) for e in conv.entries), conv.summary()
    assert conv.bytes < 0.8 * ref.bytes, (conv.bytes, ref.bytes)


def _hook_args(tmp_path, **kw):
    """fp32 (the exact comparison), gradient checkpointing on, 5 logged steps."""
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, gradient_checkpointing=True, max_steps=5,
                             per_device_train_batch_size=2, report_to=[], save_strategy="no", logging_steps=1,
                             learning_rate=1e-3, dataloader_num_workers=0, seed=0, disable_tqdm=True, **kw)


def _lora_llama():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(hf("llama"), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                  task_type="CAUSAL_LM"))


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_convert_callback_with_lora_and_gradient_checkpointing(tmp_path):
    """The trainer hook (issue 36): `ConvertCallback` converts the model a Trainer holds before the optimizer is
    built; with PEFT LoRA and gradient checkpointing on, the converted run (``activations=False``) gives the
    unconverted run's losses within 1e-5 over 5 steps. The first step is counted: every rewrite ran, the
    model's own loss too (the Trainer calls it)."""
    from lmbp_convert.integrations import ConvertCallback

    def run(out, callbacks):
        trainer = Trainer(model=_lora_llama(), args=_hook_args(out), train_dataset=_Rows(10, 12, 128, True),
                          callbacks=callbacks)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer

    want, _ = run(tmp_path / "ref", [])
    got, trainer = run(tmp_path / "conv", [ConvertCallback(activations=False)])
    assert len(got) == len(want) == 5 and max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)
    model = trainer.model
    report = model.lmbp_report
    assert any(isinstance(m, MSExactNorm) for m in model.modules()) and report.plan.gated_mlps
    assert report.ran is not None and report.never_ran == [], report.ran
    assert report.ran["loss_swaps"] == {"base_model.model": 1}  # one micro-batch, one loss
    assert report.ran["norm_exact"]["base_model.model.model.layers.0.input_layernorm"] == 2  # and its recompute
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    assert trained == {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}


def test_convert_callback_says_when_it_comes_too_late(tmp_path):
    """Clear errors: options are checked when the callback is made; a trainer given an optimizer (built before
    convert() could run) is refused at its __init__; a callback added after the trainer was built never
    converted, and train() stops before the first step."""
    from lmbp_convert.integrations import ConvertCallback

    with pytest.raises(ValueError, match="bits"):
        ConvertCallback(bits=9)
    model = _lora_llama()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with pytest.raises(ValueError, match="optimizer"):
        Trainer(model=model, args=_hook_args(tmp_path), train_dataset=_Rows(4, 12, 128, True),
                optimizers=(opt, None), callbacks=[ConvertCallback()])
    assert not hasattr(model, "lmbp_report")  # nothing converted
    trainer = Trainer(model=model, args=_hook_args(tmp_path), train_dataset=_Rows(4, 12, 128, True))
    trainer.add_callback(ConvertCallback())
    with pytest.raises(RuntimeError, match="callbacks="):
        trainer.train()
