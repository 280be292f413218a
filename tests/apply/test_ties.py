"""An untied convert stays untied: transformers' own re-tying (tie_weights, resize_token_embeddings) reads the
config, which convert() updates, so the folded head keeps its weight and the outputs stay the original's."""
import copy

import pytest
import torch

from lmbp_convert import convert
from lmbp_convert.match.plan import NormFold
from lmbp_convert.trace.tracer import call_model
from testsupport.families import hf

IDS = torch.tensor([[3, 17, 42, 9, 100, 5], [7, 7, 1, 64, 2, 90]])


def _logits(model, ids=IDS):
    with torch.no_grad():
        return call_model(model.eval(), {"input_ids": ids}).logits


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _untied(arch):
    model = hf(arch, tie_word_embeddings=True)
    ref = copy.deepcopy(model).eval()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    rep = convert(model, untie=True, fold_norms=True).lmbp_report
    head = model.get_output_embeddings()
    assert head.weight is not model.get_input_embeddings().weight, "the fold did not untie the head"
    assert rep.verified and any("tie_word_embeddings is now False" in n for n in rep.notes), str(rep)
    return model, ref


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_tie_weights_after_an_untied_convert_keeps_outputs(arch):
    model, ref = _untied(arch)
    assert model.config.tie_word_embeddings is False
    assert not any(k.endswith("lm_head.weight") for k in getattr(model, "all_tied_weights_keys", {}))
    model.tie_weights()
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    assert _rel(_logits(model), _logits(ref)) <= 1e-5


# GPT-2's folded head takes ln_f's β through a shift hook (the head has no bias); resizing replaces the head module,
# and the hook follows it (apply/hooks.py FollowModule): before, the old tokens' logits were 0.27 off
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_resize_token_embeddings_after_an_untied_convert_keeps_outputs(arch):
    model, ref = _untied(arch)
    vocab = model.get_input_embeddings().weight.shape[0]
    for m in (model, ref):
        torch.manual_seed(0)  # the same draws for the new embedding rows
        m.resize_token_embeddings(vocab + 8)
    head = model.get_output_embeddings()
    assert head.weight.shape[0] == vocab + 8
    assert head.weight is not model.get_input_embeddings().weight
    # the old tokens' logits are the original model's
    assert _rel(_logits(model)[..., :vocab], _logits(ref)[..., :vocab]) <= 1e-5
    # the new rows w of the folded head are an original head's w / γ: that original, untied, gives every logit,
    # new tokens' inputs and columns included
    name = next(n for n, m in model.named_modules() if m is head)
    plan = model.lmbp_report.plan
    fold = next(f for k in plan.kinds() if issubclass(k, NormFold) for f in plan.of(k)
                if any(t.name == name for t in f.targets))
    gamma = ref.get_submodule(fold.name).weight.detach()
    rows = torch.cat([ref.get_input_embeddings().weight.detach()[:vocab], head.weight.detach()[vocab:] / gamma])
    ref.set_output_embeddings(torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False))
    with torch.no_grad():
        ref.get_output_embeddings().weight.copy_(rows)
    ids = torch.cat([IDS, IDS.new_tensor([[vocab, vocab + 3, 5, vocab + 7, 1, 2]])])
    assert _rel(_logits(model, ids), _logits(ref, ids)) <= 1e-5


def test_a_tied_convert_leaves_the_config_tied():
    """Without untie the tied head is not folded (its norm keeps the affine): nothing untied, nothing changed."""
    model = hf("llama", tie_word_embeddings=True)
    rep = convert(model).lmbp_report
    assert model.config.tie_word_embeddings is True
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert not any("tie_word_embeddings" in n for n in rep.notes)


def test_the_config_change_is_undone_with_the_conversion(monkeypatch):
    """convert() is a transaction: an exception after the untie restores the config and the tie map too."""
    import lmbp_convert.apply.convert as conv

    model = hf("llama", tie_word_embeddings=True)
    keys = dict(getattr(model, "all_tied_weights_keys", {}))
    monkeypatch.setattr(conv, "_warn_orphans", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        convert(model, untie=True, fold_norms=True)
    assert model.config.tie_word_embeddings is True
    assert dict(getattr(model, "all_tied_weights_keys", {})) == keys
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
