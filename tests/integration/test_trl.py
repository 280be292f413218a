"""TRL's trainers train a converted model (issue 36): SFTTrainer's own loss (its fused LM head: the backbone's last
hidden state sliced ``[:, :-1]``, flattened, projected through ``lm_head.weight`` in chunks, never the model's
``loss_function``), with the PeftModel converted by hand or with ``peft_config=`` and `ConvertCallback`, and
DPOTrainer with the callback. Each run gives the unconverted run's losses: in fp32 within 1e-5 over 5 steps
(``activations=False``: only the exact rewrites), under TRL's default bf16 autocast within bf16 rounding. The report says the memory-sharing loss never ran.

Not ``compat``: TRL needs a newer transformers than the compat stage's; the module skips where trl or datasets
cannot be imported.
"""
import pytest
import torch

try:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
except Exception as exc:  # noqa: BLE001 - not installed, or built for another transformers (the compat stage's)
    pytest.skip(f"trl / datasets cannot be imported: {type(exc).__name__}: {exc}", allow_module_level=True)

from peft import LoraConfig, get_peft_model

from lmbp_convert import SavedTensorLedger, convert
from lmbp_convert.apply.runs import count_runs
from lmbp_convert.integrations import ConvertCallback
from lmbp_convert.match.loss import LossSwap
from lmbp_convert.nn.exact_norms import MSExactNorm
from testsupport.families import hf
from testsupport.text import TEXTS, word_tokenizer

pytestmark = [pytest.mark.slow,  # TRL trainers run, 5 steps each
              pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

STEPS = 5
EXACT = 1e-5  # fp32: the exact rewrites follow the unconverted run (measured: SFT 0, DPO 6e-8)


def _lora():
    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


def _sft_args(tmp_path, **kw):
    """SFTConfig's defaults (gradient checkpointing on, bf16 unless ``bf16=False``) on the CPU, 5 logged steps."""
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=STEPS, per_device_train_batch_size=4,
                     logging_steps=1, learning_rate=1e-3, save_strategy="no", report_to=[], disable_tqdm=True,
                     seed=0, **kw)
    assert args.gradient_checkpointing
    return args


def _losses(trainer):
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses))), losses
    return losses


def _model():
    torch.manual_seed(0)  # the same model, and the same LoRA init (drawn inside SFTTrainer with peft_config=)
    return hf("llama").train()


class _FirstLossLedger(SFTTrainer):
    """SFTTrainer whose first loss runs under the saved-tensor ledger (what that step's backward keeps), with the
    shape of TRL's flattened hidden states, ``last_hidden_state[:, :-1]`` over the batch: (B·(T − 1), H)."""

    ledger = flat_hidden = None

    def compute_loss(self, model, inputs, *args, **kwargs):
        if self.ledger is not None:
            return super().compute_loss(model, inputs, *args, **kwargs)
        with SavedTensorLedger(model) as ledger:
            out = super().compute_loss(model, inputs, *args, **kwargs)
        b, t = inputs["input_ids"].shape
        self.ledger, self.flat_hidden = ledger, (b * (t - 1), model.config.hidden_size)
        return out


def _sft_by_hand(tmp_path, conv, bf16=False):
    """The recipe's way: get_peft_model, convert(), then the PeftModel to SFTTrainer (counted over all steps).
    Returns the losses, the model and whether the first step kept TRL's flattened hidden states."""
    model = get_peft_model(_model(), _lora())
    model.enable_input_require_grads()
    if conv:
        convert(model, activations=False)
    trainer = _FirstLossLedger(model=model, args=_sft_args(tmp_path, bf16=bf16), train_dataset=Dataset.from_dict(
        {"text": TEXTS * 3}), processing_class=word_tokenizer())
    if conv:
        with count_runs(model):
            trainer.train()
    else:
        trainer.train()
    kept = any(e.shape == trainer.flat_hidden for e in trainer.ledger.entries)
    return _losses(trainer), model, kept


