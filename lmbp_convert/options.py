"""Options of a conversion: one config object shared by ``convert()`` and the checkpoint CLI.

Every value is checked when the object is built (so before ``convert()`` changes anything); ``with_overrides``
merges keyword arguments into an options object, refusing to silently drop or overrule either side.
"""
from __future__ import annotations

import difflib
import functools
import math
import numbers
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterable, Sequence

from .errors import NothingToConvertError

_FLAGS = ("activations", "norms", "gated_mlp", "verify", "untie", "keep_affine", "fold_norms", "lora_inputs", "measure",
          "loss")


@dataclass
class ConvertOptions:
    """What to convert.

    activations: swap GELU/SiLU-family modules for approximate-backprop ones.
    norms: swap LayerNorm/RMSNorm for memory-sharing norms (exact ones by default; see ``fold_norms``).
    gated_mlp: replace gated MLPs (act(gate)·up → down) by the memory-sharing fused op.
    bits: bits per element the approximate activations keep for backward (1..4, default 2).
    include / exclude: module names, exact or regular expressions (full match); exclude wins.
    verify: check the rewritten model's outputs on the probe against the original's and roll back rewrites
        that change them (real weights only; meta models are planned but not verified).
    rtol: relative error (‖Δ‖/‖ref‖ over all outputs) that verification accepts; None: 1e-4 for fp32 models, and
        for bf16/fp16 ones 4× the model's own rounding noise (its outputs against the same forwards in fp32,
        measured before any rewrite; `lmbp_convert.apply.verify.calibrated_rtol`).
    untie: allow folding into a Linear whose weight is tied to another module by giving it its own copy; the
        model's config then says ``tie_word_embeddings=False``, so transformers' ``tie_weights()`` (and
        ``resize_token_embeddings``) does not tie the unfolded embedding back under the folded head.
    keep_affine: where a norm's fold is refused but a consumer keeps its output anyway (a post-LN residual in the
        same forward, a tied head), swap it for a memory-sharing norm that keeps γ, β and computes its backward
        from the output (docs/affine_ms_norm.md). Under autocast its output is in the autocast dtype, so a
        residual add that reads it sees the rounded value.
    fold_norms: True: fold a norm's affine into the next Linears (the optimiser then trains W·diag(γ), not W and
        γ; the checkpoint CLI folds on disk), except a fold whose affine-less output a door could see (it leaves a
        module call, or the fold runs in the model's own frame or its head: `lmbp_convert.match.doors`), which
        stays exact and says why. False (default): exact norms instead (`MSExactNorm`: γ, β, W, b stay the
        original parameters with the original gradients and state dict; the consumers' copies of the norm's output
        are rebuilt from x̂ for backward, the same bytes as the fold). Channel-first norms and norms with
        functional consumers follow the same rule: exact by default, folded into the consumers' parameters with
        True.
    measure: measure what the conversion saves (one training forward on the probe before and one after, by the
        exact ledger; `ConversionReport.measured_saved_bytes`), in the dtype, autocast and trainable parameters
        of the convert() call (and with activation checkpointing on, the same forward with it off). Off: the report
        says the bytes were not measured. ``plan_conversion`` measures its plan applied and undone.
    lora_inputs: let PEFT LoRA adapters rebuild their cast (and dropped) inputs from the layer's input instead of
        keeping private fp32 copies (`lmbp_convert.match.lora_inputs`); their dropout keeps a 1-bit mask.
    accept_norms: norm classes (``"module:QualName"`` or the class name) swapped on the behaviour probe's word
        alone. Without it, a module that acts as a norm on the probe but not in train mode, on non-finite or on
        extreme input (a subclass with its own forward: a train-time noise term, a NaN guard) is refused, and
        the report names its class.
    loss: where the model computes a cross-entropy loss on its head's logits through ``loss_function`` (HF ≥ 4.46),
        set that instance attribute to one that keeps the logits in their own dtype (no fp32 copy) and makes one
        gradient in it (`lmbp_convert.nn.loss`).
    progress: a progress line on stderr naming the phase (probe, plan, verify, measure): None (default) once the
        call has run 2 s (`lmbp_convert.apply.progress.DELAY`), True at once, False never.
    """

    activations: bool = True
    norms: bool = True
    gated_mlp: bool = True
    bits: int = 2
    include: Sequence[str] | None = None
    exclude: Sequence[str] | None = None
    verify: bool = True
    rtol: float | None = None
    untie: bool = False
    keep_affine: bool = True
    fold_norms: bool = False
    lora_inputs: bool = True
    measure: bool = True
    accept_norms: Sequence[str] | None = None
    loss: bool = True
    progress: bool | None = None
    _include_rx: list = field(default_factory=list, init=False, repr=False, compare=False)
    _exclude_rx: list = field(default_factory=list, init=False, repr=False, compare=False)
    #: names of the fields given to the constructor (not left at their defaults): what an override may not change
    _explicit: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for attr in _FLAGS:
            if not isinstance(getattr(self, attr), bool):
                raise ValueError(f"{attr} must be True or False, got {getattr(self, attr)!r}")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise ValueError(f"progress must be None, True or False, got {self.progress!r}")
        if isinstance(self.bits, bool) or not isinstance(self.bits, numbers.Integral) or not 1 <= self.bits <= 4:
            raise ValueError(f"bits must be an integer in 1..4, got {self.bits!r}")
        self.bits = int(self.bits)
        if self.rtol is not None:
            if isinstance(self.rtol, bool) or not isinstance(self.rtol, numbers.Real) or not (
                    math.isfinite(self.rtol) and self.rtol >= 0):
                raise ValueError(f"rtol must be None or a finite number >= 0, got {self.rtol!r}")
            self.rtol = float(self.rtol)
        for attr in ("include", "exclude"):
            val = getattr(self, attr)
            if isinstance(val, str):
                val = [val]
            elif val is not None:
                items = list(val) if isinstance(val, Iterable) and not isinstance(val, (bytes, dict)) else None
                if items is None or not all(isinstance(p, str) for p in items):
                    raise ValueError(f"{attr} must be a module name or pattern, or a list of them, got {val!r}")
                val = items
                if attr == "include" and not val:
                    raise ValueError("include=[] selects no module: pass None to convert everything")
            setattr(self, attr, val)
            setattr(self, f"_{attr}_rx", compile_patterns(attr, val or []))
        if isinstance(self.accept_norms, str):
            self.accept_norms = [self.accept_norms]
        if self.accept_norms is not None:
            items = list(self.accept_norms) if isinstance(self.accept_norms, Iterable) else None
            if items is None or not all(isinstance(c, str) and c for c in items):
                raise ValueError(f"accept_norms must be a class name or a list of them, got {self.accept_norms!r}")
            self.accept_norms = items
        if not (self.activations or self.norms or self.gated_mlp or self.lora_inputs or self.loss):
            raise ValueError("all of activations, norms, gated_mlp, lora_inputs and loss are off: nothing to "
                             "convert")

    @staticmethod
    def _hit(name: str, pats: Sequence[str] | None, rxs: list) -> bool:
        return any(name == p for p in pats or []) or any(rx.fullmatch(name) for rx in rxs)

    def selected(self, name: str) -> bool:
        if self.include is not None and not self._hit(name, self.include, self._include_rx):
            return False
        return not self._hit(name, self.exclude, self._exclude_rx)

    def excluded(self, name: str) -> bool:
        """Explicitly excluded (used for fold targets: include lists the modules to convert, not the Linears)."""
        return self._hit(name, self.exclude, self._exclude_rx)

    def unmatched(self, names: Iterable[str]) -> tuple[list[str], list[str]]:
        """The include and the exclude patterns that match none of ``names`` (a model's module names)."""
        names = list(names)
        result = []
        for pats, rxs in ((self.include, self._include_rx), (self.exclude, self._exclude_rx)):
            result.append([p for p, rx in zip(pats or [], rxs)
                           if not any(n == p or rx.fullmatch(n) for n in names)])
        return result[0], result[1]

    def check_patterns(self, names: Iterable[str], what: str, warn: Callable[[str], None]) -> None:
        """include/exclude patterns that name none of ``names`` (the module names of ``what``) are a typo or a
        different model: NothingToConvertError when no include pattern matches (nothing can be converted), else
        ``warn`` one line per kind. ``convert()`` and the checkpoint CLI both check through here."""
        names = list(names)
        inc, exc = self.unmatched(names)

        def hint(pats: list[str]) -> str:
            close = [m for p in pats for m in difflib.get_close_matches(p, names, n=2, cutoff=0.6)]
            if close:
                return f"closest names: {', '.join(dict.fromkeys(close))}"
            return (f"names are full dotted paths, e.g. {', '.join(names[-3:])}; a regular expression must match a "
                    "whole name")

        if inc and len(inc) == len(self.include or []):
            raise NothingToConvertError(f"nothing to convert in {what}: include={inc!r} matches no module "
                                        f"({hint(inc)})")
        if inc:
            warn(f"include pattern(s) {inc!r} match no module of {what} ({hint(inc)})")
        if exc:
            warn(f"exclude pattern(s) {exc!r} match no module of {what}, so they exclude nothing ({hint(exc)})")

    def with_overrides(self, **overrides: Any) -> "ConvertOptions":
        """A copy with ``overrides`` applied. TypeError for an unknown name, or for a value that contradicts one
        this object was built with explicitly (an override of a default is a merge, not a conflict)."""
        _check_names(overrides)
        for name, value in overrides.items():
            if name in self._explicit and _normal(value) != _normal(getattr(self, name)):
                raise TypeError(f"convert(): {name}={value!r} conflicts with the options' {name}="
                                f"{getattr(self, name)!r}; give it in one place")
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        values.update(overrides)
        merged = ConvertOptions(**values)
        merged._explicit = self._explicit | frozenset(overrides)
        return merged

    def summary(self) -> dict:
        return {
            "activations": self.activations, "norms": self.norms, "gated_mlp": self.gated_mlp,
            "bits": self.bits, "include": list(self.include) if self.include else None,
            "exclude": list(self.exclude) if self.exclude else None, "untie": self.untie,
            "keep_affine": self.keep_affine, "fold_norms": self.fold_norms, "lora_inputs": self.lora_inputs,
            "accept_norms": list(self.accept_norms) if self.accept_norms else None,
            "loss": self.loss,
        }


