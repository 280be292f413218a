"""Differences between the transformers releases lmbp-convert supports (``pyproject.toml``), in one place.

Each answer comes from what the installed release does (a signature, an attribute), not from its version
number, so a backport or a release in between gets the right one.
"""
from __future__ import annotations

import functools
import inspect

import torch


@functools.lru_cache(maxsize=None)
def _config_takes_dtype() -> bool:
    from transformers import PretrainedConfig

    try:
        return "dtype" in inspect.signature(PretrainedConfig.__init__).parameters
    except (TypeError, ValueError):
        return False


def dtype_kwargs(dtype: torch.dtype | None) -> dict[str, torch.dtype]:
    """The keyword that sets the dtype of a model built by ``from_config`` / ``_from_config``: ``dtype`` where
    the config takes it (transformers ≥ 4.56), ``torch_dtype`` before (newer releases warn on the old name)."""
    if dtype is None:
        return {}
    return {"dtype" if _config_takes_dtype() else "torch_dtype": dtype}
