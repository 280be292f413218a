"""transformers' own save/load checks (after tests/test_modeling_common.py: test_save_load, test_can_use_safetensors,
test_load_save_without_tied_weights, test_save_load_keys_to_ignore_on_save, the base ↔ head loads of the fast-init
tests), in our words, on converted models: every post-LN family of testsupport.families and several pre-LN ones,
converted with the default (exact norms) and with ``fold_norms=True``.

Where a folded model's state dict is not a plain checkpoint (``export.saves_plainly`` false: a norm keeps γ, β for
re-applied branches and is folded into Linears as well), plain ``save_pretrained`` must raise `ExportError`, and the
checks run on the checkpoint ``lmbp_convert.export.save_pretrained`` writes. Each check compares with the
*unconverted* model: fp32, ‖Δ‖/‖ref‖ ≤ 1e-5 per output tensor.
"""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from lmbp_convert import convert
from lmbp_convert.export import ExportError, save_pretrained, saves_plainly
from lmbp_convert.trace.probe import make_probe
from testsupport.families import registry

RTOL = 1e-5
#: post-LN (norm after each residual add) families, and pre-LN ones for contrast
POST_LN = ["bart", "bert", "deberta_v2", "distilbert", "electra", "hubert", "marian", "roberta", "wav2vec2"]
PRE_LN = ["gemma", "gpt2", "llama", "vit", "whisper"]
FAST = {"bert", "gpt2"}  # the rest in the slow stage (about 5 s a family and mode on 2 cores)


def _floats(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    vals = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else []
    return [t for v in vals for t in _floats(v)]


def _same_outputs(got, want, what: str) -> None:
    a, b = _floats(got), _floats(want)
    assert len(a) == len(b) and a, (what, len(a), len(b))
    for i, (x, y) in enumerate(zip(a, b)):
        rel = float((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30))
        assert rel <= RTOL, f"{what}: output {i} off by {rel:.2e}"


def _run(model, probe):
    with torch.no_grad():
        return model(**probe)


_KEYS = ("missing_keys", "unexpected_keys", "mismatched_keys")
ANY: dict = {}  # the baseline run itself: whatever transformers reports


def _load(cls, path, baseline: dict | None = None):
    """``cls.from_pretrained(path)``, asserting that it reports no missing / unexpected / mismatched key beyond those
    the unconverted model's own checkpoint gives (``baseline``: sinusoidal positions that are never saved, a head's
    keys when a base class loads a head checkpoint). Returns the model and its loading info."""
    model, info = cls.from_pretrained(path, output_loading_info=True)
    if baseline is ANY:
        return model.eval(), info
    bad = {k: set(info[k]) - set((baseline or {}).get(k, ())) for k in _KEYS}
    assert not any(bad.values()), bad
    return model.eval(), info


def _embeddings(model):
    try:
        return model.get_input_embeddings(), model.get_output_embeddings()
    except NotImplementedError:  # speech models have no token embeddings
        return None, None


def _save(model, path, plain: bool) -> None:
    if plain:
        model.save_pretrained(path)
    else:  # plain saving refuses, loudly; the export writes the plain checkpoint
        with pytest.raises(ExportError, match="lmbp_convert.export.save_pretrained"):
            model.save_pretrained(path)
        assert not os.path.exists(os.path.join(path, "model.safetensors"))
        save_pretrained(model, path)


CASES = [pytest.param(f, fold, marks=() if f in FAST else pytest.mark.slow, id=f"{f}-{'fold' if fold else 'exact'}")
         for f in POST_LN + PRE_LN for fold in (False, True)]


@pytest.mark.parametrize("family,fold", CASES)
def test_transformers_save_load_checks(family, fold, tmp_path):
    ref = registry()[family]().eval()
    model = copy.deepcopy(ref)
    probe, _, _ = make_probe(ref, batch=2, seq=9)
    convert(model, fold_norms=fold, measure=False)
    plain = saves_plainly(model)
    assert plain or fold, "an exact conversion changes no weight: its state dict is the original's"
    want = _run(ref, probe)
    _same_outputs(_run(model, probe), want, f"{family} converted")
    first, second = tmp_path / "first", tmp_path / "second"

    # the unconverted model's own round trip: what transformers itself reports for this class
    ref.save_pretrained(tmp_path / "ref")
    _, ref_info = _load(type(ref), tmp_path / "ref", ANY)
    ref_stored = load_file(tmp_path / "ref" / "model.safetensors")

    # 1. save → from_pretrained of the unconverted class: every key, the original's outputs (test_save_load)
    _save(model, first, plain)
    loaded, _ = _load(type(ref), first, ref_info)
    _same_outputs(_run(loaded, probe), want, f"{family} reloaded")

    # 2. safetensors by default, the keys the original writes, and what the file holds is what loads
    #    (test_can_use_safetensors)
    files = set(os.listdir(first))
    assert "model.safetensors" in files and "pytorch_model.bin" not in files, files
    stored = load_file(first / "model.safetensors")
    assert set(stored) == set(ref_stored), set(stored) ^ set(ref_stored)
    sd = loaded.state_dict()
    for k, v in stored.items():
        if k in sd:
            assert torch.equal(sd[k], v), k

    # 3. keys the class leaves out of a save are left out (test_save_load_keys_to_ignore_on_save)
    for pattern in getattr(ref, "_keys_to_ignore_on_save", None) or []:
        assert not any(pattern in k for k in stored), pattern

    # 4. tied weights: tied after loading exactly when the saved config ties them (test_load_save_without_tied_weights)
    cfg = json.loads((first / "config.json").read_text())
    ins, outs = _embeddings(loaded)
    if ins is not None and outs is not None:
        tied = outs.weight is ins.weight
        assert tied == bool(cfg.get("tie_word_embeddings", getattr(ref.config, "tie_word_embeddings", False))), cfg

    # 5. save the loaded model again: the same tensors, bit for bit (a round trip is a fixed point)
    loaded.save_pretrained(second)
    again = load_file(second / "model.safetensors")
    assert set(again) == set(stored) and all(torch.equal(again[k], stored[k]) for k in stored)

    # 6. the base model from the head checkpoint gives what the base class loaded from the original's own head
    #    checkpoint gives, outputs and key report (the fast-init base ↔ head loads). Exact norms only: a fold is judged by
    #    what the whole model returns, so a norm whose output only the base returns (BERT's last LayerNorm, folded
    #    into the pooler) loads into a base alone as x̂ (0.66 off); docs/usage.md says so
    base = getattr(ref, "base_model", ref)
    if base is not ref and not fold:
        torch.manual_seed(0)  # keys the head checkpoint lacks (RoBERTa's pooler) start from the same draws
        expected, base_info = _load(type(base), tmp_path / "ref", ANY)
        torch.manual_seed(0)
        got, _ = _load(type(base), first, base_info)
        _same_outputs(_run(got, probe), _run(expected, probe), f"{family} base from head checkpoint")
