"""Verification cannot be fooled by non-finite values: NaN never passes, inf positions must match exactly."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import lmbp_convert.apply.rewrite as rewrite_mod
from lmbp_convert import convert
from lmbp_convert.apply.verify import CANNOT_VERIFY, FAILED, PASSED, compare_outputs
from lmbp_convert.trace.tracer import call_model
from benchmarks.families import hf

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
