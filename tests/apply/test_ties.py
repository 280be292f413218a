"""An untied convert stays untied: transformers' own re-tying (tie_weights, resize_token_embeddings) reads the
config, which convert() updates, so the folded head keeps its weight and the outputs stay the original's."""
import copy

import pytest
import torch

from lmbp_convert import convert
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
def test_tie_weights_after_an_untied_convert_keeps_outputs(arch):
    model, ref = _untied(arch)
    assert model.config.tie_word_embeddings is False
    assert not any(k.endswith("lm_head.weight") for k in getattr(model, "all_tied_weights_keys", {}))
    model.tie_weights()
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    assert _rel(_logits(model), _logits(ref)) <= 1e-5


# llama only: GPT-2's folded head takes ln_f's β through a forward hook on lm_head (it has no bias), and resizing
# replaces that module (a head replaced after convert: issue 20 item 1, not a tie)
@pytest.mark.parametrize("arch", ["llama"])
def test_resize_token_embeddings_after_an_untied_convert_keeps_outputs(arch):
    model, ref = _untied(arch)
    vocab = model.get_input_embeddings().weight.shape[0]
    torch.manual_seed(0)
    model.resize_token_embeddings(vocab + 8)
    assert model.get_output_embeddings().weight.shape[0] == vocab + 8
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    # the old tokens' logits are the original model's (new rows are new tokens: nothing to compare)
    assert _rel(_logits(model)[..., :vocab], _logits(ref)) <= 1e-5


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
