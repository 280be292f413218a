"""Every rewrite kind paired with what a training run puts beside it (issue 38).

Each rewrite kind is tested alone elsewhere; bugs that show only where two things meet (one noted tensor read
through two op chains, one LoRA layer with several active adapters) passed the suite. This module builds the pairs
no other test builds: each kind, converted alone on a tiny model, beside LoRA adapters that drop, gradient
checkpointing (reentrant and non-reentrant, enabled before convert(), so the conversion traces and verifies
checkpointed layers), bf16 autocast, torch.compile, and a second reader of the tensor the rewrite stops keeping.
Against the unconverted model under the same partner: bitwise loss and gradients where the rewrite is exact
(squared ReLU, exact norms in fp32, gated MLPs and recompute regions, LoRA inputs, the loss head's gradient);
approximate backprop against the step reference (tests/approx_reference.py); folds through the
reparameterisation they make (dL/dW = dL/dW'·diag(γ) for W' = W·diag(γ)); under autocast up to bf16 rounding.

Which test covers which pair (docs/architecture.md, "Pairs", has the same table):

    kind                    LoRA dropout  ckpt reentrant  ckpt non-reentrant  bf16 autocast  compile  second reader
    approx-BP activations   P             P               GT                  P              CA       RA
    squared ReLU            P             P               P                   P              CR       RR
    exact norms             LE            GH              GH                  P              CN       RE
    norms, fold_norms=True  P             P               P                   P              CF       RF
    gated MLP               LG            GH              GH                  P              CG       RG
    MoE recompute region    P (1)         P               GM                  P              CM       RM
    LoRA inputs             LL (2)        P               P                   P (3)          CL       RL
    MS loss / logits head   P (4)         P               P                   AL             CS       RS

P     this module's test_pair[<kind>-<partner>] (kinds act relu2 exact fold gated moe lora loss; partners
      lora_dropout gc_reentrant gc_nonreentrant autocast)
(1)   LoRA with dropout on the router and attention Linears; on the 3-D experts the pair cannot occur: PEFT's
      target_parameters LoRA (ParamWrapper) refuses lora_dropout != 0
(2)   the kind itself: tests/apply/test_lora_inputs.py::test_lora_gradients_are_bitwise_peft_s (dropout 0.1); several
      adapters on one layer: test_several_active_adapters_share_the_input_each_with_its_own_dropout and after it
(3)   a bf16 model (lora-autocast) and an fp32 one whose adapters drop (lora-autocast_fp32)
(4)   also with LoRA on the head itself (loss-lora_dropout_head)
GT    test_grad_checkpointing.py::test_timm_set_grad_checkpointing (timm's default: non-reentrant; act swaps asserted)
GH    test_grad_checkpointing.py::test_hf_gradient_checkpointing (LLaMA, both variants; exact norms, gated MLPs)
GM    tests/apply/test_convert_moe_params.py::test_region_under_activation_checkpointing_gives_the_original_gradients
LE    tests/apply/test_convert_exact_gradients.py::test_exact_norms_under_trained_adapters_with_dropout
LG    test_peft.py::test_gated_mlps_with_dora_or_lora_dropout_convert_and_match[lora_dropout]
AL    tests/apply/test_convert_loss.py::test_autocast_loss_and_gradients_match
CA    test_compile.py::test_compiled_converted_model_trains_and_matches_eager, ..._keeps_its_savings (GPT-2's GELU)
CR    this module's test_squared_relu_compiles_in_one_graph_with_the_original_gradients
CN    test_compile.py: the runs[exact] tests, test_fullgraph_aot_eager_matches_eager_for_each_kind
CF    test_compile.py: the runs[fold] tests, test_compiled_gated_mlp_keeps_only_gate_and_up[fold]
CG    test_compile.py::test_compiled_gated_mlp_keeps_only_gate_and_up, test_fullgraph_train_step_matches_eager[llama]
CM    test_compile.py::test_fullgraph_aot_eager_matches_eager_for_each_kind[mixtral]
CL    test_compile.py::test_fullgraph_lora_input_sharing_and_exact_norms_match_eager
CS    tests/apply/test_convert_loss.py::test_compiled_converted_model_fullgraph
RA RR this module's test_second_reader_of_an_activation_output[approx-*] / [relu2-*] (a Linear; a product with a
      parameter)
RE    this module's test_an_exact_norm_output_read_by_an_adapter_and_a_trainable_layer (y as it is and y.to(bf16));
      tests/ops/test_shared_saves.py::test_one_noted_tensor_read_through_different_chains
RF    tests/match/test_norm_kept.py::test_gradients_exact_and_parameters_kept (a residual add reads y: the fold is
      refused, the norm keeps its affine: NormKeep)
RG    this module's test_second_reader_of_the_gated_product (not fused: a recompute region serves both readers)
RM    this module's test_second_reader_of_an_expert_product
RL    tests/apply/test_lora_inputs.py::test_bf16_block_keeps_no_fp32_copy_of_its_inputs (q, k, v read one input),
      test_several_adapters_keep_one_input_and_a_bit_mask_each
RS    tests/ops/test_logits_head.py::test_another_consumer_of_the_logits_adds_its_gradient; this module's
      test_a_second_reader_of_the_logits
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from approx_reference import with_step_backward
from lmbp_convert import convert
from lmbp_convert.match.lora_inputs import LoraInputShare
from lmbp_convert.match.loss import LossSwap
from lmbp_convert.match.moe import RecomputeRegion
from lmbp_convert.match.norm_exact import NormExact
from lmbp_convert.match.plan import OutputActSwap
from testsupport.families import hf

peft = pytest.importorskip("peft")

B, T = 2, 16
OFF = dict(activations=False, norms=False, gated_mlp=False, loss=False, lora_inputs=False, measure=False)


def _only(**on):
    return {**OFF, **on}


def _llama(dtype=torch.float32):
    return hf("llama", num_hidden_layers=1).to(dtype)


#: kind → (tiny model, convert() options that plan this kind alone, how the plan shows it)
KINDS = {
    "act": (lambda: hf("gpt2", n_layer=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
            _only(activations=True), lambda plan: plan.act_swaps),
    "relu2": (lambda: hf("nemotron", num_hidden_layers=1, num_key_value_heads=2, head_dim=16),
              _only(activations=True), lambda plan: plan.of(OutputActSwap)),
    "exact": (_llama, _only(norms=True), lambda plan: plan.of(NormExact)),
    "fold": (_llama, _only(norms=True, fold_norms=True), lambda plan: plan.norm_folds),
    "gated": (_llama, _only(gated_mlp=True), lambda plan: plan.gated_mlps),
    "moe": (lambda: hf("mixtral", num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=2,
                       num_hidden_layers=1), _only(gated_mlp=True), lambda plan: plan.of(RecomputeRegion)),
    "lora": (lambda: _llama(torch.bfloat16), _only(lora_inputs=True), lambda plan: plan.of(LoraInputShare)),
    "loss": (_llama, _only(loss=True), lambda plan: plan.of(LossSwap)),
}


def _lora(model, dropout, head=False):
    """PEFT LoRA (r 4, B ≠ 0) on every Linear (GPT-2: Conv1D) but the LM head (``head``: on it too)."""
    from transformers.pytorch_utils import Conv1D

    targets = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
               if type(m) in (nn.Linear, Conv1D) and (head or not n.endswith("lm_head"))}
    torch.manual_seed(2)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False,
                          target_modules=sorted(targets))
    model = peft.get_peft_model(model, cfg)
    model.enable_input_require_grads()  # frozen embeddings: the first layer's input needs a graph
    return model


def _checkpointing(model, reentrant):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.config.use_cache = False
    if reentrant:  # reentrant checkpoints only backprop into blocks whose inputs require grad
        model.enable_input_require_grads()


def _step(model, ids, labels, autocast=False, call=None):
    """One training forward and backward (seeded: the same dropout draws in both models): loss, gradients."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = (model if call is None else call)(input_ids=ids, labels=ids if labels else None)
        loss = out.loss if labels else out.logits.float().pow(2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _fold_scaled(model, ref, plan):
    """Each folded weight's name → the norm's γ: the original's gradient is the folded weight's times γ (along
    its input dim): y = W·(γ⊙x̂) = (W·diag γ)·x̂. LoRA's lora_A takes the fold too, lora_B does not."""
    mods = dict(ref.named_modules())
    out = {}
    for fold in plan.norm_folds:
        gamma = mods[fold.name].weight.detach()
        for t in fold.targets:
            for n, p in model.named_parameters():
                if n.startswith(t.name + ".") and n.endswith("weight") and "lora_B" not in n \
                        and p.shape[-1] == gamma.numel():
                    out[n] = gamma
    return out


#: (kind, partner): the pairs no other test builds (the module doc's table)
PAIRS = [
    ("act", "lora_dropout"), ("act", "gc_reentrant"), ("act", "autocast"),
    ("relu2", "lora_dropout"), ("relu2", "gc_reentrant"), ("relu2", "gc_nonreentrant"), ("relu2", "autocast"),
    ("exact", "autocast"),
    ("fold", "lora_dropout"), ("fold", "gc_reentrant"), ("fold", "gc_nonreentrant"), ("fold", "autocast"),
    ("gated", "autocast"),
    ("moe", "lora_dropout"), ("moe", "gc_reentrant"), ("moe", "autocast"),
    ("lora", "gc_reentrant"), ("lora", "gc_nonreentrant"), ("lora", "autocast"), ("lora", "autocast_fp32"),
    ("loss", "lora_dropout"), ("loss", "lora_dropout_head"), ("loss", "gc_reentrant"), ("loss", "gc_nonreentrant"),
]


@pytest.mark.parametrize("kind, partner", PAIRS, ids=[f"{k}-{p}" for k, p in PAIRS])
def test_pair(kind, partner):
    """The kind converted alone next to the partner; one training step against the unconverted model beside the
    same partner (checkpointing enabled before convert(), so the conversion itself traces and verifies
    checkpointed layers)."""
    make, options, planned = KINDS[kind]
    model = make()
    if kind == "lora" and partner == "autocast_fp32":
        model = _lora(_llama(), 0.1)  # fp32 adapters on fp32 inputs: shared because they drop
    elif kind == "lora":
        model = _lora(model, 0.0)  # bf16 inputs, fp32 adapters: the adapters' up-cast copies are shared
    elif partner.startswith("lora_dropout"):
        model = _lora(model, 0.1, head=partner.endswith("head"))
    if partner.startswith("gc_"):
        _checkpointing(model, partner == "gc_reentrant")
    ref = copy.deepcopy(model)
    report = convert(model, **options).lmbp_report
    assert report.verified and planned(report.plan), str(report)
    if kind == "act":  # the original's forward, the step derivative's backward
        ref = with_step_backward(ref, report.plan.act_swaps)
    autocast = partner.startswith("autocast")
    ids = torch.randint(3, 128, (B, T), generator=torch.Generator().manual_seed(0))
    l0, want = _step(ref, ids, kind == "loss", autocast)
    l1, got = _step(model, ids, kind == "loss", autocast)

    scaled = _fold_scaled(model, ref, report.plan) if kind == "fold" else {}
    folded_norms = {f"{f.name}.weight" for f in report.plan.norm_folds}
    assert set(got) == set(want) - folded_norms and want  # a folded γ is in the weights it went into
    if kind in ("act", "fold") or (kind, partner) == ("exact", "autocast"):
        # approximate backprop: fp32 sums in another order; folds: one rounding more (W·diag γ); exact norms under
        # autocast: the bf16 x̂ the Linears compute from rounds y (tests/nn/test_exact_norms.py)
        tol = 2e-2 if autocast else 1e-4
        assert float((l1 - l0).abs()) <= (1e-3 if autocast else 1e-6) * float(l0.abs())
        for n in got:
            g = got[n] * scaled[n] if n in scaled else got[n]
            assert _rel(g, want[n]) <= tol, (n, _rel(g, want[n]))
        assert kind != "fold" or any(n in got for n in scaled)  # the γ relation was checked somewhere
        return
    if kind == "loss":  # the loss itself sums in another order; its gradient is the plain path's, bit for bit
        assert float((l1 - l0).abs()) <= 1e-6 * float(l0.abs())
    else:
        assert torch.equal(l1, l0)
    for n in want:
        assert torch.equal(got[n], want[n]), (n, _rel(got[n], want[n]))


# -- a second reader of the tensor the rewrite stops keeping ---------------------------------------------------------
D, FF = 32, 64


class _ActMLP(nn.Module):
    """fc1 → act → fc2, the activation's output read by a second consumer that saves it too (a Linear, or a
    product with a parameter), both summed into the output."""

    def __init__(self, act: nn.Module, second: str):
        super().__init__()
        self.fc1, self.act, self.fc2, self.aux = nn.Linear(D, FF), act, nn.Linear(FF, D), nn.Linear(FF, D)
        self.scale = nn.Parameter(torch.rand(FF) + 0.5)
        self.second = second

    def forward(self, x):
        h = self.act(self.fc1(x))
        return self.fc2(h) + (self.aux(h) if self.second == "linear" else (h * self.scale)[..., :D])


def _grads(model, x):
    x = x.detach().clone().requires_grad_()
    model.train()
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss.detach(), {**{n: p.grad for n, p in model.named_parameters() if p.grad is not None}, "x": x.grad}


@pytest.mark.parametrize("second", ["linear", "mul"])
@pytest.mark.parametrize("act", ["approx", "relu2"])
def test_second_reader_of_an_activation_output(act, second):
    """The swapped activation keeps codes (approx-BP) or its output (squared ReLU) whatever else reads its output:
    the second reader's gradient adds to the first's; approx-BP within fp32 rounding of the step reference,
    squared ReLU bitwise the original."""
    from transformers.activations import ReLUSquaredActivation

    torch.manual_seed(0)
    model = _ActMLP(nn.GELU() if act == "approx" else ReLUSquaredActivation(), second)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 8, D)
    plan = convert(model, probe=x, **_only(activations=True)).lmbp_report.plan
    assert [i.name for i in (plan.act_swaps if act == "approx" else plan.of(OutputActSwap))] == ["act"]
    if act == "approx":
        ref = with_step_backward(ref, plan.act_swaps)
    (l0, want), (l1, got) = _grads(ref, x), _grads(model, x)
    assert got.keys() == want.keys() and {"aux.weight" if second == "linear" else "scale", "fc1.weight"} <= set(got)
    if act == "relu2":
        assert torch.equal(l0, l1) and all(torch.equal(got[n], want[n]) for n in want)
    else:
        assert float((l1 - l0).abs()) <= 1e-6 * float(l0) and all(_rel(got[n], want[n]) <= 1e-5 for n in want)


