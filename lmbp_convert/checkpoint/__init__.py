"""Fold norm affines into the following Linears of a saved checkpoint, streaming shard by shard.

    from lmbp_convert.checkpoint import convert_checkpoint
    convert_checkpoint("llama-dir", "llama-folded")   # or: lmbp-convert llama-dir llama-folded

The command-line front end is ``lmbp_convert.cli``.
"""
from .api import convert_checkpoint, mark_prefolded, prepare, read_record
from .diskplan import DiskPlan
from .errors import CheckpointError

__all__ = ["CheckpointError", "DiskPlan", "convert_checkpoint", "mark_prefolded", "prepare", "read_record"]
