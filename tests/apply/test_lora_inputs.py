"""LoRA adapters share their layer's input (issue 19 item 1): exact bytes, bitwise gradients, PEFT's own paths
(merge, adapter save/load, state-dict keys) unchanged, and exact training with the exact norms."""
import copy

import pytest
import torch

from lmbp_convert import SavedTensorLedger, convert
from lmbp_convert.match.lora_inputs import LoraInputShare
from lmbp_convert.nn.dropout import BitDropout

peft = pytest.importorskip("peft")

D, FFN, T, B = 64, 176, 16, 2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _llama(dtype=torch.float32, layers=2, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=D, intermediate_size=FFN, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                               tie_word_embeddings=False)
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg).to(dtype)
    with torch.no_grad():
        for mod in m.modules():
            if "RMSNorm" in type(mod).__name__:
                mod.weight.uniform_(0.5, 1.5)
    return m


def _lora(m, dropout=0.0):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False,
                          target_modules=TARGETS, task_type="CAUSAL_LM")
    torch.manual_seed(1)
    m = peft.get_peft_model(m, cfg).train()
    # the embeddings are frozen: without this the first layer's tensors have no autograd history, and its
    # adapters keep PEFT's copies (gradient checkpointing turns it on; the README says so)
    m.enable_input_require_grads()
    return m


def _ids(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (B, T), generator=g)