def test_an_exact_norm_output_read_by_an_adapter_and_a_trainable_layer():
    """Issue 38's model: one exact norm's y read as it is by a trainable Linear (k_proj, an fp32 matmul) and as
    y.to(bf16) by a bf16 LoRA adapter (q_proj): two chains from one noted tensor, each rebuilt apart. A rebuild
    shared by both hands one of them the other's dtype ('expected m1 and m2 to have the same dtype'), which
    convert()'s backward check rolls back; here every norm stays exact, the loss and gradients bitwise PEFT's."""
    torch.manual_seed(2)
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                          target_modules=["q_proj"]), autocast_adapter_dtype=False)
    attn = model.base_model.model.model.layers[0].self_attn
    attn.q_proj.lora_A.to(torch.bfloat16)
    attn.q_proj.lora_B.to(torch.bfloat16)
    attn.k_proj.weight.requires_grad_(True)
    model.enable_input_require_grads()
    ref = copy.deepcopy(model)
    report = convert(model, **_only(norms=True)).lmbp_report
    assert report.verified and {n.name.rsplit(".", 1)[-1] for n in report.plan.of(NormExact)} == {
        "input_layernorm", "post_attention_layernorm", "norm"}, str(report)
    ids = torch.randint(3, 128, (B, T), generator=torch.Generator().manual_seed(0))
    (l0, want), (l1, got) = _step(ref, ids, False), _step(model, ids, False)
    assert torch.equal(l0, l1) and got.keys() == want.keys() and len(want) == 3
    for n in want:
        assert torch.equal(got[n], want[n]), n


