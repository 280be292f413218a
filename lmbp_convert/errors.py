"""Every error lmbp_convert raises on purpose derives from ``LmbpError``: one ``except`` catches them all.

    LmbpError                              (Exception)
    ├── ConversionError                    (RuntimeError)  convert() / plan_conversion() / export cannot do it
    │   ├── NothingToConvertError                           no module matched; the message lists the candidates
    │   ├── TraceError                                      the probe forward failed
    │   ├── ProbeError                     (ValueError)     no probe input can be built for the model
    │   └── ExportError                                     (lmbp_convert.export) not expressible as a plain checkpoint
    ├── CheckpointError                                     (lmbp_convert.checkpoint) bad SRC/DST or request of the CLI
    ├── ReplacedModuleError                (RuntimeError)   a module a fold lives in was replaced by one it cannot follow
    ├── LogitsModifiedError                (RuntimeError)   the logits the memory-sharing loss keeps were edited in place
    ├── NoSecondDerivativeError            (RuntimeError)   double backward (create_graph=True) through a rewrite that
    │                                                       cannot differentiate its backward (names the option)
    └── BudgetError                                         checkpoint_for_budget cannot meet the budget or find the layers

The builtin second bases are the ones each class had before it joined the hierarchy, so ``except RuntimeError`` /
``except ValueError`` written against older releases still catch what they caught.

*Usage errors* stay builtin, as Python code expects: a wrong argument type or an unknown / contradicting keyword
is a ``TypeError``, an invalid option value (``bits=7``, a bad regular expression) a ``ValueError``. They are
raised before the model is looked at and mean "fix the call", not "this model cannot be converted".
``convert()`` raises all of these before its first change; anything raised later (an interrupt, an error in the
model's own forward) is re-raised after the model is restored.

This module imports nothing, so every layer (trace, match, apply, checkpoint, cli) can import it.
"""
from __future__ import annotations


class LmbpError(Exception):
    """Base class of every error lmbp_convert raises on purpose (see the module doc for the tree)."""


class ConversionError(LmbpError, RuntimeError):
    """The model cannot be converted (or exported) as asked; it is left as it was."""


class NothingToConvertError(ConversionError):
    """No module matched; the message lists what was looked at and why each candidate was skipped."""


class TraceError(ConversionError):
    """The probe forward failed; the message says how to help the walker."""

    #: how far the forward got (module calls): of two tries, the error of the one that got further is told
    module_calls: int = 0


class ProbeError(ConversionError, ValueError):
    """The walker cannot build an input for this model by itself."""


class BudgetError(LmbpError):
    """``checkpoint_for_budget`` cannot meet the activation budget (even with every layer checkpointed), or cannot
    find or measure the layers; the model is left as it was."""


class ReplacedModuleError(LmbpError, RuntimeError):
    """A module that carries part of a fold (a shift or re-applied affine hook) was replaced after convert() by a
    module the hook cannot act on; raised by the converted model's forward instead of returning wrong values."""


class LogitsModifiedError(LmbpError, RuntimeError):
    """The logits a memory-sharing loss keeps for its backward (their storage, not a copy: the memory it saves)
    were modified in place after its forward (``outputs.logits.div_(T)``); raised by backward, as autograd raises
    for any saved tensor modified in place, instead of a gradient of the edited values. Its message starts with
    autograd's own sentence, so handlers written for that still match."""


class NoSecondDerivativeError(LmbpError, RuntimeError):
    """Double backward (``create_graph=True``: a gradient penalty, a Hessian-vector product) through a rewrite
    whose backward cannot be differentiated from what it keeps; raised by that backward, naming the rewrite and the
    ``convert()`` option that turns it off (``option=False``)."""

    def __init__(self, rewrite: str, option: str, why: str = "") -> None:
        self.rewrite, self.option = rewrite, option
        super().__init__(f"{rewrite}: no second derivative (create_graph=True) from what it keeps for backward"
                         + (f" ({why})" if why else "")
                         + f"; convert with {option}=False to leave these modules as they are")


__all__ = ["BudgetError", "ConversionError", "LmbpError", "LogitsModifiedError", "NoSecondDerivativeError",
           "NothingToConvertError", "ProbeError", "ReplacedModuleError", "TraceError"]
