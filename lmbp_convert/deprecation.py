"""Old spellings that keep working for one minor version, each with a `DeprecationWarning` naming the new one.

0.2.0 renamed fields and modules (one name per concept) and dropped ``convert(..., return_report=True)``; code
written against 0.1.0 kept raising ``AttributeError`` / ``TypeError`` until these shims (CHANGELOG.md lists them).
They go in `REMOVED_IN`. A leaf module: every layer may import it.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

__all__ = ["REMOVED_IN", "RENAMED_IN", "module_renames", "renamed_attribute", "warn_renamed"]

RENAMED_IN = "0.2.0"
REMOVED_IN = "0.3.0"


def warn_renamed(old: str, new: str, *, stacklevel: int = 3, what: str = "renamed") -> None:
    """``old`` is deprecated: say so once per call site, naming ``new``."""
    warnings.warn(f"{old} is deprecated ({what} in {RENAMED_IN}, kept until {REMOVED_IN}): use {new}",
                  DeprecationWarning, stacklevel=stacklevel)


def renamed_attribute(old: str, new: str, *, read: Callable[[Any], Any] | None = None,
                      note: str = "") -> property:
    """A property ``old`` that reads (and writes) attribute ``new`` with a warning. ``read``: the old value made from
    the new one where they differ (a read-only property then)."""

    def owner(obj: Any) -> str:
        return type(obj).__name__

    def get(obj: Any) -> Any:
        warn_renamed(f"{owner(obj)}.{old}", f"{owner(obj)}.{new}{note}")
        value = getattr(obj, new)
        return read(value) if read is not None else value

    def put(obj: Any, value: Any) -> None:
        warn_renamed(f"{owner(obj)}.{old}", f"{owner(obj)}.{new}")
        setattr(obj, new, value)

    return property(get, None if read is not None else put, doc=f"Deprecated: {new}.")


def module_renames(module: str, renames: dict[str, tuple[str, Callable[[], Any]]]) -> Callable[[str], Any]:
    """A PEP 562 ``__getattr__`` for ``module``: old name → (new spelling, a function returning the object), each
    access warning; any other name is the usual AttributeError."""

    def __getattr__(name: str) -> Any:
        if name in renames:
            new, get = renames[name]
            warn_renamed(f"{module}.{name}", new)
            return get()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
