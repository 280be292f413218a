"""Gated MLPs through identity ops and timm's gated MLPs: found by a plain convert(model), fused, verified,
gradients equal to the original's, exact saved bytes; gated-looking MLPs that are not fused are reported."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lmbp_convert import SavedTensorLedger, convert, plan_conversion
from lmbp_convert.match.moe import RecomputeRegion
from lmbp_convert.nn.gated_mlp import MSGatedMLP
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.trace.tracer import call_model

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")

D, FF, T = 32, 64, 10  # model width, MLP width, tokens in the MLP-level byte checks


def t5(kind: str = "t5", dropout: float = 0.0) -> nn.Module:
    cfg = transformers.AutoConfig.for_model(kind, d_model=D, d_ff=FF, d_kv=8, num_heads=4, num_layers=2,
                                            vocab_size=64, feed_forward_proj="gated-gelu", dropout_rate=dropout)
    torch.manual_seed(0)
    return (transformers.T5EncoderModel if kind == "t5" else transformers.UMT5EncoderModel)(cfg)


def modernbert(dropout: float = 0.0) -> nn.Module:
    cfg = transformers.AutoConfig.for_model(
        "modernbert", hidden_size=D, intermediate_size=FF, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=64, global_attn_every_n_layers=1, local_attention=16, mlp_dropout=dropout, pad_token_id=0,
        eos_token_id=1, bos_token_id=2, cls_token_id=2, sep_token_id=1)
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(cfg)


def eva02_glu() -> nn.Module:
    """EVA02-tiny: timm GluMlp (fused fc1 chunked, the first half gated), Identity inner norm, drop1/drop2."""
    torch.manual_seed(0)
    return timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=28, depth=2)


def eva02_swiglu_norm() -> nn.Module:
    """EVA02-base layout: timm SwiGLU (fc1_g, fc1_x) with a LayerNorm between the product and fc2."""
    torch.manual_seed(0)
    return timm.create_model("eva02_base_patch14_224", pretrained=False, img_size=28, depth=2, embed_dim=48,
                             num_heads=2)


# family: (model factory, MLP module names, expected pre-down chain, post-down chain, cast)
FAMILIES = {
    "t5": (t5, [f"encoder.block.{i}.layer.1.DenseReluDense" for i in (0, 1)], ["dropout"], [], False),
    "umt5": (lambda: t5("umt5"), [f"encoder.block.{i}.layer.1.DenseReluDense" for i in (0, 1)], ["dropout"],
             [], False),
    "modernbert": (modernbert, [f"layers.{i}.mlp" for i in (0, 1)], ["drop"], [], False),
    "eva02_glumlp": (eva02_glu, [f"blocks.{i}.mlp" for i in (0, 1)], ["drop1", "norm"], ["drop2"], False),
    "eva02_swiglu_norm": (eva02_swiglu_norm, [f"blocks.{i}.mlp" for i in (0, 1)], ["drop1", "norm"], ["drop2"],
                          False),
}


def _probe(model):
    return make_probe(model, batch=2, seq=8)[0]


def _loss(out):
    out = out if isinstance(out, torch.Tensor) else out.last_hidden_state
    return (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_plain_convert_fuses_gated_mlps_and_keeps_gradients(family):
    make, mlps, pre, post, cast = FAMILIES[family]
    model = make()
    ref = copy.deepcopy(model)
    rep = convert(model).lmbp_report
    assert rep.verified, str(rep)
    swaps = {s.name: s for s in rep.plan.gated_mlps}
    assert sorted(swaps) == sorted(mlps), str(rep)
    for name in mlps:
        assert (swaps[name].pre_down, swaps[name].post_down, swaps[name].cast_to_down) == (pre, post, cast)
        assert isinstance(model.get_submodule(name), MSGatedMLP)
    # the gated swap alone (no norm folds, no approximate activations): the same state_dict keys, outputs and
    # fp32 gradients in training mode (dropout p = 0 in these configs)
    model = copy.deepcopy(ref)
    rep = convert(model, norms=False, activations=False).lmbp_report
    assert sorted(s.name for s in rep.plan.gated_mlps) == sorted(mlps), str(rep)
    assert model.state_dict().keys() == ref.state_dict().keys()
    probe = _probe(model)
    model.train(), ref.train()
    outs = []
    for m in (model, ref):
        m.zero_grad()
        loss = _loss(call_model(m, probe))
        loss.backward()
        outs.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (la, ga), (lb, gb) = outs
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    assert ga.keys() == gb.keys()
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-4, atol=1e-5, msg=n)


def _mlp_saved_bytes(mlp: nn.Module, dtype: torch.dtype) -> int:
    x = torch.randn(2, T // 2, D, dtype=dtype, requires_grad=True)
    with SavedTensorLedger(mlp) as led:
        mlp(x)
    return led.bytes


def _converted_mlp(model: nn.Module, name: str, **kw) -> tuple[nn.Module, nn.Module]:
    ref = copy.deepcopy(model).get_submodule(name)
    convert(model, **kw)
    return ref, model.get_submodule(name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_t5_gated_gelu_saves_only_x_g_u(dtype):
    """p = 0: the MLP keeps its input, g and u, nothing else (act(g), the product and GELU-tanh's own
    intermediates are gone)."""
    ref, mlp = _converted_mlp(t5().to(dtype), "encoder.block.0.layer.1.DenseReluDense")
    size = dtype.itemsize
    ref.train(), mlp.train()
    before, after = _mlp_saved_bytes(ref, dtype), _mlp_saved_bytes(mlp, dtype)
    assert after == T * D * size + 2 * T * FF * size
    assert before - after >= 2 * T * FF * size  # act(g) and act(g)·u at least


def test_t5_dropout_in_training_runs_inside_the_fused_mlp():
    """p > 0 in training: dropout is not an identity; it runs inside the module on u (the same mask as the
    original on the same seed: dropout(act(g)·u) = act(g)·dropout(u)), so the MLP keeps x, g, dropout(u) and
    dropout's mask, not act(g), the product nor the dropped product (wo's input, recomputed)."""
    model = t5(dropout=0.25)
    ref, mlp = _converted_mlp(model, "encoder.block.0.layer.1.DenseReluDense")
    assert isinstance(mlp, MSGatedMLP) and mlp.pre_down == ("dropout",)
    ref.train(), mlp.train()
    x = torch.randn(2, T // 2, D)
    grads = []
    for m in (ref, mlp):
        torch.manual_seed(7)
        xi = x.clone().requires_grad_(True)
        out = m(xi)
        out.pow(2).sum().backward()
        grads.append((out.detach(), xi.grad, [p.grad.clone() for p in m.parameters()]))
        m.zero_grad()
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])
    for a, b in zip(grads[0][2], grads[1][2]):
        torch.testing.assert_close(a, b)
    h = torch.randn(T, FF, requires_grad=True)
    with SavedTensorLedger() as led:  # what dropout itself keeps here (a bool mask on CUDA, a float one on CPU)
        torch.nn.functional.dropout(h, 0.25, training=True)
    assert led.bytes > 0
    assert _mlp_saved_bytes(mlp, torch.float32) == T * D * 4 + 2 * T * FF * 4 + led.bytes
    assert _mlp_saved_bytes(ref, torch.float32) >= T * D * 4 + 4 * T * FF * 4 + led.bytes


def test_modernbert_geglu_bf16_saves_only_x_and_gate_up():
    ref, mlp = _converted_mlp(modernbert().to(torch.bfloat16), "layers.0.mlp")
    ref.train(), mlp.train()
    before, after = _mlp_saved_bytes(ref, torch.bfloat16), _mlp_saved_bytes(mlp, torch.bfloat16)
    assert after == T * D * 2 + 2 * T * FF * 2  # x and Wi's output (g and u are its halves)
    assert before - after >= 2 * T * FF * 2


def test_t5_fp32_wo_in_a_bf16_model_keeps_the_cast():
    """T5 keeps ``wo`` in fp32 (``_keep_in_fp32_modules``) and casts the product to it: the trace sees the cast,
    the fused MLP replays it (the product is cast to wo's weight dtype, then recomputed for wo's backward)."""
    model = t5().to(torch.bfloat16)
    for blk in model.encoder.block:
        blk.layer[1].DenseReluDense.wo.float()
    ref = copy.deepcopy(model)
    # norms=False: the norm fold drops T5LayerNorm's own cast of its output to a half weight dtype (its issue,
    # not the gated MLP's: the layer after an fp32 wo then gets fp32 input)
    rep = convert(model, norms=False).lmbp_report
    assert rep.verified, str(rep)
    assert [s.cast_to_down for s in rep.plan.gated_mlps] == [True, True], str(rep)
    name = "encoder.block.0.layer.1.DenseReluDense"
    a, b = model.get_submodule(name).train(), ref.get_submodule(name).train()
    x = torch.randn(2, T // 2, D, dtype=torch.bfloat16)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    oa, ob = a(xa), b(xb)
    assert oa.dtype == ob.dtype == torch.float32
    (oa * oa.detach()).sum().backward(), (ob * ob.detach()).sum().backward()
    assert a.wo.weight.grad.dtype == torch.float32

    def rel(p, q):  # the fused GELU-tanh rounds once in bf16 where NewGELU's chain of bf16 ops rounds at each
        return float((p.detach().float() - q.detach().float()).norm() / q.detach().float().norm())
    assert rel(oa, ob) < 1e-2 and rel(xa.grad, xb.grad) < 2e-2 and rel(a.wo.weight.grad, b.wo.weight.grad) < 2e-2


def test_swiglu_inner_norm_is_run_between_product_and_down():
    """timm SwiGLU with a LayerNorm before fc2: the norm's input (the product) is recomputed, not kept."""
    model = eva02_swiglu_norm()
    # folded: the MLP is called on its own here, outside the whole-model call whose region lets an exact norm's
    # consumers share its output (an exact norm called so saves its output as eager autograd does)
    ref, mlp = _converted_mlp(model, "blocks.0.mlp", fold_norms=True)
    ff = ref.fc1_g.out_features
    d = ref.fc1_g.in_features
    ref.train(), mlp.train()
    x = torch.randn(2, T // 2, d, requires_grad=True)
    with SavedTensorLedger(mlp) as led:
        mlp(x)
    with SavedTensorLedger(ref) as led_ref:
        ref(x)
    # T×ff tensors kept: g, u and the (memory-sharing) norm's output, which fc2 shares; the original also keeps
    # act(g) and the product (the norm's input)
    big = [e for e in led.entries if e.nbytes == T * ff * 4]
    big_ref = [e for e in led_ref.entries if e.nbytes == T * ff * 4]
    assert len(big) == 3 and len(big_ref) == 5, (led.summary(), led_ref.summary())
    small = led.bytes - 3 * T * ff * 4 - T * d * 4  # the norm's per-row statistics
    assert 0 < small <= 2 * T * 4, led.summary()


class _Scaled(nn.Module):
    """A module between the product and the down projection that is not an identity op."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((FF,), 0.5))

    def forward(self, h):
        return h * self.scale


class _GatedWith(nn.Module):
    def __init__(self, middle: nn.Module):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(D, FF), nn.Linear(D, FF), nn.Linear(FF, D)
        self.act, self.middle = nn.SiLU(), middle

    def forward(self, x):
        return self.down(self.middle(self.act(self.gate(x)) * self.up(x)))


class _Wrap(nn.Module):
    def __init__(self, middle: nn.Module):
        super().__init__()
        self.mlp = _GatedWith(middle)

    def forward(self, x):
        return self.mlp(x)


def test_a_gated_looking_mlp_that_is_not_fused_is_reported():
    model = _Wrap(_Scaled())
    rep = convert(model, probe=torch.randn(2, 4, D)).lmbp_report
    assert not rep.plan.gated_mlps
    skip = next(s for s in rep.plan.skips if s.name == "mlp")
    assert "between the product and the down projection mlp.down" in skip.reason, str(rep)


def test_identity_modules_between_product_and_down_are_walked():
    for middle in (nn.Identity(), nn.Dropout(0.3)):
        model = _Wrap(middle)
        rep = convert(model, probe=torch.randn(2, 4, D)).lmbp_report
        assert [s.pre_down for s in rep.plan.gated_mlps] == [["middle"]], str(rep)


def test_mambaout_gated_conv_mlp_becomes_a_recompute_region():
    torch.manual_seed(0)
    model = timm.create_model("mambaout_femto", pretrained=False)
    rep = convert(model, probe=torch.randn(1, 3, 64, 64)).lmbp_report
    assert rep.verified and not rep.plan.gated_mlps
    blocks = [n for n, m in model.named_modules() if type(m).__name__ == "GatedConvBlock"]
    # not a fused gated MLP (its up half goes through a depthwise conv), but a recompute region: act(g)·u is rebuilt
    # in backward from what autograd keeps anyway (match/moe.py), so nothing is left unreported
    regions = {it.name for it in rep.plan.of(RecomputeRegion)}
    assert blocks and set(blocks) <= regions, str(rep)


class _TimmMlp(nn.Module):
    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x)


@pytest.mark.parametrize("gate_last", [True, False])
def test_timm_glumlp_gated_half_follows_gate_last(gate_last):
    """GluMlp chunks fc1's output: ``gate_last`` (its default) gates the second half."""
    from timm.layers.mlp import GluMlp

    torch.manual_seed(0)
    model = _TimmMlp(GluMlp(D, 2 * FF, act_layer=nn.GELU, gate_last=gate_last))
    ref = copy.deepcopy(model)
    x = torch.randn(2, 4, D)
    rep = convert(model, probe=x, norms=False, activations=False).lmbp_report
    assert [(s.gate_up, s.gate_first) for s in rep.plan.gated_mlps] == [("fc1", not gate_last)], str(rep)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    oa, ob = model.train()(xa), ref.train()(xb)
    torch.testing.assert_close(oa, ob, rtol=1e-5, atol=1e-6)
    oa.pow(2).sum().backward(), ob.pow(2).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.mlp.fc1.weight.grad, ref.mlp.fc1.weight.grad, rtol=1e-5, atol=1e-6)


