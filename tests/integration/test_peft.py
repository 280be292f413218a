"""PEFT LoRA and conversion, in both orders.

The exact default (`MSExactNorm`) leaves every weight, adapters included, as it is; folding (``fold_norms=True``):
* convert(model) then get_peft_model: LoRA wraps the already-folded Linears.
* get_peft_model then convert(peft_model): γ goes into the base weight *and* every adapter's lora_A
  (A(γ·x̂) = (A·diag(γ))·x̂); β goes into the base bias only, which is exact while no adapter can see it.
In both, the adapter's saved input is the norm's output storage (one storage, not two; exact: rebuilt from x̂, the
same bytes), and adapters trained on a converted model save and load onto a converted base.
"""
import copy

import pytest
import torch

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from lmbp_convert import SavedTensorLedger, convert  # noqa: E402
from lmbp_convert.export import ExportError, plain_state_dict  # noqa: E402
from lmbp_convert.match.norm_exact import NormExact  # noqa: E402
from lmbp_convert.nn.exact_norms import MSExactNorm  # noqa: E402
from lmbp_convert.nn.norms import MSLayerNorm, MSRMSNorm  # noqa: E402
from testsupport.families import hf  # noqa: E402

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]  # exactly the norm-fed Linears
BERT_TARGETS = ["query", "key", "value", "intermediate.dense"]
B, T, R = 2, 16, 4


def _ids(vocab=128, seed=1):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _lora(targets, dropout=0.0):
    return LoraConfig(r=R, lora_alpha=8, target_modules=targets, lora_dropout=dropout)


def _randomize_lora_b(model, seed=3):
    """A trained adapter (B ≠ 0), so that a wrong fold into lora_A shows in the outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _train(model, ids, steps=3, lr=1e-2):
    """A few AdamW steps on the trainable parameters (LM loss for causal LMs, class 0 for classifiers)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    causal = "CausalLM" in type(model.get_base_model()).__name__
    labels = ids if causal else torch.zeros(ids.shape[0], dtype=torch.long)
    losses = []
    model.train()
    for _ in range(steps):
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    model.eval()
    return losses


def _lora_folded_targets(report):
    return [t for f in report.plan.norm_folds for t in f.targets if getattr(t, "base", None)]


# -- function ---------------------------------------------------------------------------------------------