def _sft_peft_config(tmp_path, conv):
    callbacks = [ConvertCallback(activations=False)] if conv else []
    trainer = SFTTrainer(model=_model(), args=_sft_args(tmp_path, bf16=False), peft_config=_lora(),
                         train_dataset=Dataset.from_dict({"text": TEXTS * 3}), processing_class=word_tokenizer(),
                         callbacks=callbacks)
    trainer.train()
    return _losses(trainer), trainer


def _trl_computed_the_loss(model):
    """TRL's fused head computed the loss: the model's (memory-sharing) loss_function was never called, while
    every other rewrite ran, the final norm, whose output TRL slices and projects, among them."""
    report = model.lmbp_report
    assert [type(it) for it in report.never_ran] == [LossSwap], report.ran
    assert report.ran["norm_exact"]["base_model.model.model.norm"] > 0
    assert "in place but never called: 1 loss (base_model.model)" in str(report)


def _max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


def test_sft_trainer_default_loss_trains_a_converted_peft_model_as_the_unconverted(tmp_path):
    want, _, kept = _sft_by_hand(tmp_path / "ref", conv=False)
    got, model, kept_converted = _sft_by_hand(tmp_path / "conv", conv=True)
    assert _max_diff(got, want) <= EXACT, (got, want)
    assert any(isinstance(m, MSExactNorm) for m in model.modules())
    _trl_computed_the_loss(model)
    # the final norm's output reaches TRL's head through a negative slice and a copy (reshape), which backward
    # keeps: the unconverted step keeps that copy, the converted one rebuilds it from the norm's x̂
    assert kept and not kept_converted


def test_sft_trainer_under_its_default_bf16(tmp_path):
    """TRL's defaults as they are (bf16 autocast): the exact norms compute the same function and gradients by
    another sequence of bf16 operations (docs/fidelity.md), so the losses agree up to that rounding, which Adam
    carries on (measured: 1.6e-4, the largest at step 0)."""
    want, _, kept = _sft_by_hand(tmp_path / "ref", conv=False, bf16=True)
    got, model, kept_converted = _sft_by_hand(tmp_path / "conv", conv=True, bf16=True)
    assert kept and not kept_converted
    assert _max_diff(got, want) <= 5e-3, (got, want)
    _trl_computed_the_loss(model)


def test_sft_trainer_with_peft_config_and_the_callback(tmp_path):
    """peft_config=: PEFT is applied inside the trainer; the callback converts the PeftModel it built before the
    optimizer exists (the optimizer's parameters are the converted model's)."""
    want, _ = _sft_peft_config(tmp_path / "ref", conv=False)
    got, trainer = _sft_peft_config(tmp_path / "conv", conv=True)
    assert _max_diff(got, want) <= EXACT, (got, want)
    model = trainer.model
    assert any(isinstance(m, MSExactNorm) for m in model.modules())
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    assert trained and trained == {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    _trl_computed_the_loss(model)


def test_dpo_trainer_with_peft_config_and_the_callback(tmp_path):
    data = Dataset.from_dict({"prompt": ["the sky is", "the grass is"] * 4, "chosen": [" blue", " green"] * 4,
                              "rejected": [" green", " blue"] * 4})

    def run(out, conv):
        args = DPOConfig(output_dir=str(out), use_cpu=True, bf16=False, max_steps=STEPS, per_device_train_batch_size=4,
                         logging_steps=1, learning_rate=1e-3, save_strategy="no", report_to=[], disable_tqdm=True,
                         seed=0)
        trainer = DPOTrainer(model=_model(), args=args, train_dataset=data, processing_class=word_tokenizer(),
                             peft_config=_lora(), callbacks=[ConvertCallback(activations=False)] if conv else [])
        trainer.train()
        return _losses(trainer), trainer.model

    want, _ = run(tmp_path / "ref", False)
    got, model = run(tmp_path / "conv", True)
    assert _max_diff(got, want) <= EXACT, (got, want)
    _trl_computed_the_loss(model)
