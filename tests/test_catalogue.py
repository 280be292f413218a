import json
import re
from pathlib import Path

from torch import nn

from lmbp_convert.catalogue import Catalogue, class_key, load_catalogue

ROOT = Path(__file__).resolve().parents[1]


def test_catalogue_roles():
    cat = load_catalogue()
    assert cat.activation_kind(nn.GELU()) == "gelu"
    assert cat.activation_kind(nn.GELU(approximate="tanh")) == "gelu_tanh"
    assert cat.activation_kind(nn.ReLU()) is None
    assert cat.norm_entry(nn.LayerNorm(4))["kind"] == "layer"
    assert cat.linear_layout(nn.Linear(2, 2)) == "out_in"
    assert cat.dropout_p(nn.Dropout(0.25)) == 0.25
    from transformers.activations import QuickGELUActivation
    from transformers.pytorch_utils import Conv1D

    assert cat.activation_kind(QuickGELUActivation()) == "quick_gelu"
    assert cat.linear_layout(Conv1D(2, 3)) == "in_out"


def test_every_catalogue_class_exists():
    """An entry for a class that moved or was renamed would silently never match."""
    import importlib

    data = json.loads((ROOT / "patterns" / "catalogue.json").read_text())
    for section in ("activations", "norms", "linears", "dropouts", "identities"):
        keys = {e["class"] for e in data[section]}
        for entry in data[section]:
            mod, _, qual = entry["class"].partition(":")
            obj = importlib.import_module(mod)
            for part in qual.split("."):
                obj = getattr(obj, part)
            # an old name may now alias a class listed under its new name (PytorchGELUTanh → GELUTanh)
            assert class_key(obj) in keys, entry["class"]


def test_family_regex_covers_unlisted_norm_classes():
    cat = Catalogue.from_dict({"norm_families": [{"name_regex": "(?i).*rms_?norm$", "exclude_regex": ".*2d.*"}]})

    class FooRMSNorm(nn.Module):
        pass

    class RmsNorm2d(nn.Module):
        pass

    assert cat.norm_entry(FooRMSNorm()) is not None and cat.norm_entry(RmsNorm2d()) is None


def test_every_package_directory_is_listed_in_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"(lmbp_convert(?:\.\w+)*)"', text))
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "lmbp_convert").rglob("__init__.py")}
    assert found <= listed, found - listed
    assert "lmbp_convert.patterns" in listed
