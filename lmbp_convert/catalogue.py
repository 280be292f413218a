"""Load the pattern catalogue (``patterns/catalogue.json``, shipped in the wheel) and answer role queries.

The catalogue is data: which classes are activations (and of which kind), norms (and how their weight is
parameterised), Linear-like layers (and their weight layout), dropouts. Matching is by the class's
``module:QualName`` string, so nothing is imported to look a class up.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from torch import nn


def class_key(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}:{cls.__qualname__}"


@dataclass(frozen=True)
class LoraLayout:
    """Where a LoRA-wrapped Linear (PEFT) keeps its parts: the attribute names of its base layer and of its
    per-adapter containers (adapter name → module)."""

    base: str
    adapters_a: str
    adapters_b: str
    dropout: str

    @classmethod
    def from_entry(cls, entry: dict) -> "LoraLayout":
        return cls(entry["base"], entry["adapters_A"], entry["adapters_B"], entry["dropout"])


@dataclass(frozen=True)
class Catalogue:
    activations: dict[str, dict]
    norms: dict[str, dict]
    norm_families: tuple[tuple[re.Pattern, re.Pattern | None], ...]
    eps_attributes: tuple[str, ...]
    linears: dict[str, dict]
    dropouts: dict[str, dict]
    identities: frozenset[str]
    lora_linears: dict[str, LoraLayout]

    @classmethod
    def from_dict(cls, data: dict) -> "Catalogue":
        fams = tuple(
            (re.compile(f["name_regex"]), re.compile(f["exclude_regex"]) if f.get("exclude_regex") else None)
            for f in data.get("norm_families", [])
        )
        return cls(
            activations={e["class"]: e for e in data.get("activations", [])},
            norms={e["class"]: e for e in data.get("norms", [])},
            norm_families=fams,
            eps_attributes=tuple(data.get("eps_attributes", ["eps"])),
            linears={e["class"]: e for e in data.get("linears", [])},
            dropouts={e["class"]: e for e in data.get("dropouts", [])},
            identities=frozenset(e["class"] for e in data.get("identities", [])),
            lora_linears={e["class"]: LoraLayout.from_entry(e) for e in data.get("lora_linears", [])},
        )

    # -- role queries -------------------------------------------------------------------------------
    def activation_kind(self, module: nn.Module) -> str | None:
        entry = self.activations.get(class_key(module))
        if entry is None:
            return None
        by_attr = entry.get("kind_from_attr")
        if by_attr:
            value = getattr(module, by_attr["attr"], None)
            return by_attr["values"].get(value)  # unknown attribute value -> not ours
        return entry["kind"]

    def norm_entry(self, module: nn.Module) -> dict | None:
        """Catalogue entry for a norm, or a family entry (kind/param to be inferred by behaviour)."""
        key = class_key(module)
        if key in self.norms:
            return self.norms[key]
        name = type(module).__name__
        for rx, ex in self.norm_families:
            if rx.fullmatch(name) and not (ex and ex.fullmatch(name)):
                return {"class": key, "kind": None, "param": None}
        return None

    def linear_layout(self, module: nn.Module) -> str | None:
        entry = self.linears.get(class_key(module))
        return entry["layout"] if entry else None

    def lora_entry(self, module: nn.Module) -> LoraLayout | None:
        """A LoRA-wrapped Linear (PEFT): the entry names its base layer and adapter containers."""
        return self.lora_linears.get(class_key(module))

    def dropout_p(self, module: nn.Module) -> float | None:
        entry = self.dropouts.get(class_key(module))
        if entry is None:
            return None
        return float(getattr(module, entry["p_attr"], 0.0) or 0.0)

    def is_identity(self, module: nn.Module) -> bool:
        return class_key(module) in self.identities

    def eps_of(self, module: nn.Module) -> float | None:
        for attr in self.eps_attributes:
            v = getattr(module, attr, None)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
        return None


def _default_path():
    """In a wheel, patterns/ is the subpackage ``lmbp_convert.patterns``; in a source checkout (or an
    editable install, which only puts the checkout on sys.path) it sits beside the package."""
    try:
        return resources.files("lmbp_convert.patterns").joinpath("catalogue.json")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "patterns" / "catalogue.json"


@lru_cache(maxsize=None)
def _load(path: str | None) -> Catalogue:
    src = Path(path) if path else _default_path()
    return Catalogue.from_dict(json.loads(src.read_text(encoding="utf-8")))


def load_catalogue(path: str | Path | None = None) -> Catalogue:
    """The shipped catalogue, or one at ``path`` (for users adding their own classes)."""
    return _load(str(path) if path else None)
