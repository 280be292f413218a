"""lmbp-convert: cut the activation memory of fine-tuning by approximate and memory-sharing backprop.

    from lmbp_convert import convert
    convert(model)            # in place; print(model.lmbp_report) for what it did
"""
from .apply.convert import convert, last_report, plan_conversion
from .errors import ConversionError, NothingToConvertError, ProbeError, TraceError
from .memory import SavedTensorLedger
from .options import ConvertOptions
from .report import ConversionReport

__all__ = [
    "ConversionError", "ConversionReport", "ConvertOptions", "NothingToConvertError", "ProbeError",
    "SavedTensorLedger", "TraceError", "convert", "last_report", "plan_conversion",
]
__version__ = "0.1.0"
