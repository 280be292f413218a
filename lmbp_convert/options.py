"""Options of a conversion: one config object shared by ``convert()`` and the checkpoint CLI."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class ConvertOptions:
    """What to convert.

    activations: swap GELU/SiLU-family modules for approximate-backprop ones.
    norms: swap LayerNorm/RMSNorm for memory-sharing norms, folding the affine into the following Linears.
    gated_mlp: replace gated MLPs (act(gate)·up → down) by the memory-sharing fused op.
    bits: bits per element the approximate activations keep for backward (1..4, default 2).
    include / exclude: module names, exact or regular expressions (full match); exclude wins.
    probe: input for the tracing forward (tensor, tuple of args, or dict of kwargs) when the walker cannot
        build one from the model's config.
    verify: check the rewritten model's outputs on the probe against the original's and roll back rewrites
        that change them (real weights only; meta models are planned but not verified).
    rtol: relative error (‖Δ‖/‖ref‖ over all outputs) that verification accepts; None picks by dtype.
    untie: allow folding into a Linear whose weight is tied to another module by giving it its own copy.
    """

    activations: bool = True
    norms: bool = True
    gated_mlp: bool = True
    bits: int = 2
    include: Sequence[str] | None = None
    exclude: Sequence[str] | None = None
    probe: Any = None
    verify: bool = True
    rtol: float | None = None
    untie: bool = False
    _include_rx: list = field(default_factory=list, repr=False)
    _exclude_rx: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.bits, int) or not 1 <= self.bits <= 4:
            raise ValueError(f"bits must be an integer in 1..4, got {self.bits!r}")
        for attr in ("include", "exclude"):
            val = getattr(self, attr)
            if isinstance(val, str):
                val = [val]
                setattr(self, attr, val)
            compiled = []
            for pat in val or []:
                try:
                    compiled.append(re.compile(pat))
                except re.error as exc:
                    raise ValueError(f"{attr} pattern {pat!r} is not a valid regular expression: {exc}") from exc
            setattr(self, f"_{attr}_rx", compiled)
        if not (self.activations or self.norms or self.gated_mlp):
            raise ValueError("all of activations, norms and gated_mlp are off: nothing to convert")

    def selected(self, name: str) -> bool:
        def hit(rxs, pats):
            return any(name == p for p in pats or []) or any(rx.fullmatch(name) for rx in rxs)

        if self.include is not None and not hit(self._include_rx, self.include):
            return False
        return not hit(self._exclude_rx, self.exclude)

    def excluded(self, name: str) -> bool:
        """Explicitly excluded (used for fold targets: include lists the modules to convert, not the Linears)."""
        return any(name == p for p in self.exclude or []) or any(rx.fullmatch(name) for rx in self._exclude_rx)

    def summary(self) -> dict:
        return {
            "activations": self.activations, "norms": self.norms, "gated_mlp": self.gated_mlp,
            "bits": self.bits, "include": list(self.include) if self.include else None,
            "exclude": list(self.exclude) if self.exclude else None, "untie": self.untie,
        }
