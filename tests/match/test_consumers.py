"""Functional consumers (match/consumers.py): a norm folds into parameters that ops apply to its output —
F.linear on a module's weight with a bias assembled in forward (timm EVA / BEiT), nn.MultiheadAttention's
in_proj (all rows, or only those of the inputs the norm feeds), convolutions on channel-first views without
padding (PVT-v2's spatial reduction). Each converts exactly (fp32 gradients), saves the asserted bytes, and is
refused with its reason where the fold would not be exact."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmbp_convert import NothingToConvertError, SavedTensorLedger, convert
from lmbp_convert.match.norm_exact import NormExact
from lmbp_convert.match.norm_kept import NormKeep
from lmbp_convert.match.plan import NormFold
from lmbp_convert.match.consumers import ConsumerFold
from lmbp_convert.match.plan import Plan
from testsupport.families import randomize_norms

D, H = 32, 4


class FusedQKV(nn.Module):
    """EVA/BEiT attention block: qkv weight applied by F.linear with cat(q_bias, k_bias buffer, v_bias)."""

    def __init__(self, bias_buffer_persistent=False, with_bias=True):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.with_bias = with_bias
        self.q_bias = nn.Parameter(torch.randn(D) * 0.1)
        self.register_buffer("k_bias", torch.zeros(D), persistent=bias_buffer_persistent)
        self.v_bias = nn.Parameter(torch.randn(D) * 0.1)
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        b, n, _ = x.shape
        h = self.norm(x)
        bias = torch.cat((self.q_bias, self.k_bias, self.v_bias)) if self.with_bias else None
        qkv = F.linear(h, weight=self.qkv.weight, bias=bias)
        q, k, v = qkv.reshape(b, n, 3, H, -1).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, D)
        return x + self.proj(o)


class CrossMHA(nn.Module):
    """nn.MultiheadAttention whose query comes from the norm and key/value from another tensor (or the reverse)."""

    def __init__(self, norm_feeds="query"):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, H, batch_first=True)
        self.memory = nn.Parameter(torch.randn(1, 5, D))
        self.norm_feeds = norm_feeds

    def forward(self, x):
        h = self.norm(x)
        mem = self.memory.expand(x.shape[0], -1, -1)
        if self.norm_feeds == "query":
            out = self.attn(h, mem, mem, need_weights=False)[0]
        else:
            out = self.attn(mem, h, h, need_weights=False)[0]
        return out


class ChannelFirstConv(nn.Module):
    """PVT-v2 spatial reduction: tokens → (B, C, H, W) → a conv without padding (and a Linear on the tokens)."""

    def __init__(self, padding=0, norm=None, kernel=2):
        super().__init__()
        self.norm = norm if norm is not None else nn.LayerNorm(D)
        self.q = nn.Linear(D, D)
        self.sr = nn.Conv2d(D, D, kernel, stride=2, padding=padding)

    def forward(self, x):
        b, n, c = x.shape
        h = self.norm(x)
        s = self.sr(h.permute(0, 2, 1).reshape(b, c, 4, 4)).flatten(2).transpose(1, 2)
        return self.q(h).sum(1, keepdim=True) + s.mean(1, keepdim=True)


def _eva():
    import timm

    torch.manual_seed(0)
    m = timm.create_model("eva_giant_patch14_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                          embed_dim=D, num_heads=H, mlp_ratio=2, num_classes=10)
    with torch.no_grad():
        for blk in m.blocks:
            blk.attn.q_bias.normal_(0, 0.1)
            blk.attn.v_bias.normal_(0, 0.1)
    return randomize_norms(m).eval()


def _check_exact(model, x, *, tol=1e-5, **kw):
    """Convert (norms only: approximate activations are inexact by design); outputs and the fp32 gradient of the
    input match the original's."""
    ref = copy.deepcopy(model)
    kw.setdefault("fold_norms", True)  # the fold (the exact default: tests/match/test_norm_exact.py)
    rep = convert(model, probe=x, activations=False, **kw).lmbp_report
    assert rep.verified, str(rep)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = model(xa), ref(xb)
    ya.float().pow(2).mean().backward()
    yb.float().pow(2).mean().backward()
    assert float((ya - yb).detach().norm() / yb.detach().norm()) < tol
    assert float((xa.grad - xb.grad).norm() / xb.grad.norm()) < tol
    return rep


def _saved(model, x):
    with SavedTensorLedger(model) as led:
        model(x)
    return led.bytes


