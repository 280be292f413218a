"""Verification cannot be fooled by non-finite values: NaN never passes, inf positions must match exactly."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import lmbp_convert.apply.rewrite as rewrite_mod
from lmbp_convert import convert
from lmbp_convert.apply.verify import CANNOT_VERIFY, FAILED, PASSED, compare_outputs
from lmbp_convert.trace.tracer import call_model
from testsupport.families import hf

INF, NAN = math.inf, math.nan


def _t(*xs):
    return torch.tensor(xs)


@pytest.mark.parametrize("out, ref, verdict", [
    (_t(1.0, 2.0), _t(1.0, 2.0), PASSED),
    (_t(1.0, -INF), _t(1.0, -INF), PASSED),  # masked logits: compared where finite
    (_t(1.02, -INF), _t(1.0, -INF), FAILED),  # the finite part moved: not hidden by inf − inf = NaN
    (_t(1.0, INF), _t(1.0, -INF), FAILED),  # other sign of inf
    (_t(1.0, NAN), _t(1.0, -INF), FAILED),
    (_t(1.0, -INF), _t(1.0, NAN), FAILED),
    (_t(1.0, 5.0), _t(1.0, NAN), FAILED),  # NaN must stay NaN
    (_t(1.0, NAN), _t(1.0, 2.0), FAILED),  # a new NaN
    (_t(NAN, NAN), _t(NAN, NAN), CANNOT_VERIFY),  # nothing finite to compare: not a pass
    (_t(-INF, INF), _t(-INF, INF), CANNOT_VERIFY),
    (_t(0.0, 0.0), _t(0.0, 0.0), PASSED),
    (_t(0.0, 1e-9), _t(0.0, 0.0), FAILED),
    (_t(3e38, -3e38), _t(3e38, -3e38), PASSED),  # norms of huge values do not overflow into inf/inf = NaN
])
def test_compare_outputs_verdicts(out, ref, verdict):
    cmp = compare_outputs({"a": out}, {"a": ref})
    assert cmp.verdict(1e-4) == verdict, cmp
    assert not math.isnan(cmp.error)
    # next to a matching finite output the verdict stays: a non-finite mismatch is never averaged away
    both = compare_outputs({"a": out, "b": torch.ones(3)}, {"a": ref, "b": torch.ones(3)}).verdict(1e-4)
    assert both == (PASSED if verdict == CANNOT_VERIFY else verdict)


def test_structure_mismatch_fails_and_no_float_outputs_cannot_verify():
    assert compare_outputs((torch.ones(2),), (torch.ones(3),)).verdict(1.0) == FAILED
    assert compare_outputs((torch.ones(2),), (torch.ones(2), torch.ones(2))).verdict(1.0) == FAILED
    assert compare_outputs(torch.ones(2, dtype=torch.long), torch.ones(2, dtype=torch.long)).verdict(1.0) == CANNOT_VERIFY


class PaddedVocabHead(nn.Module):
    """A head over a vocabulary padded to a multiple of 64: logits of the padding ids are masked to −inf."""

    def __init__(self, proj: nn.Linear, real_vocab: int):
        super().__init__()
        self.proj = proj
        self.real_vocab = real_vocab

    def forward(self, x):
        logits = self.proj(x)
        pad = torch.arange(logits.shape[-1], device=logits.device) >= self.real_vocab
        return logits.masked_fill(pad, -math.inf)


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_masked_logits_do_not_hide_a_wrong_rewrite(monkeypatch):
    """A rewrite that moves every finite logit by 2e-2 is rolled back, although the outputs hold −inf."""
    model = hf("llama").eval()
    model.lm_head = PaddedVocabHead(model.lm_head, real_vocab=100)
    head_weight = model.lm_head.proj.weight
    real = rewrite_mod.fold_affine

    def shifting_fold(weight, bias, gamma, beta, layout="out_in"):
        w, b = real(weight, bias, gamma, beta, layout)
        if weight is head_weight:  # the fold into the head adds a bias of 2e-2 to every logit
            b = torch.full((w.shape[0],), 2e-2, dtype=w.dtype)
        return w, b

    monkeypatch.setattr(rewrite_mod, "fold_affine", shifting_fold)
    probe = {"input_ids": torch.tensor([[1, 5, 9, 77, 3]])}
    with torch.no_grad():
        ref = call_model(model, probe).logits
    assert torch.isinf(ref).any() and torch.isfinite(ref).any()
    report = convert(model, probe=probe, fold_norms=True).lmbp_report  # a wrong fold to catch
    assert [label for label, _ in report.rolled_back] == ["norm model.norm"], str(report)
    assert report.rolled_back[0][1] > 1e-3
    assert report.verification == PASSED and report.verified
    assert isinstance(model.lm_head.proj.bias, type(None))
    with torch.no_grad():
        out = call_model(model, probe).logits
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), fin)
    assert torch.allclose(out[fin], ref[fin], rtol=1e-4, atol=1e-5)


def test_nan_weights_are_not_reported_as_passed():
    model = hf("llama").eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.fill_(math.nan)
    with pytest.warns(UserWarning, match="cannot verify"):
        report = convert(model).lmbp_report
    assert report.verification == CANNOT_VERIFY and report.verified is None
    assert report.relative_error is None
    text = str(report)
    assert "CANNOT VERIFY" in text and "passed" not in text and "0.00e+00" not in text
    assert report.to_dict()["verification"] == CANNOT_VERIFY


def test_nan_appearing_only_after_a_rewrite_is_rolled_back(monkeypatch):
    model = hf("llama").eval()
    target = model.model.layers[1].mlp.gate_proj.weight
    real = rewrite_mod.fold_affine

    def nan_fold(weight, bias, gamma, beta, layout="out_in"):
        w, b = real(weight, bias, gamma, beta, layout)
        if weight is target:
            w = w.clone()
            w[0, 0] = math.nan
        return w, b

    monkeypatch.setattr(rewrite_mod, "fold_affine", nan_fold)
    report = convert(model, fold_norms=True).lmbp_report  # a wrong fold to catch
    assert [label for label, _ in report.rolled_back] == ["norm model.layers.1.post_attention_layernorm"]
    assert report.verification == PASSED and math.isinf(report.rolled_back[0][1])


# ------------------------------------------------------------------------------ half precision: a calibrated budget
def _bf16(family):
    from testsupport.families import registry

    return registry()[family]().to(torch.bfloat16).eval()


def _noise_note(report):
    return next(n for n in report.notes if n.startswith("verification tolerance"))


def test_bf16_fold_with_a_few_percent_error_is_rolled_back(monkeypatch):
    """The q/k/v weights of one fold 6 % off change LLaMA's bf16 logits by ~3 %: within the old fixed budget
    (5e-2), above this model's calibrated one (4× its own 0.5 % rounding noise): rolled back, with its error."""
    real = rewrite_mod.fold_affine
    calls = []

    def corrupt(weight, bias, gamma, beta, layout="out_in"):  # the first norm's three Linears folded 6 % off
        w, b = real(weight, bias, gamma, beta, layout)
        calls.append(1)
        return (w * 1.06 if len(calls) <= 3 else w), b

    monkeypatch.setattr(rewrite_mod, "fold_affine", corrupt)
    model = _bf16("llama")
    report = convert(model, fold_norms=True, measure=False).lmbp_report
    assert [label for label, _ in report.rolled_back] == ["norm model.layers.0.input_layernorm"], str(report)
    err = report.rolled_back[0][1]
    assert report.rtol < err < 5e-2, (report.rtol, err)  # the fixed budget would have let it through
    assert report.verified and report.relative_error <= report.rtol, str(report)
    assert any(s.name == "model.layers.0.input_layernorm" and "rolled back" in s.reason for s in report.plan.skips)
    assert "4× the model's own rounding noise" in _noise_note(report)


