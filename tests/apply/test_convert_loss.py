"""convert() installs the memory-sharing loss through ``loss_function`` on LM heads (causal, tied, Gemma-2's
soft-capped logits, masked LM, token classification, an encoder-decoder): the loss and every parameter gradient
equal the unconverted model's, ``outputs.logits`` is unchanged, the state dict too; undo restores the attribute,
the converted model pickles and deep-copies; the loss runs under torch.compile(fullgraph=True)."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from testsupport.families import HF_SMALL, hf, hf_auto
from lmbp_convert import convert, plan_conversion
from lmbp_convert.apply.rewrite import UnitBuilder
from lmbp_convert.match.loss import LossSwap
from lmbp_convert.match.plan import Plan
from lmbp_convert.nn.loss import MSCrossEntropyLoss, MSLogitsHead
from lmbp_convert.reasons import ReasonCode

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not isinstance(getattr(transformers.PreTrainedModel, "loss_function", None),
                                               property),
                                reason="transformers < 4.46: no loss_function an instance can set")

_T5GEMMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, vocab_size=128)
MODELS = {
    "llama": lambda: hf("llama"),
    "llama_tied": lambda: hf("llama", tie_word_embeddings=True),
    "gpt2": lambda: hf("gpt2"),  # tied head
    "gemma2": lambda: hf("gemma2", head_dim=16, intermediate_size=172, num_key_value_heads=2,
                         final_logit_softcapping=3.0),  # a cap the random logits reach
    "modernbert_mlm": lambda: hf_auto("AutoModelForMaskedLM", "modernbert", **HF_SMALL, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2),
    "neox_token_cls": lambda: hf_auto("AutoModelForTokenClassification", "gpt_neox", **HF_SMALL, num_labels=5),
    "t5gemma": lambda: hf_auto("AutoModelForSeq2SeqLM", "t5gemma", encoder=_T5GEMMA, decoder=_T5GEMMA,
                               vocab_size=128),
}
SHIFTED = {"llama", "llama_tied", "gpt2", "gemma2"}  # T5Gemma: labels are already the decoder targets
#: the Linear whose output is the logits as they reach the loss (its backward makes the loss's gradient by
#: rows); Gemma-2 and T5Gemma soft-cap the logits after their head, so theirs keep the plain path
HEADS = {"llama": "lm_head", "llama_tied": "lm_head", "gpt2": "lm_head", "modernbert_mlm": "decoder",
         "neox_token_cls": "classifier"}


def _build(name, dtype=torch.float32):
    try:
        model = MODELS[name]()
    except Exception as exc:  # noqa: BLE001 - a family this transformers lacks
        pytest.skip(f"{name} cannot be built here ({type(exc).__name__})")
    return model.to(dtype)


def _inputs(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    classes = getattr(model.config, "num_labels", 0) if "TokenClassification" in type(model).__name__ else \
        model.config.get_text_config().vocab_size
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (2, 12), generator=gen)
    labels = torch.randint(0, classes, (2, 12), generator=gen)
    labels[:, :3] = -100
    kw = dict(input_ids=ids, labels=labels)
    if model.config.is_encoder_decoder:
        kw["decoder_input_ids"] = torch.randint(3, vocab, (2, 12), generator=gen)
    return kw


def _step(model, kw, call=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same dropout masks in both models (the loss draws no random numbers)
    out = (call if call is not None else model)(**kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


def _loss_only(model):
    return convert(model, activations=False, norms=False, gated_mlp=False)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_loss_and_every_gradient_match_the_unconverted_model(name, dtype, monkeypatch):
    from lmbp_convert.ops import logits_head

    fused = []
    real = logits_head._fused_backward
    monkeypatch.setattr(logits_head, "_fused_backward", lambda *a: (fused.append(1), real(*a))[1])
    model = _build(name, dtype)
    ref = copy.deepcopy(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _loss_only(model)
    items = model.lmbp_report.plan.items
    assert [type(i) for i in items] == [LossSwap], model.lmbp_report.plan.skips
    assert items[0].shift is (name in SHIFTED)
    assert items[0].head == HEADS.get(name, "")
    if items[0].head:
        assert type(model.get_submodule(items[0].head)) is MSLogitsHead
    assert isinstance(model.__dict__["_loss_function"], MSCrossEntropyLoss)
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    for extra in ({}, {"num_items_in_batch": torch.tensor(9)}):
        kw = dict(_inputs(model), **extra)
        loss, logits, grads = _step(model, kw)
        loss_r, logits_r, grads_r = _step(ref, kw)
        assert torch.equal(logits, logits_r)  # outputs.logits unchanged
        assert loss.dtype == loss_r.dtype == torch.float32
        torch.testing.assert_close(loss, loss_r, atol=1e-5, rtol=1e-5)
        assert grads.keys() == grads_r.keys()
        for k in grads:  # fp32: summation order only; bf16: one rounding of each logit's gradient, propagated
            g, g_r = grads[k].double(), grads_r[k].double()
            err = float((g - g_r).norm() / g_r.norm().clamp_min(1e-30))
            assert err <= (1e-4 if dtype == torch.float32 else 2e-2), (k, err)
    assert len(fused) == (2 if name in HEADS else 0)  # each backward took the hand-off


def test_gemma2_soft_capping_reaches_the_loss():
    """The cap runs in the model's forward before the loss: the converted loss sees the capped logits."""
    model = _build("gemma2")
    assert model.config.final_logit_softcapping == 3.0
    _loss_only(model)
    kw = _inputs(model)
    out = model(**kw)
    assert float(out.logits.detach().abs().max()) <= 3.0
    shifted = torch.nn.functional.pad(kw["labels"], (0, 1), value=-100)[:, 1:]
    ref = torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), shifted.reshape(-1))
    torch.testing.assert_close(out.loss, ref, atol=1e-6, rtol=1e-6)


