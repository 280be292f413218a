"""The affine-keeping fallback: a norm whose fold is refused but whose output a Linear keeps anyway becomes a
memory-sharing norm that keeps γ, β (`NormKeep`) — planned only where it saves bytes, exact, reversible.

It is part of folding (``fold_norms=True``, `FOLD`): in the exact default those norms are exact norms."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lmbp_convert import SavedTensorLedger, convert
from lmbp_convert.apply.rewrite import UnitBuilder
from lmbp_convert.match.norm_kept import NormKeep
from lmbp_convert.match.plan import Plan
from lmbp_convert.nn.affine_norms import MSAffineNorm

D, T = 32, 10
FOLD = dict(fold_norms=True)  # the fallback of the fold


class InLayerPostLN(nn.Module):
    """Post-LN with the residual add in the block's own forward (BART, HuBERT, DistilBERT): no module boundary
    to re-apply a folded affine at, so the fold is refused; ``fc`` keeps ``ln``'s output for backward."""

    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(D, D)
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)
        self.act = nn.GELU()
        self.ln_out = nn.LayerNorm(D)
        with torch.no_grad():
            for ln in (self.ln, self.ln_out):
                ln.weight.copy_(1 + 0.3 * torch.randn(D))
                ln.bias.copy_(0.3 * torch.randn(D))

    def forward(self, x):
        h = self.ln(x + self.attn(x))
        return self.ln_out(h + self.act(self.fc(h)))  # ln_out: its output is the model output, which nobody keeps


def _model():
    torch.manual_seed(0)
    return InLayerPostLN().eval()


def _bytes(model, x, autocast=False):
    model.train()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx, SavedTensorLedger(model) as led:
        out = model(x)
    out.float().sum().backward()
    return led.bytes


def test_in_layer_post_ln_is_planned_with_its_reason():
    model = _model()
    rep = convert(model, probe=torch.randn(2, T, D), activations=False, **FOLD).lmbp_report
    (keep,) = rep.plan.of(NormKeep)
    assert keep.name == "ln" and keep.keepers == ["fc"]
    assert "no module boundary" in keep.fold_refused
    assert "ln" not in {s.name for s in rep.plan.skips}  # the fallback supersedes the refusal
    assert any(s.name == "ln_out" for s in rep.plan.skips)  # no consumer keeps it: left as is, with its reason
    assert rep.verification == "passed"
    assert "affine kept" in str(rep) and "fold refused" in str(rep)
    assert isinstance(model.ln, MSAffineNorm)


@pytest.mark.parametrize("autocast", [False, True])
def test_saves_the_norm_input_exactly(autocast):
    """Bytes: the norm's input (fp32) and LayerNorm's per-row mean go; nothing is added (fails on the old code,
    which left the norm as it was). Under autocast the norm emits bf16, so ``fc`` keeps that very storage: its own
    bf16 copy of the output goes as well."""
    x = torch.randn(2, T, D)
    ref = _model()
    before = _bytes(ref, x, autocast)
    model = copy.deepcopy(ref)
    convert(model, probe=x, activations=False, **FOLD)
    assert not model.lmbp_report.plan.of(NormKeep)[0].kept_channels
    after = _bytes(model, x, autocast)
    rows = 2 * T
    assert before - after == rows * D * 4 + rows * 4 + (rows * D * 2 if autocast else 0), (before, after)
    assert model.lmbp_report.plan.of(NormKeep)[0].predicted_saved_bytes == rows * D * 4 + rows * 4


def test_gradients_exact_and_parameters_kept():
    x = torch.randn(2, T, D)
    ref = _model()
    model = copy.deepcopy(ref)
    w, b = model.ln.weight, model.ln.bias
    keys = list(model.state_dict())
    convert(model, probe=x, activations=False, **FOLD)
    assert model.ln.weight is w and model.ln.bias is b and list(model.state_dict()) == keys
    for m in (ref, model):
        m.train()
        m(x).pow(2).mean().backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_rollback_puts_the_original_back():
    model = _model()
    original = model.ln
    rep = convert(copy.deepcopy(model), probe=torch.randn(2, T, D), activations=False, **FOLD).lmbp_report
    (keep,) = rep.plan.of(NormKeep)
    unit = keep.build_unit(UnitBuilder(model))
    unit.apply()
    assert isinstance(model.ln, MSAffineNorm) and model.ln.weight is original.weight
    unit.undo()
    assert model.ln is original