def _folds(rep):
    return {f.name: f for f in rep.plan.of(ConsumerFold)}


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_fused_qkv_with_assembled_bias_folds_exactly():
    torch.manual_seed(0)
    model, x = randomize_norms(FusedQKV()), torch.randn(2, 6, D)
    before = _saved(model, x)
    rep = _check_exact(model, x)
    (fold,) = _folds(rep).values()
    (t,) = fold.params
    assert (t.weight, t.op, t.rows) == ("qkv.weight", "linear", None)
    assert [(b.tensor, b.start, b.stop, b.parameter) for b in t.bias] == [
        ("q_bias", 0, D, True), ("k_bias", D, 2 * D, False), ("v_bias", 2 * D, 3 * D, True)]
    assert fold.buffer_notes() == ["k_bias"]
    # the LayerNorm's fp32 input (2·6·32·4 = 1536 bytes) and its per-row statistics are no longer kept
    assert (before, _saved(model, x)) == (9504, 7872)


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_fused_qkv_without_bias_refuses_beta_and_takes_rms():
    torch.manual_seed(0)
    model = randomize_norms(FusedQKV(with_bias=False))
    with pytest.raises(NothingToConvertError, match="adds no bias, so the norm's β has nowhere to go"):
        convert(copy.deepcopy(model), probe=torch.randn(2, 6, D), fold_norms=True)
    model.norm = nn.RMSNorm(D)  # no β: nothing needs a bias
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    rep = _check_exact(model, torch.randn(2, 6, D), fold_norms=True)
    # with no bias to assemble, the plain norm planner's parameter targets (match/functional.py) take it first
    assert "norm" in {f.name for f in rep.plan.of(NormFold)}


def test_timm_eva_norm1_folds_into_qkv_and_its_bias_parts():
    model, x = _eva(), torch.randn(2, 3, 32, 32)
    before = _saved(model, x)
    rep = _check_exact(model, x)
    fold = _folds(rep)["blocks.0.norm1"]
    assert [p.weight for p in fold.params] == ["blocks.0.attn.qkv.weight"]
    assert not any(s.name == "blocks.0.norm1" for s in rep.plan.skips)
    assert (before, _saved(model, x)) == (78416, 69176 - 8)  # fp32: the replayed norm keeps no rstd (2 rows)


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_transformer_encoder_layer(norm_first):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, H, 2 * D, dropout=0.0, batch_first=True, norm_first=norm_first)
    model, x = randomize_norms(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)).eval(), torch.randn(2, 6, D)
    if not norm_first:  # post-LN: the residual add sits in the layer's own forward; nothing folds into in_proj
        with pytest.raises(NothingToConvertError, match="layers.0.norm1: output also feeds add in layers.0, and "
                                                        "there is no module boundary"):
            convert(copy.deepcopy(model), probe=x, activations=False, keep_affine=False)
        # ... so, folding, the norms keep their affine and share their output with the feed-forward's Linear
        rep = convert(copy.deepcopy(model), probe=x, activations=False, fold_norms=True).lmbp_report
        assert {k.name for k in rep.plan.of(NormKeep)} >= {"layers.0.norm1", "layers.1.norm1"}
        # the exact default: exact norms, outputs and input gradient the original's
        rep = _check_exact(model, x, fold_norms=False)
        assert {k.name for k in rep.plan.of(NormExact)} >= {"layers.0.norm1", "layers.1.norm1"}, str(rep)
        return
    before = _saved(model, x)
    rep = _check_exact(model, x)
    folds = _folds(rep)
    if norm_first:  # norm1 feeds the self-attention's q, k and v: all in_proj rows
        assert sorted(folds) == ["layers.0.norm1", "layers.1.norm1"]
        assert [p.rows for p in folds["layers.0.norm1"].params] == [[0, D], [D, 2 * D], [2 * D, 3 * D]]
        assert (before, _saved(model, x)) == (31488, 26640)