class _GatedMLP(nn.Module):
    """LLaMA's MLP; ``second``: the product h = act(g)·u is also read by another Linear."""

    def __init__(self, second: bool):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False)
        self.down_proj, self.act_fn = nn.Linear(FF, D, bias=False), nn.SiLU()
        if second:
            self.aux = nn.Linear(FF, D, bias=False)

    def forward(self, x):
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(h) + self.aux(h) if hasattr(self, "aux") else self.down_proj(h)


class _Experts(nn.Module):
    """transformers ≥ 5's layout: 3-D expert parameters, a loop over the routed experts; ``second``: each expert's
    product is also read by a shared Linear map (F.linear on one more parameter)."""

    def __init__(self, second: bool, n: int = 4):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(n, 2 * FF, D) / D ** 0.5)
        self.down = nn.Parameter(torch.randn(n, D, FF) / FF ** 0.5)
        self.aux = nn.Parameter(torch.randn(D, FF) / FF ** 0.5)
        self.router, self.act_fn, self.second = nn.Linear(D, n, bias=False), nn.SiLU(), second

    def forward(self, x):
        flat = x.reshape(-1, D)
        chosen = self.router(flat).argmax(-1)
        out = torch.zeros_like(flat)
        for e in range(self.gate_up.shape[0]):
            rows = torch.where(chosen == e)[0]
            g, u = F.linear(flat[rows], self.gate_up[e]).chunk(2, dim=-1)
            h = self.act_fn(g) * u
            y = F.linear(h, self.down[e])
            out = out.index_add(0, rows, y + F.linear(h, self.aux) if self.second else y)
        return out.reshape(x.shape)


