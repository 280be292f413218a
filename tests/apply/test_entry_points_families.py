"""Every door a user can call on its own returns the original's values after convert(), on every family of the
conversion matrix (issue 20, item 1): HF backbones (`base_model`), encoders (`get_encoder()`), timm's
`forward_features` / `forward_head(pre_logits=True)` and a classifier reset after convert. The doors are found on
the model (nothing listed per family); each is fed what it receives inside the model's own forward on the
package's probe (captured by a pre-hook on the original). Both modes: the exact default, and ``fold_norms=True``,
where a fold such a door could see stays exact (match/doors.py)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lmbp_convert import convert
from lmbp_convert.apply.verify import compare_outputs
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.trace.tracer import call_model
from testsupport.families import FAMILIES as DENSE, registry

FAMILIES = registry()
TOL = 1e-5
MODES = {"exact": {}, "fold": {"fold_norms": True}}  # the defaults; the fold, doors kept exact
#: over 3 s a family on a 2-core CPU; the fast loop runs the dense families (testsupport.families.FAMILIES)
SLOW = {"albert", "timm_convnext", "timm_hiera_160", "timm_pvt_v2", "timm_swin"}
CASES = [f if f in DENSE and f not in SLOW else pytest.param(f, marks=pytest.mark.slow) for f in sorted(FAMILIES)]


def _submodule_doors(model: nn.Module) -> dict[str, nn.Module]:
    """Submodules a user calls on their own: the backbone under a head, an encoder-decoder's encoder."""
    doors = {}
    base = getattr(model, "base_model", None)
    if isinstance(base, nn.Module) and base is not model:
        doors["base_model"] = base
    get_encoder = getattr(model, "get_encoder", None)
    if callable(get_encoder):
        try:
            enc = get_encoder()
        except Exception:  # noqa: BLE001 - a decoder-only model's inherited get_encoder may refuse: no such door
            enc = None
        if isinstance(enc, nn.Module) and enc is not model and enc is not base:
            doors["get_encoder()"] = enc
    return doors


def _inputs_of(model: nn.Module, sub: nn.Module, probe) -> tuple[tuple, dict]:
    """The (args, kwargs) ``sub`` is called with during ``model``'s forward on ``probe``; for a door the forward
    goes around (OPT's head calls ``model.decoder``, not ``model``), the probe the package builds for it."""
    seen = []
    handle = sub.register_forward_pre_hook(lambda m, a, kw: seen.append((a, kw)) if not seen else None,
                                           with_kwargs=True)
    try:
        call_model(model, probe)
    finally:
        handle.remove()
    if seen:
        return seen[0]
    own, _, _ = make_probe(sub)
    if isinstance(own, dict):
        return (), own
    return (tuple(own) if isinstance(own, (list, tuple)) else (own,)), {}


def _same(got, want) -> float:
    cmp = compare_outputs(got, want)
    assert cmp.mismatch is None and cmp.compared > 0, cmp
    return cmp.error


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("family", CASES)
def test_every_door_returns_the_original_values(family, mode):
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    ref = copy.deepcopy(model)
    report = convert(model, **MODES[mode]).lmbp_report
    assert report.verified, str(report)
    opened = []
    with torch.no_grad():
        mine, theirs = _submodule_doors(model), _submodule_doors(ref)
        assert mine.keys() == theirs.keys()
        probe, _, _ = make_probe(ref)
        for door, sub in mine.items():
            args, kwargs = _inputs_of(ref, theirs[door], probe)
            assert _same(sub(*args, **kwargs), theirs[door](*args, **kwargs)) <= TOL, (family, door)
            opened.append(door)
        if callable(getattr(model, "forward_features", None)) and callable(getattr(model, "forward_head", None)):
            x, _, _ = make_probe(ref)
            feats = ref.forward_features(x)
            assert _same(model.forward_features(x), feats) <= TOL, (family, "forward_features")
            want = ref.forward_head(feats, pre_logits=True)
            assert _same(model.forward_head(feats, pre_logits=True), want) <= TOL, (family, "forward_head")
            model.reset_classifier(0)
            ref.reset_classifier(0)
            assert _same(model(x), ref(x)) <= TOL, (family, "reset_classifier(0)")
            opened += ["forward_features", "forward_head(pre_logits=True)", "reset_classifier(0)"]
    if not opened:  # a bare backbone or a model with no other door: its own forward is the door verification saw
        pytest.skip(f"{family}: no door besides the model's own forward")