def test_serialises_and_reads_back():
    rep = convert(_model(), probe=torch.randn(2, T, D), activations=False, **FOLD).lmbp_report
    back = Plan.from_dict(rep.plan.to_dict())
    assert back.of(NormKeep) == rep.plan.of(NormKeep)


def test_switched_off_keeps_the_refusal():
    rep = convert(_model(), probe=torch.randn(2, T, D), keep_affine=False, **FOLD).lmbp_report
    assert not rep.plan.of(NormKeep) and any(s.name == "ln" and "no module boundary" in s.reason
                                             for s in rep.plan.skips)


def test_not_planned_when_no_consumer_keeps_the_output():
    """A frozen consumer keeps nothing: the MS norm would keep its output instead of its input, saving nothing."""
    model = _model()
    model.fc.weight.requires_grad_(False)
    model.fc.bias.requires_grad_(False)
    rep = convert(model, probe=torch.randn(2, T, D), **FOLD).lmbp_report
    assert not rep.plan.of(NormKeep) and any(s.name == "ln" and "no module boundary" in s.reason
                                             for s in rep.plan.skips)


class InputAlsoRead(InLayerPostLN):
    def forward(self, x):
        s = x + self.attn(x)
        h = self.ln(s)
        return self.ln_out(h + self.act(self.fc(h))) * s  # mul keeps s: the norm's input stays kept whatever the norm does


def test_not_planned_when_the_input_stays_kept():
    torch.manual_seed(0)
    model = InputAlsoRead().eval()
    rep = convert(model, probe=torch.randn(2, T, D), **FOLD).lmbp_report
    assert not rep.plan.of(NormKeep) and any(s.name == "ln" for s in rep.plan.skips)


def test_guard_channels_are_kept_and_counted():
    model = _model()
    with torch.no_grad():
        model.ln.weight[0] = 0.0
        model.ln.weight[1] = 1e-5
    x = torch.randn(2, T, D)
    ref = copy.deepcopy(model)
    before = _bytes(ref, x)
    convert(model, probe=x, activations=False, **FOLD)
    (keep,) = model.lmbp_report.plan.of(NormKeep)
    assert keep.kept_channels >= 2
    rows, k = 2 * T, keep.kept_channels
    assert before - _bytes(model, x) == keep.predicted_saved_bytes == rows * D * 4 + rows * 4 - (rows * k * 4 + rows * 4
                                                                                                  + k * 8)
    for m in (ref, model):
        m.zero_grad()
        m(x).pow(2).mean().backward()
    torch.testing.assert_close(model.ln.weight.grad, ref.ln.weight.grad, rtol=1e-5, atol=1e-6)


def test_module_falls_back_to_the_plain_norm_when_most_channels_are_tiny():
    ln = nn.LayerNorm(D)
    with torch.no_grad():
        ln.weight[: D // 2 + 1] = 0.0
    norm = MSAffineNorm("layer", D, ln.eps, ln.weight, ln.bias)
    x = torch.randn(4, D, requires_grad=True)
    with SavedTensorLedger(norm) as led:
        y = norm(x)
    torch.testing.assert_close(y, ln(x))
    assert norm.kept_channels(x.device) is None
    assert any(e.nbytes == x.numel() * 4 and e.shape == x.shape for e in led.entries)  # saves x, as LayerNorm does


def test_module_compiles_with_fullgraph_as_the_plain_norm():
    """Under torch.compile the guard (a data-dependent channel count) cannot be traced: the
    module is torch's norm there (same values, exact gradients); its guard cache is left to eager calls, which
    still save no input column but the guarded ones."""
    ln = nn.LayerNorm(D)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.3 * torch.randn(D, generator=torch.Generator().manual_seed(0)))
        ln.weight[0] = 0.0
        ln.bias.fill_(0.2)
    norm = MSAffineNorm("layer", D, ln.eps, copy.deepcopy(ln.weight), copy.deepcopy(ln.bias))
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch._dynamo.reset()
    y = torch.compile(norm, backend="aot_eager", fullgraph=True)(x)
    assert norm._device is None  # nothing cached from inside a graph
    ref = ln(x)
    torch.testing.assert_close(y, ref)
    g = torch.randn(4, D, generator=torch.Generator().manual_seed(2))
    for got, want in zip(torch.autograd.grad(y, (x, norm.weight, norm.bias), g),
                         torch.autograd.grad(ref, (x, ln.weight, ln.bias), g)):
        torch.testing.assert_close(got, want)
    torch._dynamo.reset()
    with SavedTensorLedger(norm) as led:
        norm(x)
    assert norm.kept_channels(x.device).tolist() == [0]
    full = [e for e in led.entries if e.shape == x.shape]
    assert len(full) == 1 and full[0].grad_fn == "MSAffineNormFunctionBackward", led.summary()  # y, not x
    assert any(e.shape == (4, 1) for e in led.entries), led.summary()  # the guarded channel's input column