class _Residual(nn.Module):
    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return x + self.mlp(x)


def _recompute_case(mlp):
    torch.manual_seed(0)
    model = _Residual(mlp)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 8, D)
    plan = convert(model, probe=x, **_only(gated_mlp=True)).lmbp_report.plan
    (l0, want), (l1, got) = _grads(ref, x), _grads(model, x)
    assert torch.equal(l0, l1) and got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n
    return plan, got


@pytest.mark.parametrize("second", [False, True], ids=["alone", "second_reader"])
def test_second_reader_of_the_gated_product(second):
    """The fused gated MLP computes h inside its op, so a second reader of h cannot be served: that MLP is not
    fused but becomes a recompute region (h rebuilt from g, u for both readers), bitwise the original's."""
    plan, got = _recompute_case(_GatedMLP(second))
    assert [m.name for m in plan.gated_mlps] == ([] if second else ["mlp"])
    assert [r.name for r in plan.of(RecomputeRegion)] == (["mlp"] if second else [])
    assert not second or "mlp.aux.weight" in got


@pytest.mark.parametrize("second", [False, True], ids=["alone", "second_reader"])
def test_second_reader_of_an_expert_product(second):
    """MoE experts whose product is read by the down projection and a second weight op: the region recomputes it
    for both, bitwise the original's (routing: the same experts)."""
    plan, got = _recompute_case(_Experts(second))
    assert [r.name for r in plan.of(RecomputeRegion)] == ["mlp"]
    assert got["mlp.aux"].abs().sum() > 0 if second else "mlp.aux" not in got


