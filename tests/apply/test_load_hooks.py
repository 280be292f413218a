"""An original checkpoint loaded into a *real* converted model, fold mode, norms whose affine is re-applied (issue
20, item 5).

A post-LN norm (BERT, BART, wav2vec2, ...; also a pre-LN model's final norm that the model returns) keeps γ, β as
parameters for the re-applied branches, so its entries look the same in the original checkpoint and in the
converted model's own state dict; only the Linears differ (W vs W·diag(γ)). The own state dict carries
``<norm>.lmbp_folded`` (`FOLD_MARKER`), an original lacks it: the load folds an original as it arrives and loads the
own one as it is. Every case is compared with the plain model loaded the same way.
"""
from __future__ import annotations

import copy
import io

import pytest
import torch

from lmbp_convert import convert
from lmbp_convert.match.plan import NormFold
from lmbp_convert.nn.norms import FOLD_MARKER
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.trace.tracer import call_model
from testsupport.families import registry

# families of the conversion matrix whose fold-mode conversion folds a norm into Linears (or parameters of
# functional consumers: SigLIP's attention head) *and* re-applies its affine; bert and bart in the fast loop, the rest
# `slow`. (ViT's and CLIP's re-applied final norms fold into nothing: their state dict is plain.)
REAPPLIED = ["bert", "bart"]
REAPPLIED_SLOW = ["roberta", "electra", "deberta_v2", "bert_multiple_choice", "bert2bert", "bart_classifier", "mbart",
                  "marian", "pegasus", "whisper", "speech_to_text", "wav2vec2", "wav2vec2_bert", "wavlm", "siglip",
                  "vit_gpt2"]
FAMILIES = REAPPLIED + [pytest.param(n, marks=pytest.mark.slow) for n in REAPPLIED_SLOW]
PRE_LN = ["llama", "gpt2"]  # control: folded norms hold identity buffers, no marker
ORDERS = ["full", "twice", "halves", "halves_reversed"]


def _out(model, probe) -> torch.Tensor:
    with torch.no_grad():
        out = call_model(model.eval(), probe)
    vals = [out] if isinstance(out, torch.Tensor) else [v for v in out.values() if isinstance(v, torch.Tensor)]
    return torch.cat([v.flatten().double() for v in vals])


def _perturbed(model, seed: int, scale: float):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((scale * torch.randn(p.shape, generator=gen)).to(p.dtype))
    return model


def _load(model, sd: dict, order: str):
    """``sd`` into ``model``: in one call, the same call twice, or in two halves (``strict=False``) either way."""
    keys = list(sd)
    if order in ("full", "twice"):
        for _ in range(2 if order == "twice" else 1):
            model.load_state_dict(sd)
        return model
    half = len(keys) // 2
    parts = [keys[:half], keys[half:]]
    for part in parts if order == "halves" else parts[::-1]:
        model.load_state_dict({k: sd[k] for k in part}, strict=False)
    return model


class _Case:
    """One family: the plain model, its fold-mode conversion (real weights), another original checkpoint."""

    def __init__(self, name: str):
        build = registry()[name]
        self.plain = build().eval()
        self.probe = make_probe(self.plain, batch=2, seq=9)[0]
        self.converted = convert(copy.deepcopy(self.plain), fold_norms=True)
        self.reapplied = [it.name for it in self.converted.lmbp_report.plan.items  # folded and re-applied norms
                          if isinstance(it, NormFold) and it.reapply and (it.targets or it.param_targets())]
        self.original = _perturbed(build(), seed=1, scale=0.05).state_dict()  # other original weights


_CASES: dict[str, _Case] = {}


def _case(name: str) -> _Case:
    if name not in _CASES:
        _CASES.clear()  # one family's models alive at a time
        _CASES[name] = _Case(name)
    return _CASES[name]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", FAMILIES + PRE_LN)
@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_original_checkpoint_loads_as_into_the_plain_model(name, order):
    c = _case(name)
    if name not in PRE_LN:
        assert c.reapplied, str(c.converted.lmbp_report)
    want = _out(_load(copy.deepcopy(c.plain), c.original, order), c.probe)
    got = _out(_load(copy.deepcopy(c.converted), c.original, order), c.probe)
    assert float((got - want).abs().max()) <= 1e-5, (name, order)