def test_shift_labels_keyword_reaches_the_loss():
    import inspect

    from transformers.loss.loss_utils import ForCausalLMLoss

    if "shift_labels" not in inspect.signature(ForCausalLMLoss).parameters:
        pytest.skip("this transformers' ForCausalLMLoss has no shift_labels")
    model = _build("llama")
    ref = copy.deepcopy(model)
    _loss_only(model)
    kw = _inputs(model)
    kw["shift_labels"] = torch.roll(kw["labels"], 1, dims=1)
    loss, _, grads = _step(model, kw)
    loss_r, _, grads_r = _step(ref, kw)
    torch.testing.assert_close(loss, loss_r, atol=1e-6, rtol=1e-6)
    for k in grads:
        torch.testing.assert_close(grads[k], grads_r[k], atol=1e-6, rtol=1e-5)


def test_full_conversion_keeps_the_loss_exact():
    """With norms folded and the gated MLP fused too, the loss still equals the original's."""
    model = _build("llama")
    ref = copy.deepcopy(model)
    convert(model)
    assert any(isinstance(i, LossSwap) for i in model.lmbp_report.plan.items)
    kw = _inputs(model)
    torch.testing.assert_close(model(**kw).loss, ref(**kw).loss, atol=1e-5, rtol=1e-5)


def test_undo_restores_the_attribute_absent_or_the_users_own():
    for own in (None, lambda **kw: torch.tensor(0.0)):
        model = _build("llama")
        if own is not None:
            model.loss_function = own
        before = dict(model.__dict__)
        plan = plan_conversion(model, activations=False, norms=False, gated_mlp=False)
        if own is not None:  # a loss the user set: kept, with why
            assert not plan.items and plan.skips[0].why.code is ReasonCode.USERS_OWN
            continue
        unit = plan.items[0].build_unit(UnitBuilder(model))
        unit.apply()
        assert isinstance(model.loss_function, MSCrossEntropyLoss) and type(model.lm_head) is MSLogitsHead
        unit.undo()
        assert type(model.lm_head) is torch.nn.Linear
        assert ("_loss_function" in model.__dict__) == ("_loss_function" in before)
        unit.undo()  # idempotent
        assert model.loss_function is not None and not isinstance(model.loss_function, MSCrossEntropyLoss)


def test_a_converted_model_pickles_and_deep_copies():
    model = _build("gpt2").eval()  # no dropout: the copies must give the same loss
    _loss_only(model)
    kw = _inputs(model)
    want = model(**kw).loss
    for other in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert isinstance(other.loss_function, MSCrossEntropyLoss)
        torch.testing.assert_close(other(**kw).loss, want, atol=0, rtol=0)


