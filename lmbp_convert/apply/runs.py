"""Which rewrites ran: the calls of each applied rewrite over a stretch of training (a step), counted by hooks that
are removed afterwards and written to the conversion report (``model.lmbp_report.ran``).

A rewrite's run is a forward of its module (``PlanItem.called_as`` empty: norms, gated MLPs, activations, LoRA
layers, recompute regions) or a call of the instance attribute it set (``called_as = "loss_function"``: the
memory-sharing loss). A rewrite can be in place and never run: TRL's trainers compute their loss from the hidden
states and ``lm_head.weight`` themselves, so the model's ``loss_function`` is never called. The count says so.

The forward counter is a pre-hook that only notes (``only_notes``, as `apply.shared_hooks.NoteInput`): a fused
caller that computes a module's output itself (the gated MLP's fused down projection) skips it, as it would without
counting, and then that module did not run. Under torch.compile nothing is counted (the hooks return at once).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from ..enums import ConvertedCallable, ConvertedHook
from ..report import ConversionReport

__all__ = ["count_runs"]

REPORT_ATTR = "lmbp_report"


class _CountForward(ConvertedHook):
    only_notes = True  # never makes a fused caller take another path (`nn.gated_mlp._observed`)

    def __init__(self, counts: Counter, key: tuple) -> None:
        self.counts, self.key = counts, key

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if not torch.compiler.is_compiling():
            self.counts[self.key] += 1
        return None


class _CountCall(ConvertedCallable):
    """Stands in for a rewrite's callable attribute while counting: counts the call, then makes it."""

    def __init__(self, fn: Any, counts: Counter, key: tuple) -> None:
        self.fn, self.counts, self.key = fn, counts, key

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            self.counts[self.key] += 1
        return self.fn(*args, **kwargs)


def _reports(model: nn.Module) -> list[tuple[ConversionReport, str]]:
    """(report, the name of the module it was made on) for every conversion of ``model`` or of a submodule (convert,
    wrap with PEFT, convert again), earlier conversions of the same module (``.previous``) included. A report is
    taken from the module that holds it, not through a wrapper's attribute forwarding (PeftModel's)."""
    found: dict[int, tuple[ConversionReport, str]] = {}
    for name, mod in model.named_modules():
        rep = vars(mod).get(REPORT_ATTR)
        if isinstance(rep, ConversionReport) and id(rep) not in found:
            found[id(rep)] = (rep, name)
    for rep, prefix in list(found.values()):
        rep = rep.previous
        while isinstance(rep, ConversionReport) and id(rep) not in found:
            found[id(rep)] = (rep, prefix)
            rep = rep.previous
    return list(found.values())


class count_runs:  # noqa: N801 - used like a function: ``with count_runs(model): ...``
    """``with count_runs(model): <training step>``: each applied rewrite's calls in the block, written on exit to
    its report's ``ran`` (``{plan tag: {module name: calls}}``, replacing an earlier count), which the printed report
    then shows: what ran, and what is in place but never ran. ``model``: the converted model, or a wrapper of it.
    `lmbp_convert.integrations.ConvertCallback` counts a trainer's first step so. ``start()`` / ``stop()`` do the same
    without a ``with``."""

    def __init__(self, model: nn.Module) -> None:
        self.reports = _reports(model)
        if not self.reports:
            raise ValueError(f"count_runs: {type(model).__name__} was not converted (no {REPORT_ATTR} on it or on any "
                             "of its modules): call lmbp_convert.convert() on it first")
        self.model = model
        self.counts: Counter = Counter()
        self._undo: list = []
        self._active = False

    def start(self) -> "count_runs":
        if self._active:
            return self
        self.counts.clear()
        self._active = True
        modules = dict(self.model.named_modules())
        try:
            for index, (rep, prefix) in enumerate(self.reports):
                for item in rep.plan.items:
                    key = (index, item.tag, item.name)
                    self.counts[key] += 0
                    mod = modules.get(f"{prefix}.{item.name}" if prefix and item.name else prefix or item.name)
                    if mod is None:
                        continue  # no longer in the model: it cannot run, and counts 0
                    attr = type(item).called_as
                    if not attr:
                        self._undo.append(mod.register_forward_pre_hook(_CountForward(self.counts, key)).remove)
                    else:
                        old = getattr(mod, attr)
                        setattr(mod, attr, _CountCall(old, self.counts, key))
                        self._undo.append(lambda m=mod, a=attr, o=old: setattr(m, a, o))
        except BaseException:
            self._remove()
            self._active = False
            raise
        return self

    def stop(self) -> dict[str, dict[str, int]] | None:
        """Remove the counters and write each report's counts to its ``ran``; returns those of the outermost
        converted module's report (None, writing nothing, where counting was not started)."""
        if not self._active:
            return None
        self._active = False
        self._remove()
        ran: list[dict[str, dict[str, int]]] = [{} for _ in self.reports]
        for (index, tag, name), n in self.counts.items():
            ran[index].setdefault(tag, {})[name] = n
        for (rep, _), counts in zip(self.reports, ran):
            rep.ran = counts
        return ran[0]

    def total(self) -> int:
        """Calls counted so far, over every rewrite."""
        return sum(self.counts.values())

    def _remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> "count_runs":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