@pytest.mark.parametrize("feeds, rows", [("query", [[0, D]]), ("kv", [[D, 2 * D], [2 * D, 3 * D]])])
@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_cross_attention_folds_only_the_rows_of_the_norm_fed_inputs(feeds, rows):
    torch.manual_seed(0)
    model, x = randomize_norms(CrossMHA(feeds)), torch.randn(2, 6, D)
    w0 = model.attn.in_proj_weight.detach().clone()
    rep = _check_exact(model, x)
    (fold,) = _folds(rep).values()
    assert [p.rows for p in fold.params] == rows
    other = [r for r in ([0, D], [D, 2 * D], [2 * D, 3 * D]) if r not in rows]
    for a, b in other:  # rows fed by the other tensor are untouched
        assert torch.equal(model.attn.in_proj_weight[a:b], w0[a:b])


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_conv_without_padding_takes_gamma_and_beta():
    torch.manual_seed(0)
    model, x = randomize_norms(ChannelFirstConv()), torch.randn(2, 16, D)
    before = _saved(model, x)
    rep = _check_exact(model, x)
    (fold,) = _folds(rep).values()
    assert fold.targets[0].name == "q" and fold.params[0].conv and fold.params[0].weight == "sr.weight"
    assert (before, _saved(model, x)) == (8448, 4096)


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_conv_with_padding_refuses_beta_but_not_rms():
    torch.manual_seed(0)
    model = randomize_norms(ChannelFirstConv(padding=1, kernel=3))
    with pytest.raises(NothingToConvertError, match="pads its input .padding=.1, 1..: padded positions would see 0"):
        convert(copy.deepcopy(model), probe=torch.randn(2, 16, D), fold_norms=True)
    rms = nn.RMSNorm(D)
    with torch.no_grad():
        rms.weight.uniform_(0.5, 1.5)
    rep = _check_exact(ChannelFirstConv(padding=1, kernel=3, norm=rms), torch.randn(2, 16, D))
    assert "norm" in _folds(rep)


@pytest.mark.parametrize("make", [lambda: FusedQKV(), lambda: CrossMHA("kv"), lambda: ChannelFirstConv()])
@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_plan_round_trips_and_an_original_checkpoint_is_folded_on_load(make):
    torch.manual_seed(0)
    model = randomize_norms(make())
    x = torch.randn(2, 16 if isinstance(model, ChannelFirstConv) else 6, D)
    ref, original = copy.deepcopy(model), copy.deepcopy(model.state_dict())
    rep = convert(model, probe=x, activations=False, fold_norms=True).lmbp_report
    back = Plan.from_dict(rep.plan.to_dict())
    assert back.of(ConsumerFold) == rep.plan.of(ConsumerFold) != []
    converted = copy.deepcopy(model.state_dict())
    model.load_state_dict(converted)  # its own state loads as it is
    assert torch.allclose(model(x), ref(x), rtol=1e-5, atol=1e-6)
    model.load_state_dict(original)  # the original checkpoint is folded as it arrives
    for k, v in model.state_dict().items():
        assert torch.allclose(v, converted[k], rtol=1e-6, atol=1e-7), k
    assert torch.allclose(model(x), ref(x), rtol=1e-5, atol=1e-6)
    partial = {k: v for k, v in original.items() if not k.startswith(("qkv", "attn.in_proj", "sr."))}
    with pytest.raises(RuntimeError, match="did not arrive with it"):
        model.load_state_dict(partial, strict=False)


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_converted_on_meta_then_loaded():
    torch.manual_seed(0)
    ref = randomize_norms(FusedQKV(bias_buffer_persistent=True))
    with torch.device("meta"):
        model = FusedQKV(bias_buffer_persistent=True)
    x = torch.randn(2, 6, D)
    rep = convert(model, probe=x.to("meta"), activations=False, verify=False, fold_norms=True).lmbp_report
    assert rep.plan.of(ConsumerFold)
    model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())
    assert torch.allclose(model(x), ref(x), rtol=1e-5, atol=1e-6)


class ConvMlpBlock(nn.Module):
    """ConvNeXt block with a conv MLP: depthwise conv → channel-first LayerNorm → 1×1 convs."""

    def __init__(self, norm):
        super().__init__()
        self.dw = nn.Conv2d(D, D, 3, padding=1, groups=D)
        self.norm = norm
        self.fc1 = nn.Conv2d(D, 2 * D, 1)
        self.fc2 = nn.Conv2d(2 * D, D, 1)

    def forward(self, x):
        return x + self.fc2(F.relu(self.fc1(self.norm(self.dw(x)))))


def _timm_layernorm2d():
    from timm.layers import LayerNorm2d

    return LayerNorm2d(D)


def _hf_channels_first():
    from transformers.models.convnext.modeling_convnext import ConvNextLayerNorm

    return ConvNextLayerNorm(D, data_format="channels_first")


@pytest.mark.parametrize("make_norm", [_timm_layernorm2d, _hf_channels_first])
@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_channel_first_norm_is_found_and_folds_into_a_1x1_conv(make_norm):
    from lmbp_convert.catalogue import load_catalogue
    from lmbp_convert.match.roles import assign_roles
    from lmbp_convert.nn.channel_first import MSLayerNorm2d

    torch.manual_seed(0)
    model, x = randomize_norms(ConvMlpBlock(make_norm())), torch.randn(2, D, 6, 6)
    role = assign_roles(model, load_catalogue())["norm"]
    assert role.plays == "norm" and role.norm.channel_dim == 1, role
    before = _saved(model, x)
    rep = _check_exact(model, x)
    fold = _folds(rep)["norm"]
    assert fold.channel_dim == 1 and [p.weight for p in fold.params] == ["fc1.weight"]
    assert isinstance(model.norm, MSLayerNorm2d)
    # the norm's fp32 input (2·32·6·6·4 = 9216 bytes) and its statistics are no longer kept; the 1×1 conv keeps a
    # channel-first view of the norm's output
    after = _saved(model, x)
    assert before - after == 9216 + 288, (before, after)