def test_plan_round_trips_and_reports():
    model = _build("llama", torch.bfloat16)
    plan = plan_conversion(model, activations=False, norms=False, gated_mlp=False)
    (item,) = plan.items
    again = Plan.from_dict(plan.to_dict())
    assert again.items == plan.items
    text = str(_loss_only(model).lmbp_report)
    assert "memory-sharing loss" in text and "causal (labels shifted)" in text and "bfloat16 logits" in text
    # the prediction is the ledger's difference on the probe's logits: HF's fp32 log-softmax against the bf16
    # logits and an fp32 lse per row
    from transformers.loss.loss_utils import ForCausalLMLoss

    from lmbp_convert.memory import SavedTensorLedger

    out = model(**plan.probe) if isinstance(plan.probe, dict) else model(plan.probe)
    logits = out.logits.detach().requires_grad_()
    labels = torch.randint(0, item.classes, logits.shape[:-1])
    with SavedTensorLedger() as hf_ledger:
        ForCausalLMLoss(logits, labels, item.classes)
    with SavedTensorLedger() as ms_ledger:
        MSCrossEntropyLoss(True)(logits, labels, item.classes)
    assert item.predicted_saved_bytes == hf_ledger.bytes - ms_ledger.bytes > 0


@pytest.mark.slow
def test_compiled_converted_model_fullgraph():
    model = _build("llama")
    ref = copy.deepcopy(model)
    _loss_only(model)
    torch._dynamo.reset()
    kw = _inputs(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # a graph break would raise
    loss, logits, grads = _step(model, kw, compiled)
    loss_r, logits_r, grads_r = _step(ref, kw)
    torch.testing.assert_close(logits, logits_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, loss_r, atol=1e-5, rtol=1e-5)
    assert grads.keys() == grads_r.keys()
    for k in grads_r:
        torch.testing.assert_close(grads[k], grads_r[k], atol=1e-5, rtol=1e-4)


def test_autocast_loss_and_gradients_match():
    """fp32 weights under bf16 autocast: the head emits bf16 logits; HF upcasts them, this keeps them."""
    model = _build("llama")
    ref = copy.deepcopy(model)
    _loss_only(model)
    kw = _inputs(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, logits, grads = _step(model, kw)
        loss_r, logits_r, grads_r = _step(ref, kw)
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, logits_r)
    torch.testing.assert_close(loss, loss_r, atol=1e-5, rtol=1e-5)
    for k in grads_r:
        err = float((grads[k].double() - grads_r[k].double()).norm() / grads_r[k].double().norm().clamp_min(1e-30))
        assert err <= 2e-2, (k, err)


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])  # PeftModel (forward(**kwargs)), PeftModelForCausalLM
def test_peft_model_gets_the_loss_on_its_inner_model(task_type):
    """convert() on a PeftModel: the wrapper's forward passes labels to the transformers model inside, whose
    loss_function is the one set (the wrapper has none)."""
    peft = pytest.importorskip("peft")
    base = _build("llama")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                             task_type=task_type))
    ref = copy.deepcopy(model)
    _loss_only(model)
    (item,) = model.lmbp_report.plan.items
    assert item.name == "base_model.model" and isinstance(base.__dict__["_loss_function"], MSCrossEntropyLoss)
    kw = _inputs(base)
    loss, _, grads = _step(model, kw)
    loss_r, _, grads_r = _step(ref, kw)
    torch.testing.assert_close(loss, loss_r, atol=1e-5, rtol=1e-5)
    assert grads.keys() == grads_r.keys() and all("lora_" in k for k in grads)
    for k in grads:
        torch.testing.assert_close(grads[k], grads_r[k], atol=1e-6, rtol=1e-4)