def test_timm_glumlp_with_its_default_sigmoid_is_reported():
    from timm.layers.mlp import GluMlp

    plan = plan_conversion(_TimmMlp(GluMlp(D, 2 * FF)), probe=torch.randn(2, 4, D))
    assert not plan.gated_mlps
    assert any(s.name == "mlp" and "Sigmoid (mlp.act) as its activation has no fused op" in s.reason
               for s in plan.skips), plan.skips


def test_plan_with_identity_chains_round_trips():
    from lmbp_convert.match.plan import Plan

    plan = plan_conversion(eva02_swiglu_norm())
    back = Plan.from_dict(plan.to_dict())
    assert [s.to_dict() for s in back.gated_mlps] == [s.to_dict() for s in plan.gated_mlps]
    assert back.gated_mlps[0].pre_down == ["drop1", "norm"] and back.gated_mlps[0].post_down == ["drop2"]


def test_a_hooked_dropout_sees_the_product():
    """A hook on the dropout must see what it saw before (the product): the dropout is then not moved onto u
    but called on the product inside the recompute path."""
    model = _Wrap(nn.Dropout(0.5))
    convert(model, probe=torch.randn(2, 4, D), norms=False, activations=False)
    seen = []
    model.mlp.middle.register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
    model.train()
    x = torch.randn(2, 4, D, requires_grad=True)
    torch.manual_seed(3)
    out = model(x)
    mlp = model.mlp
    h = torch.nn.functional.silu(mlp.gate(x)) * mlp.up(x)
    torch.testing.assert_close(seen[0], h.detach())
    out.sum().backward()
    assert x.grad is not None and mlp.down.weight.grad is not None