def test_a_second_reader_of_the_logits():
    """The loss and a z-loss on the same logits: the head's backward takes the loss's gradient as a recipe and
    adds the other reader's; every gradient is the unconverted model's."""
    model = _llama()
    ref = copy.deepcopy(model)
    plan = convert(model, **_only(loss=True)).lmbp_report.plan
    assert [i.head for i in plan.of(LossSwap)] == ["lm_head"]
    ids = torch.randint(3, 128, (B, T), generator=torch.Generator().manual_seed(0))
    grads = []
    for m in (ref, model):
        m.train()
        out = m(input_ids=ids, labels=ids)
        (out.loss + 1e-2 * out.logits.float().logsumexp(-1).pow(2).mean()).backward()
        grads.append((out.loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (l0, want), (l1, got) = grads
    assert float((l1 - l0).abs()) <= 1e-6 * float(l0) and got.keys() == want.keys()
    for n in want:
        assert _rel(got[n], want[n]) <= 1e-6, (n, _rel(got[n], want[n]))


@pytest.mark.slow  # torch.compile: seconds on 2 cores
def test_squared_relu_compiles_in_one_graph_with_the_original_gradients():
    """A model whose squared ReLUs were swapped traces into one graph in train mode (aot_eager: Dynamo and
    autograd's tracing, the eager kernels) with the original's loss and gradients."""
    torch._dynamo.reset()
    make, options, planned = KINDS["relu2"]
    model = make()
    ref = copy.deepcopy(model)
    assert planned(convert(model, **options).lmbp_report.plan)
    ids = torch.randint(3, 128, (B, T), generator=torch.Generator().manual_seed(0))
    l0, want = _step(ref, ids, False)
    l1, got = _step(model, ids, False, call=torch.compile(model, backend="aot_eager", fullgraph=True))
    torch._dynamo.reset()
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=0)
    assert got.keys() == want.keys()
    for n in want:
        assert _rel(got[n], want[n]) <= 1e-5, (n, _rel(got[n], want[n]))
