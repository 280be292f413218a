"""Verification also runs in train mode (issue 20, item 2): the original and the converted model on the same RNG
draws (dropout masks, LayerDrop skips), so a rewrite that is wrong only on a branch training takes is rolled back,
naming the draw; the user's RNG state and the model's buffers are left as they were."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lmbp_convert import convert
from lmbp_convert.apply.verify import TRAIN_DRAWS
from lmbp_convert.nn.exact_norms import MSExactNorm
from testsupport.families import FAMILIES, SEQ2SEQ_SMALL, hf_auto

IDS = torch.tensor([[3, 17, 42, 9, 5, 77, 1, 2]])


def test_a_rewrite_wrong_only_in_training_is_rolled_back(monkeypatch):
    """Fault injection: exact norms that add 1e-2 to their output in train mode only pass eval verification."""
    real = MSExactNorm.forward

    def train_only_fault(self, x):
        y = real(self, x)
        return y + 1e-2 if self.training else y

    monkeypatch.setattr(MSExactNorm, "forward", train_only_fault)
    model = FAMILIES["llama"]()
    report = convert(model, activations=False).lmbp_report
    norms = [s for s in report.plan.skips if s.reason.startswith("rolled back")]
    assert norms and not [n for n, m in model.named_modules() if isinstance(m, MSExactNorm)]
    assert all("in train mode (RNG seed 0)" in s.reason for s in norms), norms
    assert report.verified and report.train_draws == 1  # no dropout in this config: one draw


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_layerdrop_branch_of_a_fold_is_caught():
    """BART's last encoder norm folded into every cross-attention k/v is wrong when LayerDrop skips that layer:
    eval verification never sees it, the train-mode draws do, and after the roll-back every draw is the
    original's."""
    build = lambda: hf_auto("AutoModelForSeq2SeqLM", "bart", **dict(SEQ2SEQ_SMALL, encoder_layerdrop=0.5,  # noqa: E731
                                                                         decoder_layerdrop=0.5)).eval()
    model = build()
    ref = copy.deepcopy(model)
    report = convert(model, fold_norms=True).lmbp_report
    assert report.rolled_back and report.train_draws == TRAIN_DRAWS
    assert any("in train mode" in s.reason for s in report.plan.skips if s.reason.startswith("rolled back"))
    dec = torch.tensor([[2, 5, 9, 4]])
    model.train()
    ref.train()
    for seed in range(8):
        outs = []
        for m in (ref, model):
            torch.manual_seed(seed)
            with torch.no_grad():
                outs.append(m(input_ids=IDS, decoder_input_ids=dec).logits)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)


def test_train_mode_checks_leave_rng_and_buffers_alone():
    """BatchNorm's running statistics and counter, and the caller's RNG stream, are as before convert()."""
    import timm

    model = timm.create_model("resnet18", pretrained=False, num_classes=4).eval()  # BatchNorm, no norm to rewrite
    model = nn.Sequential(model, nn.GELU())
    bufs = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}
    probe = torch.randn(2, 3, 32, 32)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    convert(model, probe=probe)
    assert torch.equal(torch.rand(3), expected)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in bufs.items())
