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
from transformers import Trainer, TrainingArguments  # noqa: E402

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
    # the norms' x̂ in bf16 (on CPU the exact norm's second output, no grad_fn; elsewhere the MS norm's output)
    assert any(e.dtype == torch.bfloat16 and e.grad_fn in ("MSNormFunctionBackward", "NoneType")
               and tuple(e.shape) == (2, 12, 64) for e in conv.entries), conv.summary()
    assert conv.bytes < 0.8 * ref.bytes, (conv.bytes, ref.bytes)