def test_a_users_loss_function_is_kept_and_reported():
    """A user's ``loss_function`` that masks a pad id (HF's causal loss otherwise) is kept: on a half-padded batch
    the converted model's loss is the original's, and the report says which was kept and why."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    pad = 5

    def pad_masking(logits, labels, vocab_size, **kwargs):
        return ForCausalLMLoss(logits, labels.masked_fill(labels == pad, -100), vocab_size, **kwargs)

    model = _build("llama")
    model.loss_function = pad_masking
    ref = copy.deepcopy(model)
    convert(model, activations=False)  # the loss alone: nothing to convert
    assert model.loss_function is pad_masking
    (skip,) = [s for s in model.lmbp_report.plan.skips if s.name == ""]
    assert skip.why.code is ReasonCode.USERS_OWN and skip.reason in str(model.lmbp_report)
    assert "pad_masking" in skip.reason
    kw = _inputs(model)
    kw["input_ids"][:, 6:] = pad
    kw["labels"] = kw["input_ids"].clone()
    loss, _, grads = _step(model, kw)
    loss_r, _, grads_r = _step(ref, kw)
    torch.testing.assert_close(loss, loss_r, atol=1e-6, rtol=1e-6)
    masked = ForCausalLMLoss(ref(**kw).logits, kw["labels"], ref.config.vocab_size)  # the pad id trained on
    assert abs(float(masked - loss_r)) > 1e-3
    for k in grads_r:
        torch.testing.assert_close(grads[k], grads_r[k], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("tied", (False, True))
def test_hooks_on_the_heads_node_see_the_real_gradient(tied):
    """A pre-hook on ``outputs.logits.grad_fn`` that scales the gradient and a hook that reads it: the head takes
    the plain path, the hooks see what the original's see and every gradient is the original's."""
    from lmbp_convert.ops import logits_head

    model = _build("llama_tied" if tied else "llama")
    ref = copy.deepcopy(model)
    _loss_only(model)
    assert model.lmbp_report.plan.items[0].head == "lm_head"
    kw = _inputs(model)
    seen, grads = [], []
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        out = m(**kw)
        node = out.logits.grad_fn
        node.register_prehook(lambda g: (g[0] * 2,))
        node.register_hook(lambda grad_in, grad_out: seen.append(grad_out[0].clone()))
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert torch.equal(seen[1], seen[0]) and bool(seen[0].abs().sum() > 0)
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        err = float((grads[1][k].double() - grads[0][k].double()).norm() / grads[0][k].double().norm())
        assert err <= 1e-6, (k, err)
    # no hook: the fused path again
    taken = []
    real = logits_head._fused_backward
    try:
        logits_head._fused_backward = lambda *a: (taken.append(1), real(*a))[1]
        model(**kw).loss.backward()
    finally:
        logits_head._fused_backward = real
    assert taken == [1]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("options", ("loss_only", "exact_default"))
def test_logits_edited_after_the_forward_raise(options, dtype):
    """``outputs.logits`` edited in place before ``loss.backward()``: the original is unaffected (HF's loss keeps
    its own log-softmax), the memory-sharing loss keeps the logits' storage, so it raises as autograd does for a
    modified saved tensor, naming the logits and the option that keeps a copy, with or without the exact norms'
    saved-tensor hooks (which switch autograd's own check off). Without an edit the gradients are the original's."""
    from lmbp_convert.errors import LogitsModifiedError

    model = _build("llama", dtype)
    ref = copy.deepcopy(model)
    if options == "loss_only":
        _loss_only(model)
    else:
        convert(model, activations=False)
    assert any(isinstance(i, LossSwap) and i.head for i in model.lmbp_report.plan.items)
    kw = _inputs(model)
    for edit in (lambda lg: lg.div_(2.0), lambda lg: lg.zero_()):
        out = model(**kw)
        with torch.no_grad():
            edit(out.logits)
        with pytest.raises(LogitsModifiedError) as err:
            out.loss.backward()
        msg = str(err.value)
        assert msg.startswith("one of the variables needed for gradient computation has been modified by an "
                              "inplace operation")
        assert f"[24, {model.config.vocab_size}]" in msg and "memory-sharing loss" in msg and "loss=False" in msg
    loss, _, grads = _step(model, kw)
    loss_r, _, grads_r = _step(ref, kw)
    torch.testing.assert_close(loss, loss_r, atol=1e-5, rtol=1e-5)
    for k in grads_r:
        g, g_r = grads[k].double(), grads_r[k].double()
        assert float((g - g_r).norm() / g_r.norm().clamp_min(1e-30)) <= (1e-4 if dtype == torch.float32 else 2e-2), k


def test_a_plan_made_before_the_user_set_a_loss_or_a_head_forward_is_refused():
    """The builder checks again: a loss_function or a head forward set on the instance after planning is the
    user's, and the plan's swap is refused before anything changes."""
    from lmbp_convert.errors import ConversionError

    model = _build("llama")
    (item,) = plan_conversion(model, activations=False, norms=False, gated_mlp=False).items
    default = model.loss_function
    model.loss_function = lambda *args, **kwargs: default(*args, **kwargs)
    with pytest.raises(ConversionError, match="set on the instance"):
        item.build_unit(UnitBuilder(model))
    del model._loss_function
    model.lm_head.forward = model.lm_head.forward  # an instance attribute now (a wrapper's place)
    with pytest.raises(ConversionError, match="set on the instance"):
        item.build_unit(UnitBuilder(model))
    assert type(model.lm_head) is torch.nn.Linear and "_loss_function" not in vars(model)