def _step(m, ids, seed):
    torch.manual_seed(seed)
    out = m(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    return out.loss.detach(), grads


def _saved(m, ids):
    with SavedTensorLedger(m) as led:
        out = m(input_ids=ids, labels=ids)
    del out
    return led.bytes


ONLY_LORA = dict(activations=False, norms=False, gated_mlp=False, loss=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_gradients_are_bitwise_peft_s(dtype, dropout):
    m = _lora(_llama(dtype), dropout)
    ref = copy.deepcopy(m)
    if dtype == torch.float32 and dropout == 0.0:
        with pytest.raises(Exception, match="nothing to convert"):  # fp32 adapters on fp32 inputs: no copy
            convert(m, **ONLY_LORA)
        return
    convert(m, **ONLY_LORA)
    items = [i for i in m.lmbp_report.plan.items if isinstance(i, LoraInputShare)]
    assert len(items) == 2 * len(TARGETS)
    ids = _ids()
    (l0, g0), (l1, g1) = _step(ref, ids, 7), _step(m, ids, 7)
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys() and len(g0) == 2 * 2 * len(TARGETS)
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


def test_bf16_block_keeps_no_fp32_copy_of_its_inputs():
    """Per layer the converted model drops the fp32 copies of q, k, v, gate, up (their input, the norm's output,
    is kept by the norm) and o_proj (its bf16 input is the attention's kept output); down's adapters run inside
    the fused MLP, which keeps no copy (the note on down is skipped there, not a reason to leave the fused path)."""
    ids = _ids()
    m = _lora(_llama(torch.bfloat16))
    plain = copy.deepcopy(m)
    # folded norms: the exact default already rebuilds the casts of the norms' outputs without the LoRA notes
    convert(plain, lora_inputs=False, fold_norms=True)
    convert(m, fold_norms=True)
    rows = B * T
    assert _saved(plain, ids) - _saved(m, ids) == 2 * 6 * rows * D * 4


def test_bf16_dropout_keeps_bits_instead_of_noise_and_copies():
    ids = _ids()
    m = _lora(_llama(torch.bfloat16), dropout=0.05)
    plain = copy.deepcopy(m)
    convert(plain, lora_inputs=False, fold_norms=True)
    convert(m, fold_norms=True)
    assert sum(isinstance(x, BitDropout) for x in m.modules()) == 2 * len(TARGETS)
    rows = B * T
    # per adapter: the fp32 noise (CPU dropout's mask) and the fp32 dropped copy → 1 bit an element; down (FFN
    # wide, called through the gated MLP's recompute path) likewise, its input h still recomputed from g and u
    per_layer = 6 * (2 * rows * D * 4 - rows * D // 8) + 2 * rows * FFN * 4 - rows * FFN // 8
    assert _saved(plain, ids) - _saved(m, ids) == 2 * per_layer


def test_peft_state_merge_and_adapter_files_are_untouched(tmp_path):
    m = _lora(_llama(torch.bfloat16), dropout=0.1)
    ref = copy.deepcopy(m)
    convert(m, fold_norms=False)
    assert list(m.state_dict()) == list(ref.state_dict())
    m.save_pretrained(tmp_path / "conv")
    ref.save_pretrained(tmp_path / "ref")
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "conv" / "adapter_model.safetensors"), load_file(
        tmp_path / "ref" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = _ids(3)
    m.eval()
    ref.eval()
    with torch.no_grad():
        want = ref.merge_and_unload()(input_ids=ids).logits
        got = m.merge_and_unload()(input_ids=ids).logits
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def _train(m, steps, lr=1e-3):
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr)
    losses = []
    for s in range(steps):
        ids = _ids(100 + s)
        torch.manual_seed(s)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_converting_after_get_peft_model_trains_like_the_original(dropout):
    """Issue 19's criterion: 20 steps, norm weights ≠ 1, fp32, max |Δloss| ≤ 1e-5 (exact norms, exact MLP)."""
    m = _lora(_llama(torch.float32), dropout)
    ref = copy.deepcopy(m)
    convert(m, activations=False, fold_norms=False)
    a, b = _train(ref, 20), _train(m, 20)
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)


@pytest.mark.slow
def test_convert_again_after_get_peft_model_adopts_the_new_adapters():
    base = _llama(torch.bfloat16)
    ref = _lora(copy.deepcopy(base))
    convert(base, activations=False, fold_norms=False)
    m = _lora(base)
    assert not any(isinstance(i, LoraInputShare) for i in m.get_base_model().lmbp_report.plan.items)
    convert(m, activations=False, fold_norms=False)
    assert sum(isinstance(i, LoraInputShare) for i in m.lmbp_report.plan.items) == 2 * len(TARGETS)
    ids = _ids()
    (l0, g0), (l1, g1) = _step(ref, ids, 3), _step(m, ids, 3)
    assert torch.allclose(l0, l1, atol=1e-2)
    assert g0.keys() == g1.keys()
    for n in g0:  # bf16: the norm's x̂ is rounded once more than in the original
        assert (g0[n].float() - g1[n].float()).norm() <= 5e-2 * g0[n].float().norm(), n
    assert _saved(m, ids) < _saved(ref, ids)


@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_lora_over_a_quantized_base_shares_its_input_too(dropout):
    """QLoRA: the 4-bit stand-in (an nn.Linear subclass with packed frozen weights) under PEFT's LoRA Linear."""
    from testsupport.quant_standin import quantize_linears

    ids = _ids()
    m = _lora(quantize_linears(_llama(torch.bfloat16), tuple(TARGETS)), dropout)
    ref = copy.deepcopy(m)
    plain = copy.deepcopy(m)
    convert(plain, lora_inputs=False, fold_norms=True)
    convert(m, fold_norms=True)
    assert sum(isinstance(i, LoraInputShare) for i in m.lmbp_report.plan.items) == 2 * len(TARGETS)
    rows = B * T
    drop_saved = 6 * (2 * rows * D * 4 - rows * D // 8) + 2 * rows * FFN * 4 - rows * FFN // 8
    # the norms before quantized projections are left as they are (their fold is refused; `lmbp-convert` folds
    # them on disk): their bf16 outputs are now kept instead of the adapters' fp32 copies of them
    norms_out = 2 * rows * D * 2
    assert _saved(plain, ids) - _saved(m, ids) == 2 * ((drop_saved if dropout else 6 * rows * D * 4) - norms_out)
    (l0, g0), (l1, g1) = _step(ref, ids, 4), _step(m, ids, 4)
    assert torch.allclose(l0, l1, atol=1e-2) and g0.keys() == g1.keys()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_dora_adapters_share_their_input_bitwise(dropout):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, use_dora=True, init_lora_weights=False,
                          target_modules=["q_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    torch.manual_seed(1)
    m = peft.get_peft_model(_llama(torch.bfloat16), cfg).train()
    m.enable_input_require_grads()
    ref = copy.deepcopy(m)
    convert(m, **ONLY_LORA)
    ids = _ids()
    assert _saved(m, ids) < _saved(ref, ids)
    (l0, g0), (l1, g1) = _step(ref, ids, 9), _step(m, ids, 9)
    assert torch.equal(l0, l1) and g0.keys() == g1.keys()
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


# -- several adapters on one layer (issue 38) -----------------------------------------------------------------------
# adapter → (rank, lora_dropout, DoRA): ranks and dropouts differ, the first one drops, one does not, one is DoRA
ADAPTERS = {"drop": (4, 0.1, False), "plain": (2, 0.0, False), "dora": (3, 0.05, True)}
MULTI_TARGETS = ["q_proj", "v_proj", "down_proj"]


def _multi(active, names=tuple(ADAPTERS), layers=1):
    """bf16 LLaMA with the adapters ``names`` added in that order (get_peft_model, then add_adapter), ``active``
    set active together (PEFT makes the others frozen)."""
    def cfg(name):
        r, p, dora = ADAPTERS[name]
        return peft.LoraConfig(r=r, lora_alpha=8, lora_dropout=p, use_dora=dora, init_lora_weights=False,
                               target_modules=MULTI_TARGETS)

    torch.manual_seed(1)
    m = peft.get_peft_model(_llama(torch.bfloat16, layers=layers), cfg(names[0]), adapter_name=names[0])
    for name in names[1:]:
        m.add_adapter(name, cfg(name))
    m.base_model.set_adapter(active)
    m.train()
    m.enable_input_require_grads()
    return m


def _assert_same_step(ref, m, seed, n_grads):
    ids = _ids(seed)
    (l0, g0), (l1, g1) = _step(ref, ids, seed), _step(m, ids, seed)
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys() and len(g0) == n_grads
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


def _lora_grads(names, layers=1):
    """Trainable tensors of the adapters ``names``: A and B per target, DoRA's magnitude too."""
    names = [names] if isinstance(names, str) else names
    return layers * len(MULTI_TARGETS) * sum(3 if ADAPTERS[n][2] else 2 for n in names)


def test_several_active_adapters_share_the_input_each_with_its_own_dropout():
    """Adapters drop (r 4, dropout 0.1), plain (r 2, none) and dora (r 3, 0.05, DoRA) active together on every
    target: the plan lists all three, the dropping ones as bit-mask dropouts with their own p, plain's Identity
    stays; the loss and every gradient are bitwise PEFT's (each adapter's own draws, in PEFT's order)."""
    m = _multi(list(ADAPTERS))
    ref = copy.deepcopy(m)
    convert(m, **ONLY_LORA)
    items = [i for i in m.lmbp_report.plan.items if isinstance(i, LoraInputShare)]
    assert sorted(i.name.rsplit(".", 1)[-1] for i in items) == sorted(MULTI_TARGETS)
    for item in items:
        assert (item.adapters, item.dropouts) == (["drop", "plain", "dora"], ["drop", "dora"]), item
        drops = m.get_submodule(item.name).lora_dropout
        assert [type(d) for d in drops.values()] == [BitDropout, torch.nn.Identity, BitDropout]
        assert (drops["drop"].p, drops["dora"].p) == (0.1, 0.05)
    _assert_same_step(ref, m, 7, _lora_grads(list(ADAPTERS)))


def test_several_adapters_keep_one_input_and_a_bit_mask_each():
    """drop (dropout 0.1) and plain (none) active on q, v (which read one norm output) and down: per layer and
    target, PEFT keeps drop's fp32 noise and dropped copy and plain's fp32 copy; converted, drop's 1-bit mask and
    the layer's bf16 input (one storage for q and v)."""
    m = _multi(["drop", "plain"], names=("drop", "plain"), layers=2)
    ref = copy.deepcopy(m)
    convert(m, **ONLY_LORA)
    ids = _ids()
    rows = B * T
    qv, down = rows * D, rows * FFN  # the inputs' elements

    def layer(n):
        return 3 * n * 4 - (n // 8)  # two fp32 copies and the noise → a bit mask

    per_layer = 2 * layer(qv) - qv * 2 + layer(down) - down * 2
    assert _saved(ref, ids) - _saved(m, ids) == 2 * per_layer
    _assert_same_step(ref, m, 3, _lora_grads(["drop", "plain"], layers=2))


def test_switching_the_active_adapters_after_convert_stays_bitwise():
    """convert() with all three active, then each switch of the active set (one, two, a single name, all in another
    order) in the converted model and in PEFT's: the same loss and gradients, the idle adapters' bit-mask dropouts
    unused."""
    m = _multi(list(ADAPTERS))
    ref = copy.deepcopy(m)
    convert(m, **ONLY_LORA)
    for active in (["plain"], ["drop", "dora"], "dora", ["dora", "drop", "plain"]):
        for model in (m, ref):
            model.base_model.set_adapter(active)
        _assert_same_step(ref, m, 11, _lora_grads(active))


def test_adapters_activated_after_convert_run_as_peft_s():
    """convert() with only drop active: plain and dora are frozen, so the plan leaves them alone (dora keeps its
    nn.Dropout); activated afterwards, they run as PEFT's do, bitwise."""
    m = _multi("drop")
    ref = copy.deepcopy(m)
    convert(m, **ONLY_LORA)
    items = [i for i in m.lmbp_report.plan.items if isinstance(i, LoraInputShare)]
    assert len(items) == len(MULTI_TARGETS) and all((i.adapters, i.dropouts) == (["drop"], ["drop"]) for i in items)
    drops = m.get_submodule(items[0].name).lora_dropout
    assert [type(d) for d in drops.values()] == [BitDropout, torch.nn.Identity, torch.nn.Dropout]
    _assert_same_step(ref, m, 5, _lora_grads("drop"))
    for model in (m, ref):
        model.base_model.set_adapter(list(ADAPTERS))
    _assert_same_step(ref, m, 6, _lora_grads(list(ADAPTERS)))


def test_an_adapter_in_the_input_dtype_is_left_out_beside_the_others():
    """plain's weights cast to the layers' bf16 (no up-cast copy, no dropout: nothing of its own to share) between
    drop and dora: the plan lists those two only, each with its own dropout; bitwise PEFT's."""
    m = _multi(list(ADAPTERS))
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.ModuleDict) and "plain" in mod and name.rsplit(".", 1)[-1] in ("lora_A", "lora_B"):
            mod["plain"].to(torch.bfloat16)
    ref = copy.deepcopy(m)
    convert(m, **ONLY_LORA)
    items = [i for i in m.lmbp_report.plan.items if isinstance(i, LoraInputShare)]
    assert len(items) == len(MULTI_TARGETS)
    assert all((i.adapters, i.dropouts) == (["drop", "dora"], ["drop", "dora"]) for i in items), items
    _assert_same_step(ref, m, 8, _lora_grads(list(ADAPTERS)))