@pytest.mark.parametrize("family", ["bart", "hubert"])
def test_tiny_families_keep_the_affine_of_their_in_layer_norms(family):
    from testsupport.families import PROBE_FAMILIES

    model = PROBE_FAMILIES[family]().eval()
    rep = convert(model, **FOLD).lmbp_report
    keeps = rep.plan.of(NormKeep)
    assert rep.verification == "passed"
    assert keeps and all("no module boundary" in k.fold_refused or "tied" in k.fold_refused for k in keeps), str(rep)
    assert not any("no module boundary" in s.reason for s in rep.plan.skips), str(rep)


def test_plain_export_is_the_state_dict_itself():
    """Nothing is folded: a plain checkpoint is the converted model's own state dict (plain save/load exact)."""
    from lmbp_convert.export import plain_state_dict, saves_plainly

    x = torch.randn(2, T, D)
    model = _model()
    convert(model, probe=x, activations=False, **FOLD)
    assert saves_plainly(model)
    sd = plain_state_dict(model)
    plain = _model()
    plain.load_state_dict(sd)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), model(x))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_consumer_keeps_the_output_only_without_adapter_dropout(dropout):
    """PEFT freezes the base Linear (it keeps nothing); lora_A keeps the norm's output only when no dropout sits
    in front of it (then it keeps the dropped copy instead, and the affine-keeping norm would save nothing)."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_model(), peft.LoraConfig(r=4, target_modules=["fc"], lora_dropout=dropout))
    rep = convert(model, probe=torch.randn(2, T, D), **FOLD).lmbp_report
    keeps = rep.plan.of(NormKeep)
    if dropout == 0.0:
        assert [k.keepers for k in keeps] == [["base_model.model.fc"]], str(rep)
    else:
        assert not keeps and any(s.name.endswith(".ln") for s in rep.plan.skips), str(rep)


@pytest.mark.parametrize("autocast", [False, True])
def test_exact_default_converts_the_in_layer_post_ln_with_the_same_saving(autocast):
    """Where folding would keep the affine (no module boundary), the exact default swaps in an exact norm: outputs
    and gradients the original's, the norm's input and per-row mean no longer kept. Under autocast its output stays
    fp32 as the original's does: ``fc``'s bf16 copy of it is rebuilt from x̂ (bf16 there), which takes its place,
    and the residual sum after it stays fp32 (the kept-affine norm emits bf16, so that sum is bf16 there)."""
    from lmbp_convert.match.norm_exact import NormExact

    x = torch.randn(2, T, D)
    ref = _model()
    before = _bytes(ref, x, autocast)
    model = copy.deepcopy(ref)
    rep = convert(model, probe=x, activations=False).lmbp_report
    (item,) = rep.plan.of(NormExact)
    assert item.name == "ln" and item.readers == ["fc"] and not rep.plan.of(NormKeep), str(rep)
    after = _bytes(model, x, autocast)
    rows = 2 * T
    # in fp32 the exact norm replays the original's ops (ops/replay_norm.py): it keeps x, not x̂, and no rstd
    replayed_rstd = 0 if autocast else rows * 4
    assert before - after == rows * D * 4 + rows * 4 + replayed_rstd, (before, after)
    ref.zero_grad(), model.zero_grad()
    for m in (ref, model):
        m.train()
        m(x).pow(2).mean().backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