def test_mha_with_separate_projection_weights_is_refused_with_its_reason():
    class KDim(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(D)
            self.attn = nn.MultiheadAttention(D, H, kdim=D // 2, vdim=D // 2, batch_first=True)
            self.memory = nn.Parameter(torch.randn(1, 5, D // 2))

        def forward(self, x):
            mem = self.memory.expand(x.shape[0], -1, -1)
            return self.attn(self.norm(x), mem, mem, need_weights=False)[0]

    torch.manual_seed(0)
    with pytest.raises(NothingToConvertError, match="uses separate q/k/v projection weights"):
        convert(randomize_norms(KDim()), probe=torch.randn(2, 6, D), fold_norms=True)


# -- the exact default (fold_norms=False): no parameter changes, the fold's bytes ------------------------------
def _grads(model, x):
    model.zero_grad(set_to_none=True)
    xa = x.clone().requires_grad_()
    out = model(xa)
    out = out[0] if isinstance(out, tuple) else out
    out.float().pow(2).mean().backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, xa.grad


#: case → (model, input shape, saved bytes: original, fold, exact). The pre-LN encoder's exact form keeps one
#: (2, 6, 32) fp32 tensor less than its fold, and its three fp32 norms (trailing dims: they replay the original,
#: ops/replay_norm.py) no per-row rstd.
EXACT_CASES = {
    "fused_qkv": (lambda: FusedQKV(), (2, 6, D), (9504, 7872, 7872)),
    "cross_mha_kv": (lambda: CrossMHA("kv"), (2, 6, D), (10240, 8608, 8608)),
    "channel_first_conv": (lambda: ChannelFirstConv(), (2, 16, D), (8448, 4096, 4096)),
    "conv_mlp_layernorm2d": (lambda: ConvMlpBlock(_timm_layernorm2d()), (2, D, 6, 6), (46656, 37152, 37152)),
    "conv_mlp_hf_channels_first": (lambda: ConvMlpBlock(_hf_channels_first()), (2, D, 6, 6), (46656, 37152, 37152)),
    "encoder_pre_ln": (lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(
        D, H, 2 * D, dropout=0.0, batch_first=True, norm_first=True), 2, enable_nested_tensor=False), (2, 6, D),
        (31488, 26640, 25104 - 3 * 12 * 4)),
}


@pytest.mark.parametrize("case", sorted(EXACT_CASES))
@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_exact_default_keeps_every_parameter_and_saves_the_folds_bytes(case):
    """What ``fold_norms=True`` folds into functional or channel-first consumers, the default makes exact: the
    norm keeps γ, β (channel-first norms over dim 1), the consumers' parameters stay the original tensors, the
    state dict and every gradient are the original's, and the saved bytes are the fold's (the consumers' saved
    views of y, permuted, cast or copied, are rebuilt from x̂)."""
    make, shape, nbytes = EXACT_CASES[case]
    torch.manual_seed(0)
    base = randomize_norms(make()).eval()
    x = torch.randn(*shape)
    folded = convert(copy.deepcopy(base), probe=x, activations=False, fold_norms=True)
    assert folded.lmbp_report.plan.of(ConsumerFold), str(folded.lmbp_report)
    model = copy.deepcopy(base)
    rep = convert(model, probe=x, activations=False).lmbp_report
    assert rep.verified and not rep.inexact_training and not rep.plan.of(ConsumerFold), str(rep)
    exact = {it.name: it for it in rep.plan.of(NormExact)}
    assert {f.name for f in folded.lmbp_report.plan.of(ConsumerFold)} <= set(exact), str(rep)
    original = base.state_dict()
    assert list(model.state_dict()) == list(original)
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())
    assert (_saved(base, x), _saved(folded, x), _saved(model, x)) == nbytes
    (got, gx), (want, wx) = _grads(model, x), _grads(base, x)
    assert set(got) == set(want)
    for n, g in want.items():
        assert float((got[n] - g).norm()) <= 1e-5 * float(g.norm()) + 1e-9, n
    assert float((gx - wx).norm()) <= 1e-5 * float(wx.norm())
