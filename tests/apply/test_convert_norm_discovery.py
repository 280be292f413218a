"""Real families whose norms only behaviour finds: Nemotron's LayerNorm1P (γ = 1 + w, a name no catalogue
lists) and OLMo's affine-free LayerNorm (no weight, no bias, eps only in code). Plain convert(), verified, and
the bytes saved for backward counted exactly (SavedTensorLedger)."""
import copy

import pytest
import torch

from lmbp_convert import SavedTensorLedger, convert
from lmbp_convert.enums import WeightParam
from lmbp_convert.match.norm_exact import NormExact
from lmbp_convert.match.plan import NormSwap, OutputActSwap
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.trace.tracer import call_model
from testsupport.families import hf

SMALL = dict(num_key_value_heads=2)


def _saved(model, probe, mode):
    model.train()
    with SavedTensorLedger(model) as led:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            call_model(model, probe)
    return led.bytes


def _convert_and_measure(arch, mode):
    model = hf(arch, **SMALL)
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    model.eval()
    ref = copy.deepcopy(model)
    rep = convert(model).lmbp_report  # no probe: convert() builds it
    assert rep.verification == "passed", str(rep)
    probe, _, _ = make_probe(ref, batch=2, seq=32)
    before, after = _saved(ref, probe, mode), _saved(model, probe, mode)
    print(f"{arch} {mode}: {before} -> {after} bytes ({1 - after / before:.1%})")
    return model, rep, before, after


# measured exactly (fp32 is exact; bf16/autocast depend on the CPU kernels, so they get a floor); in fp32 the 5
# affine-free norms replay their original (ops/replay_norm.py): no per-row rstd (64 tokens × 4 bytes) kept
OLMO = {"fp32": (795648, 450304 - 5 * 64 * 4)}


@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast"])
def test_olmo_affine_free_norms_become_memory_sharing(mode):
    model, rep, before, after = _convert_and_measure("olmo", mode)
    swaps = rep.plan.of(NormSwap)
    assert len(swaps) == 5 and not rep.plan.skips, str(rep)  # 2 layers × 2 + final; none "nothing to fold"
    assert all(s.eps == pytest.approx(1e-5) for s in swaps)  # fitted: OlmoLayerNorm has no eps attribute
    assert not list(model.model.norm.parameters()) and not list(model.model.norm.buffers())  # same state dict
    assert 1 - after / before >= 0.35, (before, after)
    if mode == "fp32":
        assert (before, after) == OLMO["fp32"]


# 481024 before squared ReLU kept only its output: 2 layers × 64 tokens × 256 channels × 4 bytes of relu(x) less;
# in fp32 the 5 exact norms replay their original (ops/replay_norm.py): no per-row rstd (64 tokens × 4 bytes) kept
NEMOTRON = {"fp32": (565504, 481024 - 2 * 64 * 256 * 4 - 5 * 64 * 4)}


@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast"])
def test_nemotron_layernorm1p_folds_as_one_plus_w(mode):
    model, rep, before, after = _convert_and_measure("nemotron", mode)
    folds = rep.plan.of(NormExact)  # the exact default: γ = 1 + w kept; the bytes are the fold's
    assert len(folds) == 5 and not rep.plan.norm_folds, str(rep)  # was NothingToConvertError
    # its squared-ReLU activations (relu2) keep only their output, which the down projection keeps anyway
    assert not rep.plan.skips, str(rep)
    assert [a.act for a in rep.plan.of(OutputActSwap)] == ["relu2", "relu2"], str(rep)
    assert all(f.param is WeightParam.ONE_PLUS_W and f.has_bias for f in folds)
    assert after < before
    assert type(model.model.layers[0].mlp.act_fn).__name__ == "MSReLUSquared"
    assert not rep.plan.act_swaps and not rep.plan.gated_mlps
    if mode == "fp32":
        assert (before, after) == NEMOTRON["fp32"]


def test_olmo_norm_swaps_save_exactly_each_norms_input_and_mean():
    """The swaps alone, against the same conversion without them: each affine-free norm keeps one (rows × d)
    fp32 tensor where LayerNorm kept its input and the Linears its output (in fp32 it replays the original from
    its input, the Linears' copy rebuilt from it), and neither LayerNorm's per-row mean nor its rstd."""
    from lmbp_convert.match.kinds import suspended

    _, _, _, with_swaps = _convert_and_measure("olmo", "fp32")
    with suspended(NormSwap):
        _, rep, before, without = _convert_and_measure("olmo", "fp32")
    assert not rep.plan.of(NormSwap)
    rows, d = 2 * 32, 64
    assert without - with_swaps == 5 * (rows * d * 4 + 2 * rows * 4) == 84480
    print(f"olmo fp32 without swaps: {1 - without / before:.1%}, with: {1 - with_swaps / before:.1%}")