@pytest.mark.parametrize("order", ["full", "halves", "halves_reversed"])
@pytest.mark.parametrize("name", FAMILIES + PRE_LN)
def test_own_state_dict_round_trip(name, order):
    """``torch.save(model.state_dict())`` after some training, loaded into the converted model: bit for bit."""
    c = _case(name)
    trained = _perturbed(copy.deepcopy(c.converted), seed=2, scale=0.01)
    buf = io.BytesIO()
    torch.save(trained.state_dict(), buf)
    buf.seek(0)
    own = torch.load(buf)
    markers = {k for k in own if k.endswith(f".{FOLD_MARKER}")}
    assert markers == {f"{n}.{FOLD_MARKER}" for n in c.reapplied}
    model = _load(copy.deepcopy(c.converted), own, order)
    back = model.state_dict()
    assert set(back) == set(own)
    for k, v in own.items():
        assert torch.equal(back[k], v), k
    assert torch.equal(_out(model, c.probe), _out(trained, c.probe))


def _fold_of(c: _Case):
    fold = next(f for f in c.converted.lmbp_report.plan.norm_folds if f.reapply and f.targets)
    norm = [f"{fold.name}.weight"] + ([f"{fold.name}.bias"] if fold.has_bias else [])
    linears = [f"{t.name}.{k}" for t in fold.targets for k in ("weight", "bias")]
    return fold, norm, linears


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_marker_in_the_call_after_its_norm_is_resolved():
    """A shard boundary between a norm's γ, β and its marker: γ, β are taken for an original's until the marker
    arrives; nothing was folded yet (the Linears come later), so the checkpoint loads as the own one."""
    c = _case("bert")
    own = _perturbed(copy.deepcopy(c.converted), seed=3, scale=0.01).state_dict()
    fold, norm, _ = _fold_of(c)
    first = {k: own[k] for k in norm}
    model = copy.deepcopy(c.converted)
    model.load_state_dict(first, strict=False)
    model.load_state_dict({k: v for k, v in own.items() if k not in first}, strict=False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, own[k]), k


@pytest.mark.parametrize("split", ["linears_with_norm", "marker_alone_after"])
@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_marker_after_its_fold_was_applied_fails_the_load(split):
    """The undecidable case is loud: the own state dict's norm and Linears arrive without their marker (so they
    are folded as an original's), then the marker arrives."""
    c = _case("bert")
    own = c.converted.state_dict()
    fold, norm, linears = _fold_of(c)
    marker = f"{fold.name}.{FOLD_MARKER}"
    first = norm + (linears[:1] if split == "linears_with_norm" else linears)
    model = copy.deepcopy(c.converted)
    model.load_state_dict({k: own[k] for k in first}, strict=False)
    rest = [k for k in own if k not in first] if split == "linears_with_norm" else [marker]
    with pytest.raises(RuntimeError, match=FOLD_MARKER):
        model.load_state_dict({k: own[k] for k in rest}, strict=False)


def test_strict_original_load_reports_no_marker_missing_and_the_state_dict_marks_the_fold():
    c = _case("bert")
    model = copy.deepcopy(c.converted)
    res = model.load_state_dict(c.original)
    assert not res.missing_keys and not res.unexpected_keys
    assert {k for k in model.state_dict() if k.endswith(FOLD_MARKER)} == {f"{n}.{FOLD_MARKER}" for n in c.reapplied}


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_meta_converted_model_takes_an_own_state_dict():
    """Converted on meta, the Linears hold nothing yet and the state dict has no marker; the own state dict of a
    real converted model (marked) loads as it is, not folded a second time."""
    c = _case("bert")
    with torch.device("meta"):
        model = registry()["bert"]()
    convert(model, fold_norms=True)
    model.to_empty(device="cpu")
    assert not any(k.endswith(FOLD_MARKER) for k in model.state_dict())
    own = c.converted.state_dict()
    model.load_state_dict(own)
    for n, b in c.converted.named_buffers():  # non-persistent buffers (position ids): re-created by the user
        if n not in own:
            model.get_buffer(n).copy_(b)
    assert torch.equal(_out(model, c.probe), _out(c.converted, c.probe))
