"""Trainer integration: convert the model a transformers ``Trainer`` (or TRL's ``SFTTrainer``, ``DPOTrainer``)
holds, at the one moment that is right for it, and say which rewrites ran in its first step.

    trainer = SFTTrainer(model=..., peft_config=LoraConfig(...), callbacks=[ConvertCallback()], ...)
    trainer.train()
    print(trainer.model.lmbp_report)

`ConvertCallback` converts in ``on_init_end``, the last thing ``Trainer.__init__`` does: the trainer (and TRL's
``peft_config=``, before it) has wrapped the model with PEFT, has enabled input gradients where it does that, and
the optimizer does not exist yet (``Trainer.train`` builds it before any other event fires: ``on_train_begin``
comes after it). TRL's trainers add their fused LM head after ``Trainer.__init__``; it wraps ``forward`` and
does not change what a conversion rewrites. Gradient checkpointing is switched on later, in ``train()`` (conversion
and checkpointing compose in either order).

The first training step (forward and backward of every micro-batch up to the optimizer step) runs under
`lmbp_convert.apply.runs.count_runs`: ``model.lmbp_report.ran`` then holds each rewrite's calls, and the printed
report the rewrites in place that never ran (TRL computes its loss from the hidden states and
``lm_head.weight`` itself, so the memory-sharing loss is never called there).
"""
from __future__ import annotations

import warnings
from typing import Any

from transformers import TrainerCallback

from .apply.convert import convert
from .apply.runs import count_runs
from .options import ConvertOptions, resolve_options

__all__ = ["ConvertCallback", "count_runs"]


class ConvertCallback(TrainerCallback):
    """``callbacks=[ConvertCallback(**options)]``: ``convert(trainer.model, **options)`` at the end of the trainer's
    ``__init__`` (after PEFT, before the optimizer), and the first step's calls of each rewrite counted into
    ``model.lmbp_report.ran``. Options are ``convert()``'s (a ``ConvertOptions`` and/or keywords, ``probe=``),
    checked here, when the callback is made. ``count=False``: no counting."""

    def __init__(self, options: ConvertOptions | None = None, *, probe: Any = None, count: bool = True,
                 **overrides: Any) -> None:
        self.options, self.probe = resolve_options(options, probe, overrides)
        self.count = bool(count)
        self.model = None  # the model converted (the trainer's, at its __init__)
        self._counter: count_runs | None = None
        self._counted = False

    def on_init_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None:
            raise ValueError("ConvertCallback: the trainer holds no model at the end of its __init__ (model_init=?): "
                             "call convert() on the model inside your model_init instead")
        if optimizer is not None:
            raise ValueError("ConvertCallback: the trainer was given an optimizer (optimizers=...), built before "
                             "convert() could run; convert the model before building the optimizer, or let the "
                             "trainer build it (optimizer_cls_and_kwargs=)")
        convert(model, self.options, probe=self.probe)
        self.model = model

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.model is None:
            raise RuntimeError("ConvertCallback converts at the end of the trainer's __init__: pass it in "
                               "callbacks=[...] when building the trainer (added later, it never ran, and the "
                               "optimizer now exists); or call convert(trainer.model) before trainer.train()")

    def on_step_begin(self, args, state, control, **kwargs):
        if self.count and not self._counted and self.model is not None and not getattr(args, "torch_compile", False):
            self._counter = count_runs(self.model).start()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._stop()

    def on_step_end(self, args, state, control, **kwargs):
        self._stop()

    def on_train_end(self, args, state, control, **kwargs):
        self._stop()

    def _stop(self) -> None:
        counter, self._counter = self._counter, None
        if counter is None:
            return
        counted = len(counter.counts)
        counter.stop()
        self._counted = True
        if counted and not counter.total():
            warnings.warn("ConvertCallback: no rewrite of the converted model ran in the first training step: the "
                          "trainer trains another model than the one converted at its __init__ (model_init= builds "
                          "a new one in train(): call convert() inside model_init instead)", UserWarning)
