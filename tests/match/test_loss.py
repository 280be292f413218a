"""The loss matcher: found by behaviour (the labelled probe calls loss_function on a per-token head's logits, and
what it computes equals HF's causal or flat fp32 cross-entropy on check calls), else a skip with the reason."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from testsupport.families import HF_SMALL, hf, hf_auto
from lmbp_convert import plan_conversion
from lmbp_convert.match.loss import LossSwap, reference, semantics
from lmbp_convert.reasons import ReasonCode

transformers = pytest.importorskip("transformers")
HAS_HOOK = isinstance(getattr(transformers.PreTrainedModel, "loss_function", None), property)
needs_hook = pytest.mark.skipif(not HAS_HOOK, reason="transformers < 4.46: no loss_function an instance can set")
LOSS_ONLY = dict(activations=False, norms=False, gated_mlp=False)
_SEQ2SEQ = dict(vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)


class OwnLoss(nn.Module):
    """A model computing its loss in its own forward, with no loss_function attribute (as every model before
    transformers 4.46)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.norm, self.head = nn.Embedding(50, 16), nn.LayerNorm(16), nn.Linear(16, 50)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.norm(self.emb(input_ids)))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.float().reshape(-1, 50), labels.reshape(-1))
        return out


def _skips(plan):
    return {s.name: s.reason for s in plan.skips}


def test_no_settable_loss_function_is_a_skip_with_the_reason():
    plan = plan_conversion(OwnLoss(), probe={"input_ids": torch.randint(0, 50, (2, 8))}, **LOSS_ONLY)
    assert not plan.items
    assert "no loss_function an instance can set" in _skips(plan)[""]


@needs_hook
@pytest.mark.parametrize("build", [lambda: hf_auto("AutoModelForSeq2SeqLM", "bart", **_SEQ2SEQ),
                                   lambda: hf_auto("AutoModelForMaskedLM", "bert", **HF_SMALL)],
                         ids=["bart", "bert_mlm"])
def test_a_loss_computed_in_the_forward_itself_is_a_skip(build):
    """BART and BERT's masked LM build nn.CrossEntropyLoss inside forward: loss_function is never called, so
    there is nothing an instance can set (their own loss runs unchanged)."""
    plan = plan_conversion(build(), **LOSS_ONLY)
    assert not [i for i in plan.items if isinstance(i, LossSwap)]
    assert "computes the loss in its own code, not through loss_function" in _skips(plan)[""]


@needs_hook
def test_a_per_sequence_head_is_a_skip():
    model = hf_auto("AutoModelForSequenceClassification", "gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=80,
                    pad_token_id=0)
    plan = plan_conversion(model, **LOSS_ONLY)
    assert "per-token head" in _skips(plan)[""]
    assert model.config.problem_type is None  # planning never leaves the config changed


@needs_hook
def test_loss_false_plans_nothing_and_meta_is_a_skip():
    plan = plan_conversion(hf("llama"), loss=False, norms=False)
    assert not [i for i in plan.items if isinstance(i, LossSwap)] and "" not in _skips(plan)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(hf("llama").config)
    plan = plan_conversion(meta, **LOSS_ONLY)
    assert "meta device" in _skips(plan)[""]


@needs_hook
def test_planning_leaves_loss_function_as_it_was():
    model = hf("llama")
    assert "_loss_function" not in model.__dict__
    plan = plan_conversion(model, **LOSS_ONLY)
    assert [type(i) for i in plan.items] == [LossSwap] and "_loss_function" not in model.__dict__
    (item,) = plan.items
    assert item.shift and item.classes == model.config.vocab_size
    assert item.call == {"args": [], "kwargs": {"logits": "@logits", "labels": "@labels", "vocab_size": 128}}


def test_semantics_are_found_numerically():
    """The causal and flat forms are told apart by values, not names; anything else is None."""
    call = {"args": ["@logits", "@labels", 11], "kwargs": {}}
    shape = [2, 5, 11]

    def causal(logits, labels, classes, **kw):
        return reference(True, logits, labels, classes, **kw)

    def flat(logits, labels, classes, **kw):
        return reference(False, logits, labels, classes, **kw)

    def label_smoothed(logits, labels, classes, **kw):
        return F.cross_entropy(logits.reshape(-1, classes), labels.reshape(-1), label_smoothing=0.1)

    def no_kwargs(logits, labels, classes):
        return flat(logits, labels, classes)

    assert semantics(causal, call, shape, 11, None) is True
    assert semantics(flat, call, shape, 11, None) is False
    assert semantics(label_smoothed, call, shape, 11, None) is None
    assert semantics(no_kwargs, call, shape, 11, None) is None


@needs_hook
def test_a_base_model_is_left_alone_without_a_skip():
    """A base model's forward takes **kwargs but nothing in it names labels: no probe with labels, no skip."""
    plan = plan_conversion(hf("llama", head="base"), norms=False)
    assert not [i for i in plan.items if isinstance(i, LossSwap)] and "" not in _skips(plan)


PAD = 5  # a token id the user's loss masks


@needs_hook
def test_a_loss_function_the_user_set_is_kept_with_the_reason():
    """Only the class's own default is replaced: a user's function set on the instance (one that masks a pad id,
    which no check call can tell from HF's loss when the pad id is not drawn) and a wrapper of the default are
    the user's, kept, and the skip says so by its code; the default object set back on the instance is the
    default."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = hf("llama")
    default = model.loss_function

    def pad_masking(logits, labels, vocab_size, **kwargs):
        return ForCausalLMLoss(logits, labels.masked_fill(labels == PAD, -100), vocab_size, **kwargs)

    for own in (pad_masking, lambda *args, **kwargs: default(*args, **kwargs)):
        model.loss_function = own
        plan = plan_conversion(model, **LOSS_ONLY)
        assert not [i for i in plan.items if isinstance(i, LossSwap)]
        (skip,) = [s for s in plan.skips if s.name == ""]
        assert skip.why.code is ReasonCode.USERS_OWN
        assert model.loss_function is own
    model.loss_function = default
    assert [type(i) for i in plan_conversion(model, **LOSS_ONLY).items] == [LossSwap]


@needs_hook
def test_a_head_whose_forward_the_user_set_keeps_the_plain_path():
    """An instance ``forward`` on the head (a user's, or a wrapper such as accelerate's device hooks) would bypass
    the fused head: the loss is still swapped, the head is left as it is, with the reason."""
    model = hf("llama")
    head = model.lm_head
    head.forward = lambda x: torch.nn.functional.linear(x, head.weight, head.bias)
    plan = plan_conversion(model, **LOSS_ONLY)
    (item,) = [i for i in plan.items if isinstance(i, LossSwap)]
    assert item.head == ""
    (skip,) = [s for s in plan.skips if s.name == "lm_head"]
    assert skip.why.code is ReasonCode.USERS_OWN


@needs_hook
def test_a_probe_with_its_own_labels_is_planned_as_one_without():
    """The user's probe may carry labels (a training batch): the check calls' labels stand in for them, where the
    probe run used to fail with "got multiple values for keyword argument 'labels'" and the loss was skipped."""
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    plan = plan_conversion(hf("llama"), probe={"input_ids": ids, "labels": ids.clone()}, **LOSS_ONLY)
    assert [i for i in plan.items if isinstance(i, LossSwap)], _skips(plan)
