"""The one table of the ops' launch back ends: which op tries which, in what order, and `route`, which picks.

Back ends (`lmbp_convert.enums.Backend`), each with its condition (`APPLIES`):

- ``COMPILED``: a tensor the Triton kernels take (the op's `use_triton`: CUDA, a Triton dtype) under
  ``torch.compile``: the op's ``torch.library`` op (`compiled.kernel_op`), whose launches inductor emits.
- ``CUDA_HOST``: such a tensor, eager, with the C++ host path on (`cuda_host.on`: ``LMBP_CUDA_HOST=1``, built,
  not `cuda_host.disabled`): forward, autograd node and backward in C++. A call C++ declines (returns
  NotImplemented) goes to ``TRITON``.
- ``TRITON``: such a tensor, eager: the op's Triton launchers through `LeanKernel`'s cached launches.
- ``CPU_NATIVE``: a CPU tensor, eager, the native kernels not known to be off (`cpu_native.usable`:
  ``LMBP_CPU_NATIVE=0``, a failed build, `cpu_native.disabled`; it builds nothing). Tried first inside the op's
  PyTorch path: an entry point builds the kernels at the first call they apply to, and returns None for a call
  they are not correct for (fp64, a subclass, a dispatch mode, double backward, ...): the reference runs.
- ``TORCH``: the PyTorch reference; always applies, always last.

`route` gives the first back end of an op's row whose condition holds; the op file holds one hook per back end
(its ``torch.ops`` call, its C++ entry, its Triton launcher, its reference, in which the native entry point is the
first line). A backward runs where its forward ran (the autograd node that back end made: the C++ node, the
library op's registered autograd, the Function's); under ``create_graph=True`` every eager backward takes the op's
differentiable form in torch ops instead (`ops._common.twice_differentiable`; the C++ nodes call it back), where
no native kernel applies (`cpu_native` declines a result autograd must record).
"""
from __future__ import annotations

from typing import Callable

import torch

from ...enums import Backend
from . import cpu_native, cuda_host

__all__ = ["TABLE", "APPLIES", "route", "Backend"]

_C, _H, _T, _N, _R = (Backend.COMPILED, Backend.CUDA_HOST, Backend.TRITON, Backend.CPU_NATIVE, Backend.TORCH)

#: Each op's back ends, in the order they are tried. The forwards of the ops with CUDA back ends ask `route`; the
#: rows of CPU_NATIVE + TORCH alone say what the native entry point at the head of the reference does.
TABLE: dict[str, tuple[Backend, ...]] = {
    "approx_act": (_C, _H, _T, _N, _R),
    "ms_norm": (_C, _H, _T, _N, _R),
    "gated_mlp": (_C, _H, _T, _R),  # COMPILED: the elementwise part's library op inside the Function
    "gated_act": (_C, _T, _R),
    "cross_entropy": (_C, _T, _R),
    "norm_affine": (_N, _R),
    "exact_norm": (_N, _R),
}


def _compiled(x: torch.Tensor, kernels: bool) -> bool:
    return kernels and torch.compiler.is_compiling()


def _host(x: torch.Tensor, kernels: bool) -> bool:
    return kernels and cuda_host.on()


def _triton(x: torch.Tensor, kernels: bool) -> bool:
    return kernels


def _native(x: torch.Tensor, kernels: bool) -> bool:
    return x.device.type == "cpu" and cpu_native.usable()


def _torch(x: torch.Tensor, kernels: bool) -> bool:
    return True


#: Each back end's condition: ``f(x, kernels)``, ``kernels`` whether the Triton kernels take the call's tensors.
#: The order of a row makes COMPILED's "under torch.compile" the others' "eager".
APPLIES: dict[Backend, Callable[[torch.Tensor, bool], bool]] = {
    _C: _compiled, _H: _host, _T: _triton, _N: _native, _R: _torch}


def route(op: str, x: torch.Tensor, kernels: bool) -> Backend:
    """The back end ``op`` runs a call on ``x`` on: the first of its `TABLE` row whose condition holds.
    ``kernels``: whether the op's Triton kernels take the call's tensors (the op's `use_triton` of each, on one
    device; the op asks, so that tests and testsupport's stubbed driver can route CPU tensors there)."""
    for backend in TABLE[op]:
        if APPLIES[backend](x, kernels):
            return backend
    return _R
