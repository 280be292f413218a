"""Families whose input convert() must build by itself (encoder-decoders, speech, dual encoders, multiple choice,
timm models built at a non-default size): a plain ``convert(model)`` traces, verifies and saves bytes."""
import copy

import pytest
import torch

from lmbp_convert import SavedTensorLedger, convert
from lmbp_convert.apply.verify import float_tensors
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.trace.tracer import call_model
from testsupport.families import PROBE_FAMILIES

# Families that save less than 20 % in fp32 on these tiny configs, with the skip reason the report gives for the
# norms left as they are (matcher gaps other work addresses): the test accepts ≥ 20 % or that reason.
# In-layer post-LN norms (BART, Marian, HuBERT, wav2vec2: the residual add in the layer's own forward) keep their
# affine as memory-sharing norms now (match/norm_kept.py): BART 11.4 → 21.1 %, Marian 12.1 → 22.3 %, so they left
# this table. What is left below 20 % on these one-layer configs is a norm whose output reaches its Linears only
# through a training-time dropout (which then keeps its own output, not the norm's).
DROPOUT_BLOCK = "dropout (p=0.1)"
BELOW_20 = {
    "bart_classifier": DROPOUT_BLOCK,  # 19.1 %: layernorm_embedding → dropout → q/k/v; was 11.4 % (post-LN)
    "hubert": DROPOUT_BLOCK,  # 16.9 % (was 13.9 %): encoder.layer_norm → dropout → layer 0; conv front end
    "wav2vec2": DROPOUT_BLOCK,  # 16.9 % (was 13.9 %): the same layout as HuBERT
    "timm_mixer_160": "no Linear consumer reachable",  # 13.2 %: norm1 feeds the token-mixing MLP (transposed)
}
# Hiera converts every norm and activation it has (nothing skipped) but saves 19.0 %: on this tiny config the
# attention probabilities and its mask-unit reshapes dominate; a floor below the measured figure guards regressions.
FLOOR = {"timm_hiera_160": 0.18,
         # 15.7 % (was 13.5 %, when its final norm, feeding the tied lm_head, was skipped; now its affine is kept):
         # its FFNs use ReLU (approx-BP swaps GELU/SiLU-like activations) and the conv subsampler keeps its inputs
         "speech_to_text": 0.15}


def _saved(model, probe):
    """fp32 bytes saved for backward by a training forward on the probe (dropout off: both runs see one function)."""
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    torch.manual_seed(0)
    with SavedTensorLedger(model) as led:
        out = call_model(model, probe)
    sum(t.float().pow(2).mean() for t in float_tensors(out)).backward()
    return led.bytes


@pytest.mark.parametrize("family", sorted(PROBE_FAMILIES))
def test_plain_convert_builds_its_probe_verifies_and_saves(family):
    model = PROBE_FAMILIES[family]().eval()
    ref = copy.deepcopy(model)
    report = convert(model).lmbp_report  # no probe given: convert() builds it
    assert report.verification == "passed", str(report)
    probe, _, _ = make_probe(ref)
    before, after = _saved(ref, probe), _saved(model, probe)
    reduction = 1 - after / before
    print(f"{family}: {before} -> {after} saved bytes ({reduction:.1%})")
    assert after < before, (family, before, after)
    reason = BELOW_20.get(family)
    explained = reason is not None and any(reason in s.reason for s in report.plan.skips)
    assert reduction >= FLOOR.get(family, 0.20) or explained, (family, f"{reduction:.1%}", str(report))