@pytest.mark.parametrize("family", ["llama", "t5", "vit"])
def test_correct_bf16_conversion_passes_the_calibrated_budget(family):
    """A correct bf16 conversion passes, and independently of the library's verdict: its outputs are as close to
    the fp32 model's as the bf16 original's are (ratio measured ≤ 1.9 over 12 families, budget 4)."""
    from lmbp_convert.apply.verify import NOISE_FACTOR, _fp32_input, run_probe
    from lmbp_convert.trace.probe import make_probe

    model = _bf16(family)
    fp32 = copy.deepcopy(model).float()  # bf16 → fp32 is exact: the same weights
    probe = make_probe(model)[0]
    ref16, ref32 = run_probe(model, probe), run_probe(fp32, _fp32_input(probe))
    report = convert(model, measure=False).lmbp_report
    assert report.verification == PASSED and not report.rolled_back, str(report)
    noise = compare_outputs(ref16, ref32).error
    assert 1e-4 < noise < 5e-2
    assert NOISE_FACTOR * noise * (1 - 1e-9) <= report.rtol < 5e-2  # the worst input's noise; this is one of them
    got = run_probe(model, probe)
    assert compare_outputs(got, ref32).error <= 2.5 * noise, (compare_outputs(got, ref32).error, noise)
    assert compare_outputs(got, ref16).error <= report.rtol


def test_user_rtol_wins_and_fp32_keeps_the_fixed_budget():
    model = _bf16("llama")
    report = convert(model, rtol=0.3, measure=False).lmbp_report
    assert report.rtol == 0.3 and not any(n.startswith("verification tolerance") for n in report.notes)
    from testsupport.families import FAMILIES

    assert convert(FAMILIES["llama"](), measure=False).lmbp_report.rtol == 1e-4


def test_calibration_that_does_not_fit_keeps_the_fixed_budget(monkeypatch):
    """Measuring the noise needs fp32 copies of the weights: where twice that is more than the memory free, or an
    out-of-memory stops it, convert() keeps the fixed budget and says why; the weights are back in bf16."""
    import lmbp_convert.apply.convert as conv
    import lmbp_convert.apply.verify as ver

    model = _bf16("llama")
    need = ver.fp32_copy_bytes(model)
    assert need == 4 * sum(p.numel() for p in model.parameters() if p.dtype == torch.bfloat16) + \
        4 * sum(b.numel() for b in model.buffers() if b.dtype == torch.bfloat16)
    monkeypatch.setattr(conv, "free_bytes", lambda device: 2 * need - 1)
    report = convert(model, measure=False).lmbp_report
    assert report.rtol == 5e-2 and any("more than half the memory free now" in n for n in report.notes), report.notes

    model = _bf16("llama")
    buffers = {n: b.dtype for n, b in model.named_buffers()}
    monkeypatch.setattr(conv, "free_bytes", lambda device: 2 * need)
    real_run = ver.run_probe

    def out_of_memory_in_fp32(m, probe):  # only the calibration's fp32 forward runs out of memory
        if next(m.parameters()).dtype == torch.float32:
            raise torch.OutOfMemoryError("fp32")
        return real_run(m, probe)

    monkeypatch.setattr(ver, "run_probe", out_of_memory_in_fp32)
    report = convert(model, measure=False).lmbp_report
    assert report.rtol == 5e-2 and any("ran out of memory" in n for n in report.notes), report.notes
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert {n: b.dtype for n, b in model.named_buffers()} == buffers
