"""Fold norm affines into the following Linears of a saved checkpoint, streaming shard by shard.

    from lmbp_convert.checkpoint import convert_checkpoint
    convert_checkpoint("llama-dir", "llama-folded")   # or: lmbp-convert llama-dir llama-folded

The command-line front end is ``lmbp_convert.cli``. Names are imported on first use (PEP 562): the CLI's path
checks (``commit``, ``fsops``, ``errors``) run before torch is imported.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {"convert_checkpoint": ".api", "mark_prefolded": ".api", "prepare": ".api", "read_record": ".api",
         "DiskPlan": ".diskplan", "CheckpointError": ".errors"}

__all__ = ["CheckpointError", "DiskPlan", "convert_checkpoint", "mark_prefolded", "prepare", "read_record"]

if TYPE_CHECKING:
    from .api import convert_checkpoint, mark_prefolded, prepare, read_record
    from .diskplan import DiskPlan
    from .errors import CheckpointError


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value
