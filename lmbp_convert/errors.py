"""Errors ``convert()`` raises. All are raised before the first mutation: the model is left as it was."""
from __future__ import annotations

from .trace.probe import ProbeError
from .trace.tracer import TraceError


class ConversionError(RuntimeError):
    """Base class of conversion failures."""


class NothingToConvertError(ConversionError):
    """No module matched; the message lists what was looked at and why each candidate was skipped."""


__all__ = ["ConversionError", "NothingToConvertError", "ProbeError", "TraceError"]
