"""Families the issue does not list: the walker is generic, so they convert (or say why not) with no per-model
code. Each must verify; the expectations record how many norms each architecture converts (exact norms, the
default: the norms a fold would rewrite and those that would keep their affine)."""
import copy

import pytest
import torch

from lmbp_convert import convert
from lmbp_convert.match.norm_exact import NormExact
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.trace.tracer import call_model
from testsupport.families import hf

SMALL_LM = dict(num_key_value_heads=2)
CASES = {
    # arch: (overrides, head, minimum exact norms, minimum gated MLPs, a skip reason that must appear or None)
    "phi3": (dict(SMALL_LM, pad_token_id=0), "causal", 5, 2, None),
    "qwen3": (dict(SMALL_LM, head_dim=16), "causal", 5, 2, "no Linear consumer"),  # q_norm / k_norm
    "olmo2": (SMALL_LM, "causal", 1, 2, "no Linear consumer"),  # norms on block outputs feed residuals only
    "gpt_neox": ({}, "causal", 5, 0, None),
    # FalconLinear: a catalogue entry; ln_f feeds the tied head (folding, it keeps its affine; exact, it is one more)
    "falcon": (dict(num_hidden_layers=2), "causal", 3, 0, None),
    "stablelm": (SMALL_LM, "causal", 5, 2, None),
    "deit": (dict(image_size=32, patch_size=8), "base", 5, 0, None),
    # post-LN with the residual inside one forward: no fold (folding, the affine is kept; was: skipped, "no module
    # boundary"), exact norms all the same
    "distilbert": ({}, "base", 3, 0, None),
}


@pytest.mark.compat
@pytest.mark.parametrize("arch", sorted(CASES))
def test_unlisted_family(arch):
    overrides, head, min_norms, min_gated, reason = CASES[arch]
    if arch == "distilbert":
        model = _distilbert()
    else:
        model = hf(arch, head=head, **overrides)
    model.eval()
    ref = copy.deepcopy(model)
    rep = convert(model).lmbp_report
    assert rep.verified, str(rep)
    assert not rep.plan.norm_folds, str(rep)
    assert len(rep.plan.of(NormExact)) >= min_norms and len(rep.plan.gated_mlps) >= min_gated, str(rep)
    if reason:
        assert any(reason in s.reason for s in rep.plan.skips), str(rep)
    if arch == "distilbert":  # every layer norm but the last (whose output nothing keeps) is converted
        assert len(rep.plan.of(NormExact)) == 3 and not any("no module boundary" in s.reason
                                                            for s in rep.plan.skips), str(rep)
    probe = make_probe(model, batch=2, seq=9)[0]
    with torch.no_grad():
        a, b = call_model(model, probe), call_model(ref, probe)
    a = a.logits if hasattr(a, "logits") else a.last_hidden_state
    b = b.logits if hasattr(b, "logits") else b.last_hidden_state
    assert float((a - b).norm() / b.norm()) <= 1e-5


def _distilbert():
    from transformers import AutoConfig, AutoModel

    from testsupport.families import randomize_norms

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("distilbert", dim=64, hidden_dim=256, n_layers=2, n_heads=4, vocab_size=128)
    return randomize_norms(AutoModel.from_config(cfg))


RELU2 = {"persimmon": {}, "nemotron": dict(num_key_value_heads=2, head_dim=16)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("arch", sorted(RELU2))
def test_squared_relu_mlps_keep_exactly_one_intermediate_less(arch, dtype):
    """Persimmon and Nemotron (transformers' ReLUSquaredActivation, 'relu2'): the swapped activation keeps only
    its output, which down_proj keeps anyway: relu(x) (tokens × intermediate × itemsize) less per layer, exactly;
    forward and every gradient bit for bit the original's (fp32 and bf16: see lmbp_convert/ops/relu_squared.py)."""
    from lmbp_convert import SavedTensorLedger
    from lmbp_convert.match.plan import OutputActSwap

    model = hf(arch, **RELU2[arch]).to(dtype)
    ref = copy.deepcopy(model)
    rep = convert(model, norms=False, gated_mlp=False).lmbp_report
    assert rep.verified and len(rep.plan.of(OutputActSwap)) == model.config.num_hidden_layers, str(rep)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    saved = []
    for m in (ref, model):
        m.train()
        with SavedTensorLedger(m) as led:
            out = m(input_ids=ids).logits
        out.float().pow(2).mean().backward()
        saved.append((led.bytes, out.detach()))
    per_layer = ids.numel() * model.config.intermediate_size * torch.finfo(dtype).bits // 8
    assert saved[0][0] - saved[1][0] == model.config.num_hidden_layers * per_layer
    assert torch.equal(saved[0][1], saved[1][1])
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), n
