"""lmbp-convert: cut the activation memory of fine-tuning by approximate and memory-sharing backprop.

    from lmbp_convert import convert
    convert(model)            # in place; print(model.lmbp_report) for what it did

Every error it raises on purpose is an ``LmbpError`` (see ``lmbp_convert.errors``).

The public names are imported on first use (PEP 562), so that ``lmbp-convert --help`` and the checkpoint CLI's
early checks do not pay for importing torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

#: public name → the module that defines it
_LAZY = {
    "convert": ".apply.convert", "plan_conversion": ".apply.convert", "last_report": ".apply.convert",
    "LmbpError": ".errors", "ConversionError": ".errors", "NothingToConvertError": ".errors", "ProbeError": ".errors",
    "TraceError": ".errors", "CheckpointError": ".checkpoint.errors", "ExportError": ".export",
    "SavedTensorLedger": ".memory", "ConvertOptions": ".options", "ConversionReport": ".report",
    "Probes": ".trace.second_probe", "checkpoint_for_budget": ".budget", "ActivationBudget": ".budget",
    "BudgetError": ".errors", "ReplacedModuleError": ".errors", "LogitsModifiedError": ".errors",
    "NoSecondDerivativeError": ".errors",
}

__all__ = [
    "ActivationBudget", "BudgetError", "CheckpointError", "ConversionError", "ConversionReport", "ConvertOptions",
    "ExportError", "LmbpError", "LogitsModifiedError", "NoSecondDerivativeError",
    "NothingToConvertError", "ProbeError", "Probes", "ReplacedModuleError", "SavedTensorLedger", "TraceError",
    "convert",
    "plan_conversion", "checkpoint_for_budget",
]

if TYPE_CHECKING:  # what static tools and IDEs see
    from .apply.convert import convert, plan_conversion
    from .budget import ActivationBudget, checkpoint_for_budget
    from .checkpoint.errors import CheckpointError
    from .errors import (BudgetError, ConversionError, LmbpError, LogitsModifiedError, NoSecondDerivativeError,
                         NothingToConvertError, ProbeError, ReplacedModuleError, TraceError)
    from .export import ExportError
    from .memory import SavedTensorLedger
    from .options import ConvertOptions
    from .report import ConversionReport
    from .trace.second_probe import Probes


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    else:  # a subpackage used as an attribute (lmbp_convert.nn...) without importing it first
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
