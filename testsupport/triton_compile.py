"""Triton's compile step and active driver stubbed, so the ops' real Triton launch path runs on CPU tensors.

Why: the host-side launch code (`lmbp_convert.ops._launch.LeanKernel`, Triton's binder and cache key) is tested
and timed on machines without a GPU. This patches Triton internals (``JITFunction._do_compile``, the active
driver) for the duration of a ``with`` block, which is why it lives here and not in the shipped package.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from lmbp_convert.ops import _launch
from lmbp_convert.ops.backends import cuda_host

__all__ = ["stub_triton_driver"]


class _StubCompiled:
    """Stands in for a CompiledKernel: launching it does nothing (counts launches)."""

    function = 0
    packed_metadata = None
    launches = 0

    def launch_metadata(self, *args: Any) -> None:
        return None

    def run(self, *args: Any) -> None:
        _StubCompiled.launches += 1


class _StubDriver:
    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: Any = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@contextlib.contextmanager
def stub_triton_driver() -> Iterator[type]:
    """Run Triton's real launch path on CPU tensors with the GPU parts stubbed: a fake active driver (device 0,
    stream 0, an sm_90 target) and a compile step that returns a do-nothing kernel. Everything a launch costs on
    the host (Triton's binder and cache key, or `LeanKernel`'s cache) still runs. Yields the stub kernel class,
    whose ``launches`` counts driver launches. Clears the `LeanKernel` caches (and the C++ host path's entries)
    it filled on exit.

    For host-time benchmarks and tests only (not thread-safe; not under TRITON_INTERPRET=1).
    """
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    touched = []

    def _do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = _StubCompiled()
        self.device_caches[device][0][key] = kernel
        touched.append((self, device, key))
        return kernel

    old_compile, old_driver = JITFunction._do_compile, driver._active
    driver.set_active(_StubDriver())
    JITFunction._do_compile = _do_compile
    _StubCompiled.launches = 0
    try:
        yield _StubCompiled
    finally:
        JITFunction._do_compile = old_compile
        driver._active = old_driver
        for fn, device, key in touched:
            fn.device_caches[device][0].pop(key, None)
        for lk in list(_launch._ALL_KERNELS):
            for k in [k for k, e in lk.cache.items() if isinstance(e.compiled, _StubCompiled)]:
                del lk.cache[k]
        cuda_host.clear()  # its entries may name the stub's kernels