def compile_patterns(attr: str, patterns: Sequence[str]) -> list[re.Pattern]:
    """``patterns`` of option ``attr`` (include / exclude) compiled; ValueError naming the first invalid one (a
    usage error: the checkpoint CLI checks them through here before anything heavy is imported)."""
    compiled = []
    for pat in patterns:
        try:
            compiled.append(re.compile(pat))
        except re.error as exc:
            raise ValueError(f"{attr} pattern {pat!r} is not a valid regular expression: {exc}") from exc
    return compiled


OPTION_NAMES = tuple(f.name for f in fields(ConvertOptions) if f.init)


def _check_names(kwargs: dict) -> None:
    unknown = sorted(set(kwargs) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"unknown conversion option(s) {', '.join(unknown)}; the options are "
                        f"{', '.join(OPTION_NAMES)}")


def _normal(value: Any) -> Any:
    if isinstance(value, str):
        return [value]
    return list(value) if isinstance(value, (list, tuple)) else value


def _record_explicit(cls: type) -> type:
    """Wrap the dataclass __init__ so each object knows which fields were passed, not defaulted."""
    init = cls.__init__
    names = [f.name for f in fields(cls) if f.init]

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._explicit = frozenset(names[:len(args)]) | frozenset(kwargs)

    cls.__init__ = __init__
    return cls


_record_explicit(ConvertOptions)


def resolve_options(options: ConvertOptions | None, probe: Any, overrides: dict) -> tuple[ConvertOptions, Any]:
    """``convert(model, options, probe=..., **overrides)`` → (the options to use, the probe or None)."""
    if options is None:
        _check_names(overrides)
        return ConvertOptions(**overrides), probe
    if not isinstance(options, ConvertOptions):
        raise TypeError(f"options must be a ConvertOptions, got {type(options).__name__}")
    merged = options.with_overrides(**overrides)  # rebuilt even without overrides: fields set later are checked
    return merged, probe
