"""The compile registration back end: an op's Triton launcher as a ``torch.library`` op for ``torch.compile``.

Under ``torch.compile`` a Python launcher would be traced away or break the graph; as a ``triton_op`` inductor
traces the ``wrap_triton`` launches inside it (`LeanKernel.launch_traced`) and emits them itself, so no Python
launcher runs per call. The op file registers its autograd on the op (``register_autograd``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .._common import triton_interpreting

__all__ = ["kernel_op"]


def kernel_op(name: str, fake: Callable) -> Callable:
    """Register a Triton launcher as the op ``name``: a ``torch.library.triton_op`` (inductor traces the
    ``wrap_triton`` launches inside it and emits them itself), or, under Triton's interpreter, where kernels
    cannot be traced, an opaque ``custom_op`` with ``fake`` as its shape function."""
    def register(fn: Callable) -> Any:
        if triton_interpreting():
            op = torch.library.custom_op(name, mutates_args=())(fn)
            op.register_fake(fake)
            return op
        return torch.library.triton_op(name, mutates_args=())(fn)
    return register
