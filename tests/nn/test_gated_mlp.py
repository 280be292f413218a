"""MSGatedMLP against the Hugging Face MLPs it replaces: values, every gradient, state_dict keys, PEFT LoRA,
saved-for-backward bytes and torch.compile."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmbp_convert.memory import SavedTensorLedger
from lmbp_convert.nn.gated_mlp import MSGatedMLP, down_support

transformers = pytest.importorskip("transformers")
from transformers.models.gemma.modeling_gemma import GemmaMLP  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402
from transformers.models.phi3.modeling_phi3 import Phi3MLP  # noqa: E402

D, FF = 16, 40
_KW = dict(hidden_size=D, intermediate_size=FF, num_attention_heads=2, num_key_value_heads=2)


def llama(act="silu", bias=False):
    return LlamaMLP(transformers.LlamaConfig(**_KW, hidden_act=act, mlp_bias=bias))


def gemma():
    return GemmaMLP(transformers.GemmaConfig(**_KW, hidden_activation="gelu_pytorch_tanh"))


def phi3():
    return Phi3MLP(transformers.Phi3Config(**_KW))


class UpFirstMLP(nn.Module):
    """A fused projection whose first half is the up projection."""

    def __init__(self):
        super().__init__()
        self.w_in = nn.Linear(D, 2 * FF)
        self.w_out = nn.Linear(FF, D)

    def forward(self, x):
        up, gate = self.w_in(x).chunk(2, dim=-1)
        return self.w_out(F.gelu(gate) * up)


def convert(mlp: nn.Module, act: str) -> MSGatedMLP:
    """What the walker does: the same projection modules, under the same names."""
    if isinstance(mlp, Phi3MLP):
        return MSGatedMLP(act, "down_proj", gate_up="gate_up_proj",
                          modules={"gate_up_proj": mlp.gate_up_proj, "down_proj": mlp.down_proj})
    if isinstance(mlp, UpFirstMLP):
        return MSGatedMLP(act, "w_out", gate_up="w_in", gate_first=False,
                          modules={"w_in": mlp.w_in, "w_out": mlp.w_out})
    return MSGatedMLP(act, "down_proj", "gate_proj", "up_proj",
                      modules={n: getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")})


CASES = {
    "llama-silu-bias": (lambda: llama("silu", True), "silu"),
    "llama-gelu": (lambda: llama("gelu"), "gelu"),
    "gemma-gelu_tanh": (gemma, "gelu_tanh"),
    "phi3-fused": (phi3, "silu"),
    "up-first-fused": (UpFirstMLP, "gelu"),
}


def _fwd_bwd(module, x, w):
    x = x.detach().requires_grad_(x.requires_grad)
    out = module(x)
    (out.float() * w).sum().backward()
    grads = {n.removeprefix("_orig_mod."): p.grad for n, p in module.named_parameters() if p.requires_grad}
    return out, x.grad, grads


def _seeded_fwd_bwd(module, x, w):
    torch.manual_seed(123)  # the same dropout masks in both models: their forwards draw in the same order
    return _fwd_bwd(module, x, w)


def _compare(ref_mod, ms_mod, x, rtol=1e-5, atol=1e-5):
    w = torch.randn(*x.shape[:-1], D)
    out_r, gx_r, g_r = _fwd_bwd(ref_mod, x, w)
    out_m, gx_m, g_m = _fwd_bwd(ms_mod, x, w)
    assert out_m.dtype == out_r.dtype
    torch.testing.assert_close(out_m, out_r, rtol=rtol, atol=atol)
    if gx_r is None:
        assert gx_m is None
    else:
        torch.testing.assert_close(gx_m, gx_r, rtol=rtol, atol=atol)
    assert g_m.keys() == g_r.keys()
    for name in g_r:
        assert g_m[name].dtype == g_r[name].dtype, name
        torch.testing.assert_close(g_m[name], g_r[name], rtol=rtol, atol=atol, msg=name)
    return g_r


@pytest.mark.parametrize("case", CASES)
def test_matches_hf_mlp_fp32(case):
    make, act = CASES[case]
    ref = make()
    ms = convert(copy.deepcopy(ref), act)
    assert list(ms.state_dict()) == [k for k in ref.state_dict()]
    x = torch.randn(2, 5, D, requires_grad=True)
    grads = _compare(ref, ms, x)
    assert all(torch.count_nonzero(g) > 0 for g in grads.values())


@pytest.mark.parametrize("frozen", [("gate_proj",), ("down_proj",), ("gate_proj", "up_proj"),
                                    ("gate_proj", "up_proj", "down_proj")])
@pytest.mark.parametrize("x_grad", [True, False])
def test_frozen_projections(frozen, x_grad):
    ref = llama("silu", True)
    for name in frozen:
        getattr(ref, name).requires_grad_(False)
    ms = convert(copy.deepcopy(ref), "silu")
    x = torch.randn(3, 4, D, requires_grad=x_grad)
    if len(frozen) == 3 and not x_grad:
        with torch.no_grad():
            torch.testing.assert_close(ms(x), ref(x), rtol=1e-6, atol=1e-6)
        return
    _compare(ref, ms, x)


@pytest.mark.parametrize("case", ["llama-silu-bias", "phi3-fused"])
def test_bf16_module_no_worse_than_eager(case):
    make, act = CASES[case]
    ref64 = make().double()
    ref, ms = copy.deepcopy(ref64).bfloat16(), convert(copy.deepcopy(ref64).bfloat16(), act)
    x = torch.randn(4, 8, D, dtype=torch.float64)
    w = torch.randn(4, 8, D)
    t_out, t_gx, t_g = _fwd_bwd(ref64, x.requires_grad_(), w)
    e_out, e_gx, e_g = _fwd_bwd(ref, x.bfloat16().requires_grad_(), w)
    m_out, m_gx, m_g = _fwd_bwd(ms, x.bfloat16().requires_grad_(), w)
    pairs = [(m_out, e_out, t_out), (m_gx, e_gx, t_gx)] + [(m_g[n], e_g[n], t_g[n]) for n in t_g]
    for m, e, t in pairs:
        assert m.dtype == e.dtype == torch.bfloat16
        err_m, err_e = (m.double() - t).abs().max(), (e.double() - t).abs().max()
        assert err_m <= 1.5 * err_e + 1e-2 * t.abs().max()


@pytest.mark.parametrize("case", ["gemma-gelu_tanh", "phi3-fused"])
def test_bf16_autocast_dtypes_and_values(case):
    make, act = CASES[case]
    ref = make()
    ms = convert(copy.deepcopy(ref), act)
    x = torch.randn(4, 8, D, dtype=torch.bfloat16)
    w = torch.randn(4, 8, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        e_out, e_gx, e_g = _fwd_bwd(ref, x.requires_grad_(), w)
        m_out, m_gx, m_g = _fwd_bwd(ms, x.requires_grad_(), w)
    assert m_out.dtype == e_out.dtype == torch.bfloat16 and m_gx.dtype == e_gx.dtype == torch.bfloat16
    torch.testing.assert_close(m_out, e_out, rtol=3e-2, atol=3e-2 * e_out.abs().max().item())
    for n in e_g:
        assert m_g[n].dtype == e_g[n].dtype == torch.float32
        torch.testing.assert_close(m_g[n], e_g[n], rtol=5e-2, atol=5e-2 * e_g[n].abs().max().item(), msg=n)


# ------------------------------------------------------------------------------------------------------
# PEFT LoRA
# ------------------------------------------------------------------------------------------------------
peft = pytest.importorskip("peft")


class Tiny(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x)


def _peft_model(mlp, targets, dropout=0.0, second=False, **kw):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=dropout,
                          init_lora_weights=False, **kw)
    pm = peft.get_peft_model(Tiny(mlp), cfg)
    if second:
        pm.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=3, target_modules=list(targets),
                                                 init_lora_weights=False, lora_bias=True))
        pm.base_model.set_adapter(["default", "second"])
    return pm


def _swap(pm, act):
    inner = pm.base_model.model
    inner.mlp = convert(inner.mlp, act)
    return pm


@pytest.mark.parametrize("targets", [("down_proj",), ("gate_proj", "up_proj", "down_proj")])
@pytest.mark.parametrize("second", [False, True])
def test_peft_lora_exact(targets, second):
    pm = _peft_model(llama("silu", True), targets, second=second)
    ref = copy.deepcopy(pm)
    keys = list(pm.state_dict())
    _swap(pm, "silu")
    assert list(pm.state_dict()) == keys
    assert down_support(pm.base_model.model.mlp.down_proj) == "lora"
    grads = _compare(ref, pm, torch.randn(3, 4, D, requires_grad=True))
    lora_names = [n for n in grads if "lora_" in n]
    assert len(lora_names) == 2 * len(targets) * (2 if second else 1) + (len(targets) if second else 0)
    assert all(torch.count_nonzero(grads[n]) > 0 for n in lora_names)


def test_peft_lora_fused_gate_up():
    pm = _peft_model(phi3(), ("gate_up_proj", "down_proj"))
    ref = copy.deepcopy(pm)
    _swap(pm, "silu")
    _compare(ref, pm, torch.randn(2, 6, D, requires_grad=True))


def test_peft_disabled_and_merged_adapters():
    pm = _peft_model(llama("gelu"), ("down_proj",))
    ref = copy.deepcopy(pm)
    _swap(pm, "gelu")
    x = torch.randn(2, 3, D)
    with pm.disable_adapter(), ref.disable_adapter():
        _compare(ref, pm, x.requires_grad_())
    for m in (pm, ref):
        for mod in m.modules():
            if isinstance(mod, peft.tuners.lora.Linear):
                mod.merge()
    with torch.no_grad():
        torch.testing.assert_close(pm(x), ref(x), rtol=1e-5, atol=1e-5)
    with pm.disable_adapter(), ref.disable_adapter():  # unmerges, as lora.Linear.forward does
        torch.testing.assert_close(pm(x), ref(x), rtol=1e-5, atol=1e-5)


def test_peft_fp32_adapters_on_bf16_base():
    """PEFT's default upcasts adapters to fp32 on a bf16 model; the dtype chain is reproduced."""
    pm = _peft_model(llama("silu").bfloat16(), ("down_proj",))
    ref = copy.deepcopy(pm)
    _swap(pm, "silu")
    assert pm.base_model.model.mlp.down_proj.lora_A["default"].weight.dtype == torch.float32
    x = torch.randn(2, 4, D, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(2, 4, D)
    e_out, _, e_g = _fwd_bwd(ref, x, w)
    m_out, _, m_g = _fwd_bwd(pm, x, w)
    assert m_out.dtype == e_out.dtype == torch.bfloat16
    torch.testing.assert_close(m_out, e_out, rtol=3e-2, atol=3e-2 * e_out.abs().max().item())
    for n in e_g:
        assert m_g[n].dtype == e_g[n].dtype
        torch.testing.assert_close(m_g[n].float(), e_g[n].float(), rtol=5e-2,
                                   atol=5e-2 * e_g[n].abs().max().item(), msg=n)


def test_peft_lora_dropout_runs_unfused_exact_and_keeps_no_act():
    """lora_dropout > 0 on the down projection: the fused op cannot reproduce it, so the module runs as is with h
    recomputed (it used to raise NotImplementedError). It keeps dropout(h) and its mask as eager does, not act(g)."""
    pm = _peft_model(llama(), ("down_proj",), dropout=0.1)
    ref = copy.deepcopy(pm)
    _swap(pm, "silu")
    assert down_support(pm.base_model.model.mlp.down_proj) == "eager"
    x, w = torch.randn(2, 5, D, requires_grad=True), torch.randn(2, 5, D)
    out_r, gx_r, g_r = _seeded_fwd_bwd(ref, x, w)
    out_m, gx_m, g_m = _seeded_fwd_bwd(pm, x, w)
    torch.testing.assert_close(out_m, out_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx_m, gx_r, rtol=1e-5, atol=1e-5)
    for n in g_r:
        torch.testing.assert_close(g_m[n], g_r[n], rtol=1e-5, atol=1e-5, msg=n)
    xt = torch.randn(T, D, requires_grad=True)
    torch.manual_seed(0)
    ours = _saved(pm, xt).bytes
    torch.manual_seed(0)
    assert ours == _saved(ref, xt).bytes - 4 * T * FF


def test_peft_lora_dropout_on_gate_up_is_fine():
    """gate/up are ordinary modules run by autograd: their dropout is their own business."""
    pm = _peft_model(llama(), ("gate_proj", "up_proj"), dropout=0.2)
    pm.eval()  # deterministic comparison
    ref = copy.deepcopy(pm)
    _swap(pm, "silu")
    _compare(ref, pm, torch.randn(2, 3, D, requires_grad=True))


def test_peft_dora_runs_unfused_and_exact():
    """DoRA on the down projection (it used to raise NotImplementedError): run as is, h recomputed."""
    pm = _peft_model(llama("silu", True), ("gate_proj", "up_proj", "down_proj"), use_dora=True)
    ref = copy.deepcopy(pm)
    _swap(pm, "silu")
    assert down_support(pm.base_model.model.mlp.down_proj) == "eager"
    grads = _compare(ref, pm, torch.randn(3, 4, D, requires_grad=True))
    assert any("magnitude" in n for n in grads)


# ------------------------------------------------------------------------------------------------------
# Down projections the fused op does not take: eager fallback, still exact
# ------------------------------------------------------------------------------------------------------
class ScaledLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 0.5


def test_eager_fallback_for_other_down_modules():
    ref = llama("silu")
    ref.down_proj = ScaledLinear(FF, D)
    ms = convert(copy.deepcopy(ref), "silu")
    assert down_support(ms.down_proj) == "eager"
    _compare(ref, ms, torch.randn(2, 3, D, requires_grad=True))


def test_hooked_down_runs_eagerly_and_fires_hooks():
    ref = llama("silu")
    ms = convert(copy.deepcopy(ref), "silu")
    seen = []
    ms.down_proj.register_forward_hook(lambda m, i, o: seen.append(i[0].shape))
    assert down_support(ms.down_proj) == "eager"
    _compare(ref, ms, torch.randn(2, 3, D, requires_grad=True))
    assert seen == [(2, 3, FF)]


# ------------------------------------------------------------------------------------------------------
# Saved-for-backward bytes: x + g + u, nothing else
# ------------------------------------------------------------------------------------------------------
T = 24  # tokens


def _saved(module, x):
    with SavedTensorLedger(module) as ledger:
        module(x)
    return ledger


@pytest.mark.parametrize("case", ["llama-silu-bias", "phi3-fused"])
def test_saved_bytes_fp32(case):
    make, act = CASES[case]
    ref = make()
    ms = convert(copy.deepcopy(ref), act)
    x = torch.randn(T, D, requires_grad=True)
    ours, eager = _saved(ms, x), _saved(ref, x)
    assert ours.bytes == 4 * (T * D + 2 * T * FF), ours.summary()
    assert ours.count == (2 if case == "phi3-fused" else 3)  # one storage for the fused g, u
    assert eager.bytes == 4 * (T * D + 4 * T * FF), eager.summary()  # x, g, act(g), u, h


def test_saved_bytes_frozen():
    ref = llama("silu")
    ref.requires_grad_(False)
    ms = convert(copy.deepcopy(ref), "silu")
    x = torch.randn(T, D, requires_grad=True)
    ours, eager = _saved(ms, x), _saved(ref, x)
    assert ours.bytes == 4 * 2 * T * FF, ours.summary()  # frozen Linears do not keep their input
    assert eager.bytes == 4 * 3 * T * FF, eager.summary()  # g, act(g), u


@pytest.mark.parametrize("case", ["gemma-gelu_tanh", "phi3-fused"])
def test_saved_bytes_bf16_autocast(case):
    make, act = CASES[case]
    ref = make()
    ms = convert(copy.deepcopy(ref), act)
    x = torch.randn(T, D, dtype=torch.bfloat16, requires_grad=True)  # the norm emits the compute dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, eager = _saved(ms, x), _saved(ref, x)
    assert ours.bytes == 2 * (T * D + 2 * T * FF), ours.summary()
    assert eager.bytes == 2 * (T * D + 4 * T * FF), eager.summary()


def test_saved_bytes_lora_everywhere():
    r = 4
    pm = _peft_model(llama("silu"), ("gate_proj", "up_proj", "down_proj"))
    ref = copy.deepcopy(pm)
    _swap(pm, "silu")
    x = torch.randn(T, D, requires_grad=True)
    ours, eager = _saved(pm, x), _saved(ref, x)
    # x, g, u, and the rank-r inputs of gate's and up's lora_B; down's adapter adds nothing (recomputed).
    assert ours.bytes == 4 * (T * D + 2 * T * FF + 2 * T * r), ours.summary()
    assert eager.bytes == 4 * (T * D + 4 * T * FF + 3 * T * r), eager.summary()


# ------------------------------------------------------------------------------------------------------
# torch.compile, repr, validation
# ------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # torch.compile of the module
@pytest.mark.parametrize("case", ["llama-silu-bias", "phi3-fused"])
def test_torch_compile_matches_eager(case):
    make, act = CASES[case]
    ms = convert(make(), act)
    compiled = torch.compile(copy.deepcopy(ms), fullgraph=True)
    _compare(ms, compiled, torch.randn(2, 5, D, requires_grad=True))


def test_extra_repr():
    assert "act=gelu_tanh, layout=gate_proj, up_proj, down=down_proj" in repr(convert(gemma(), "gelu_tanh"))
    assert "layout=w_in->(up, gate), down=w_out" in repr(convert(UpFirstMLP(), "gelu"))


def test_constructor_validation():
    m = llama()
    mods = {n: getattr(m, n) for n in ("gate_proj", "up_proj", "down_proj")}
    with pytest.raises(ValueError, match="act_kind"):
        MSGatedMLP("relu", "down_proj", "gate_proj", "up_proj", modules=mods)
    with pytest.raises(ValueError, match="either"):
        MSGatedMLP("silu", "down_proj", "gate_proj", modules=mods)
    with pytest.raises(ValueError, match="either"):
        MSGatedMLP("silu", "down_proj", "gate_proj", "up_proj", gate_up="x", modules=mods)
    with pytest.raises(ValueError, match="exactly"):
        MSGatedMLP("silu", "down_proj", "gate_proj", "up_proj", modules={**mods, "act_fn": m.act_fn})
    with pytest.raises(ValueError, match="distinct"):
        MSGatedMLP("silu", "down_proj", "gate_proj", "gate_proj", modules=mods)


# ------------------------------------------------------------------------------------------------------
# down_mode="recompute": the down projection runs unchanged, its saved h is recomputed from g and u
# ------------------------------------------------------------------------------------------------------
class ScaledDown(nn.Module):
    """A down projection the fused path does not know: a Linear inside a user module, plus a scale."""

    def __init__(self, inner: nn.Linear, scale: float = 0.75):
        super().__init__()
        self.inner, self.scale = inner, scale

    def forward(self, x):
        return self.inner(x) * self.scale


def _recompute(mlp: nn.Module) -> MSGatedMLP:
    return MSGatedMLP("silu", "down_proj", "gate_proj", "up_proj", down_mode="recompute",
                      modules={n: getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")})


def _with_down(kind: str):
    """(reference model, model whose MLP is converted with down_mode="recompute"): LLaMA MLP in a parent,
    with the given down projection."""
    mlp = llama("silu", True)
    if kind == "scaled":
        mlp.down_proj = ScaledDown(mlp.down_proj)
        ref = Tiny(mlp)
    elif kind == "linear":
        ref = Tiny(mlp)
    else:
        ref = _peft_model(mlp, ("gate_proj", "up_proj", "down_proj"), use_dora=kind == "dora",
                          dropout=0.3 if kind == "lora-dropout" else 0.0)
    ours = copy.deepcopy(ref)
    holder = ours.base_model.model if kind not in ("linear", "scaled") else ours
    holder.mlp = _recompute(holder.mlp)
    return ref, ours


@pytest.mark.parametrize("kind", ["linear", "lora", "dora", "lora-dropout", "scaled"])
def test_recompute_mode_gradients_match_unconverted_fp32(kind):
    ref, ours = _with_down(kind)
    x, w = torch.randn(2, 5, D, requires_grad=True), torch.randn(2, 5, D)
    out_r, gx_r, g_r = _seeded_fwd_bwd(ref, x, w)
    out_m, gx_m, g_m = _seeded_fwd_bwd(ours, x, w)
    torch.testing.assert_close(out_m, out_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx_m, gx_r, rtol=1e-5, atol=1e-5)
    assert g_m.keys() == g_r.keys() and g_r
    for name in g_r:
        torch.testing.assert_close(g_m[name], g_r[name], rtol=1e-5, atol=1e-5, msg=name)
        assert torch.count_nonzero(g_r[name]) > 0, name


@pytest.mark.parametrize("kind", ["linear", "scaled"])
def test_recompute_mode_saves_x_g_u_only(kind):
    ref, ours = _with_down(kind)
    x = torch.randn(T, D, requires_grad=True)
    assert _saved(ours, x).bytes == 4 * (T * D + 2 * T * FF), _saved(ours, x).summary()
    assert _saved(ref, x).bytes == 4 * (T * D + 4 * T * FF)


def test_unknown_down_module_saves_x_g_u_only_by_default():
    """The fused mode's fallback for modules it cannot fuse recomputes h too (it used to keep h)."""
    mlp = llama("silu", True)
    mlp.down_proj = ScaledDown(mlp.down_proj)
    ms = convert(mlp, "silu")
    assert down_support(ms.down_proj) == "eager"
    ledger = _saved(ms, torch.randn(T, D, requires_grad=True))
    assert ledger.bytes == 4 * (T * D + 2 * T * FF), ledger.summary()


@pytest.mark.parametrize("autocast", [False, True])
def test_recompute_mode_lora_bytes(autocast):
    """PEFT LoRA on a bf16 base with fp32 adapters (PEFT's default upcast): h reaches lora_A as h.to(fp32) —
    under autocast as h.to(fp32).to(bf16) — and is recomputed all the same. Only the rank-r A(h), which the
    fused op recomputes too, is kept on top of the fused mode's bytes."""
    r = 4
    pm = _peft_model(llama("silu").bfloat16(), ("gate_proj", "up_proj", "down_proj"))
    fused, ours = copy.deepcopy(pm), copy.deepcopy(pm)
    _swap(fused, "silu")
    ours.base_model.model.mlp = _recompute(ours.base_model.model.mlp)
    x = torch.randn(T, D, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        b_fused, b_ours = _saved(fused, x).bytes, _saved(ours, x).bytes
    ar = 2 if autocast else 4  # A(h) in the autocast dtype, else in the fp32 adapter dtype
    assert b_ours == b_fused + ar * T * r, (b_ours, b_fused)


def test_recompute_mode_repr_and_validation():
    assert "down_mode=recompute" in repr(_recompute(llama()))
    with pytest.raises(ValueError, match="down_mode"):
        MSGatedMLP("silu", "down_proj", "gate_proj", "up_proj", down_mode="lazy",
                   modules={n: getattr(llama(), n) for n in ("gate_proj", "up_proj", "down_proj")})