def test_convert_after_get_peft_model_keeps_function_with_trained_adapters():
    """RMSNorm (no β): γ folds into the base weight and into lora_A of adapters that are already trained."""
    base = hf("llama")
    pm = get_peft_model(base, _lora(LLAMA_TARGETS))
    _randomize_lora_b(pm)
    ids = _ids()
    ref = _logits(pm, ids)
    q = pm.base_model.model.model.layers[0].self_attn.q_proj
    a_before = q.lora_A["default"].weight.detach().clone()
    w_before = q.base_layer.weight.detach().clone()
    gamma = pm.base_model.model.model.layers[0].input_layernorm.weight.detach().clone()
    exact = copy.deepcopy(pm)

    report = convert(pm, fold_norms=True).lmbp_report
    assert report.verified, str(report)
    folded = _lora_folded_targets(report)
    assert len(folded) == 2 * len(LLAMA_TARGETS), str(report)  # every adapter-wrapped Linear took the fold
    assert _rel(_logits(pm, ids), ref) < 1e-5
    # both sides of the adapter account for γ
    torch.testing.assert_close(q.lora_A["default"].weight, a_before * gamma, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(q.base_layer.weight, w_before * gamma, rtol=1e-6, atol=1e-7)
    assert isinstance(pm.base_model.model.model.layers[0].input_layernorm, MSRMSNorm)
    # the exact default: the same function, every weight (base and adapter) and γ the original ones
    before = {n: p.detach().clone() for n, p in exact.named_parameters()}
    report = convert(exact).lmbp_report
    assert report.verified and len(report.plan.of(NormExact)) == 5 and not report.plan.norm_folds, str(report)
    assert _rel(_logits(exact, ids), ref) < 1e-5
    assert all(torch.equal(p, before[n]) for n, p in exact.named_parameters()) and len(before) == len(
        dict(exact.named_parameters()))
    assert isinstance(exact.base_model.model.model.layers[0].input_layernorm, MSExactNorm)


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_convert_after_get_peft_model_folds_beta_into_base_only():
    """LayerNorm with β and fresh adapters (B = 0, dropout 0): β goes to the base bias, γ to base and lora_A;
    the adapters then train."""
    base = hf("bert", head="cls", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    pm = get_peft_model(base, _lora(BERT_TARGETS))
    ids = _ids()
    ref_pm = copy.deepcopy(pm)
    report = convert(pm, fold_norms=True).lmbp_report
    assert report.verified, str(report)
    assert _lora_folded_targets(report), str(report)
    assert _rel(_logits(pm, ids), _logits(ref_pm, ids)) < 1e-5
    # each folded adapter's A is the original's times γ (β, which the adapter never sees while B = 0, is
    # in the base bias only)
    mods = dict(pm.named_modules())
    ref_mods = dict(ref_pm.named_modules())
    for f in report.plan.norm_folds:
        g = ref_mods[f.name].weight.detach()
        for t in f.targets:
            if getattr(t, "base", None):
                torch.testing.assert_close(mods[t.name].lora_A["default"].weight,
                                           ref_mods[t.name].lora_A["default"].weight * g, rtol=1e-6, atol=1e-7)
    losses = _train(pm, ids)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_convert_after_get_peft_model_blocks_beta_with_lora_dropout():
    """A fold cannot put β into an adapter with dropout; exact norms (the default) leave the adapter alone."""
    base = hf("bert", head="cls", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    pm = get_peft_model(base, _lora(BERT_TARGETS, dropout=0.1))
    exact = copy.deepcopy(pm)
    ids = _ids()
    ref = _logits(pm.eval(), ids)
    report = convert(pm, fold_norms=True).lmbp_report
    assert not _lora_folded_targets(report), str(report)
    reasons = " ".join(s.reason for s in report.plan.skips)
    assert "lora_dropout" in reasons, str(report)
    assert _rel(_logits(pm, ids), ref) < 1e-5
    report = convert(exact).lmbp_report
    assert len(report.plan.of(NormExact)) == 5 and "lora_dropout" not in str(report), str(report)
    assert _rel(_logits(exact, ids), ref) < 1e-5


def test_convert_before_get_peft_model_trains_and_keeps_function():
    base = hf("llama")
    ids = _ids()
    plain = copy.deepcopy(base)
    convert(base)
    pm = get_peft_model(base, _lora(LLAMA_TARGETS))
    assert _rel(_logits(pm, ids), _logits(plain, ids)) < 1e-5  # B = 0: the base function
    trainable = {n: p.detach().clone() for n, p in pm.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    losses = _train(pm, ids)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    changed = [n for n, p in pm.named_parameters() if p.requires_grad and not torch.equal(p, trainable[n])]
    assert len(changed) == len(trainable)


def _converted_peft(base, targets, order, fold=False):
    """LoRA-wrap and convert ``base`` in the given order ("convert_then_peft" or "peft_then_convert")."""
    if order == "convert_then_peft":
        convert(base, fold_norms=fold)
        return get_peft_model(base, _lora(targets))
    pm = get_peft_model(base, _lora(targets))
    convert(pm, fold_norms=fold)
    return pm


# -- sharing ----------------------------------------------------------------------------------------------

class _PtrLedger(SavedTensorLedger):
    """SavedTensorLedger that also remembers every saved storage pointer (not only the first save)."""

    def __post_init__(self):
        super().__post_init__()
        self.saved_ptrs: set[int] = set()

    def _pack(self, t):
        if t.device.type != "meta":
            self.saved_ptrs.add(t.untyped_storage().data_ptr())
        return super()._pack(t)


def _saved_bytes_and_sharing(pm, ids):
    """Ledger with adapters, saved bytes with adapters disabled (input grads on in both, so the rest of the
    graph is the same), norm output and lora_A input storage pointers."""
    norm_out, handles = {}, []
    for name, mod in pm.named_modules():
        if isinstance(mod, (MSRMSNorm, MSLayerNorm, MSExactNorm)):
            handles.append(mod.register_forward_hook(
                lambda m, a, o, n=name: norm_out.__setitem__(n, o.untyped_storage().data_ptr())))
    lora_in = {}
    for name, mod in pm.named_modules():
        if name.endswith("lora_A.default"):
            handles.append(mod.register_forward_pre_hook(
                lambda m, a, n=name: lora_in.__setitem__(n, a[0].untyped_storage().data_ptr())))
    pm.get_base_model().enable_input_require_grads()  # same graph with adapters off: input grads flow
    pm.train()
    with _PtrLedger(pm) as led:
        loss = pm(input_ids=ids).logits.float().pow(2).mean()
    loss.backward()
    for h in handles:
        h.remove()
    with pm.disable_adapter(), SavedTensorLedger(pm) as off:
        pm(input_ids=ids).logits.float().pow(2).mean()
    pm.zero_grad(set_to_none=True)
    return led, off.bytes, norm_out, lora_in


@pytest.mark.parametrize("fold", [False, True], ids=["exact", "fold"])
@pytest.mark.parametrize("order", ["convert_then_peft", "peft_then_convert"])
def test_adapter_input_is_the_norm_output_storage(order, fold):
    base = hf("llama")
    pm = _converted_peft(base, LLAMA_TARGETS, order, fold)
    ids = _ids()
    led, off_bytes, norm_out, lora_in = _saved_bytes_and_sharing(pm, ids)
    # every adapter reads a norm's output; folded, that very storage is what autograd keeps (x̂); exact, it is
    # y, which nobody keeps (its consumers' saves are rebuilt from x̂: the byte count below says so; a pointer
    # test cannot, the allocator reuses y's freed memory)
    norm_ptrs = set(norm_out.values())
    n_adapters = len(lora_in)
    assert n_adapters == 2 * len(LLAMA_TARGETS)
    assert set(lora_in.values()) <= norm_ptrs
    if fold:
        assert set(lora_in.values()) <= led.saved_ptrs
    # Bytes: the adapters add exactly their r-wide lora_B inputs (fp32), nothing for lora_A's input, which is
    # the storage the MS norm saves anyway. A copy of x̂ per adapter-fed norm would add B·T·D·4 each.
    expected_extra = n_adapters * B * T * R * 4
    assert led.bytes - off_bytes == expected_extra, led.summary()


def test_unconverted_adapters_cost_a_copy_per_norm():
    """Control for the figure above: without conversion the same adapters keep the norm output extra."""
    pm = get_peft_model(hf("llama"), _lora(LLAMA_TARGETS))
    ids = _ids()
    pm.get_base_model().enable_input_require_grads()
    pm.train()
    with SavedTensorLedger(pm) as on:
        pm(input_ids=ids).logits.float().pow(2).mean()
    with pm.disable_adapter(), SavedTensorLedger(pm) as off:
        pm(input_ids=ids).logits.float().pow(2).mean()
    n_norms, n_adapters, d = 4, 2 * len(LLAMA_TARGETS), 64
    assert on.bytes - off.bytes == n_adapters * B * T * R * 4 + n_norms * B * T * d * 4


# -- adapters save / load ---------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["convert_then_peft", "peft_then_convert"])
def test_adapters_save_and_load_onto_a_converted_base(order, tmp_path):
    """Adapters trained on a converted model belong to a converted base (they read x̂): reload = build the base,
    convert() it, PeftModel.from_pretrained."""
    base = hf("llama")
    pm = _converted_peft(base, LLAMA_TARGETS, order)
    ids = _ids()
    _train(pm, ids)
    want = _logits(pm, ids)
    pm.save_pretrained(tmp_path)
    saved = list(tmp_path.glob("adapter_model.*"))
    assert saved, list(tmp_path.iterdir())

    fresh = convert(hf("llama"))
    loaded = PeftModel.from_pretrained(fresh, tmp_path).eval()
    assert _rel(_logits(loaded, ids), want) < 1e-6
    loaded_a = dict(loaded.named_parameters())
    for n, p in pm.named_parameters():
        if "lora_" in n:
            torch.testing.assert_close(loaded_a[n], p)


@pytest.mark.parametrize("fold", [False, True], ids=["exact", "fold"])
@pytest.mark.parametrize("order", ["convert_then_peft", "peft_then_convert"])
@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_merged_adapters_export_to_a_plain_checkpoint(order, fold):
    """merge_and_unload() + plain_state_dict: a plain model (no lmbp_convert, no PEFT) computes the same."""
    base = hf("bert", head="cls", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    plain = copy.deepcopy(base)
    pm = _converted_peft(base, BERT_TARGETS, order, fold)
    ids = _ids()
    _train(pm, ids)
    want = _logits(pm, ids)
    if order == "peft_then_convert" and fold:
        with pytest.raises(ExportError, match="merge"):
            plain_state_dict(pm)  # LoRA-wrapped folded Linears: merge first
    report = pm.lmbp_report if hasattr(pm, "lmbp_report") else None
    merged = pm.merge_and_unload()
    sd = plain_state_dict(merged, report=report)
    assert set(sd) == set(plain.state_dict())
    plain.load_state_dict(sd)
    assert _rel(_logits(plain.eval(), ids), want) < 1e-5


@pytest.mark.parametrize("variant", ["dora", "lora_dropout"])
def test_gated_mlps_with_dora_or_lora_dropout_convert_and_match(variant):
    """DoRA or lora_dropout > 0 on the MLP projections: the gated MLPs convert (the down projection runs unchanged,
    h recomputed for its backward) and a training step gives the unconverted model's loss and gradients."""
    cfg = LoraConfig(r=R, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"],
                     use_dora=variant == "dora", lora_dropout=0.2 if variant == "lora_dropout" else 0.0)
    pm = get_peft_model(hf("llama"), cfg)
    _randomize_lora_b(pm)
    ref = copy.deepcopy(pm)
    report = convert(pm, activations=False, norms=False).lmbp_report
    assert len(report.plan.gated_mlps) == pm.config.num_hidden_layers
    ids = _ids()
    grads = []
    for model in (ref, pm):
        model.train()
        torch.manual_seed(7)  # the same dropout masks: both forwards draw them in the same order
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (l_ref, g_ref), (l_ours, g_ours) = grads
    torch.testing.assert_close(l_ours, l_ref, rtol=1e-5, atol=1e-6)
    assert g_ours.keys() == g_ref.keys()
    for n in g_ref:
        torch.testing.assert_close(g_ours[n], g_ref[n], rtol=1e-4, atol=1e-6, msg=n)


#: a fold with hooks on LoRA layers (Falcon with GPT-J's parallel block: one LayerNorm with β feeds the bias-less
#: qkv, a LoRA layer whose input gets the affine re-applied, and the MLP, which takes the fold; BERT: post-LN) and a
#: head in ``modules_to_save`` that a norm folds into
MODULES_TO_SAVE = {"falcon": (["query_key_value"], ["lm_head"]), "bert": (BERT_TARGETS, ["pooler.dense"])}


def _two_adapters(name):
    targets, saved = MODULES_TO_SAVE[name]
    base = hf(name, head="cls") if name == "bert" else hf(name, new_decoder_architecture=False, parallel_attn=True,
                                                          bias=False)
    torch.manual_seed(0)
    pm = get_peft_model(base.eval(), LoraConfig(r=R, target_modules=targets, modules_to_save=saved,
                                                init_lora_weights=False))
    pm.add_adapter("second", LoraConfig(r=2, target_modules=targets, modules_to_save=saved, init_lora_weights=False))
    with torch.no_grad():  # every copy of the saved module trained apart from the original
        for n, p in pm.named_parameters():
            if "modules_to_save" in n:
                p.add_(0.1 * torch.randn_like(p))
    return pm.eval(), copy.deepcopy(pm).eval()


@pytest.mark.parametrize("name", sorted(MODULES_TO_SAVE))
def test_folded_modules_to_save_every_copy_and_disabled_adapters(name):
    """A fold into a head PEFT keeps in ``modules_to_save`` goes into every copy, ``original_module`` included,
    which only ``disable_adapter()`` runs (before: 0.69 off there on BERT, 0.54 on Falcon)."""
    pm, ref = _two_adapters(name)
    convert(pm, fold_norms=True, activations=False)
    ids = _ids()
    assert _rel(_logits(pm, ids), _logits(ref, ids)) < 1e-5
    with pm.disable_adapter(), ref.disable_adapter():
        assert _rel(_logits(pm, ids), _logits(ref, ids)) < 1e-5
    pm.set_adapter("second")
    ref.set_adapter("second")
    assert _rel(_logits(pm, ids), _logits(ref, ids)) < 1e-5


@pytest.mark.parametrize("name", sorted(MODULES_TO_SAVE))
def test_folded_model_merged_computes_as_before(name):
    """merge_and_unload() replaces each LoRA layer by its merged Linear and returns the inner model: the fold's
    hooks on those layers move to the merged ones at its calls (before: Falcon 0.78 off)."""
    pm, ref = _two_adapters(name)
    convert(pm, fold_norms=True, activations=False)
    ids = _ids()
    want = _logits(ref, ids)
    merged = pm.merge_and_unload()
    assert _rel(_logits(merged, ids), want) < 1e-5
