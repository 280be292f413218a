"""Lean Triton launches, written once for every op.

``kernel[grid](...)`` costs ~5-8 µs of host time per call in Triton 3.8 (argument binding, specialisation,
cache-key hashing, launch-metadata hooks) before the driver is reached; for a training step made of small
launches that is the whole slowdown. `LeanKernel` keeps the `CompiledKernel` that the first ordinary launch
returns, under a key the calling op builds from what Triton specialises on (tensor dtype and 16-byte alignment,
integer width and divisibility by 16 / equality to 1, the constexprs, num_warps, the device), and afterwards
calls Triton's C launcher itself with the arguments ``CudaLauncher.__call__`` would pass it (that Python layer
costs ~1-2 µs per launch on its own; kernels that need scratch buffers keep it). Anything unusual (Triton's
interpreter, launch hooks set by a profiler, a tensor on a device that is not the current one) takes the
ordinary ``kernel[grid](...)`` call.

Internals read here, guarded rather than pinned (pyproject allows ``triton>=3.0``): the launch hooks in
``triton.knobs.runtime`` (`triton_launch_knobs`; without them no kernel is cached and every launch is Triton's
own) and the ``CudaLauncher`` fields the direct launch passes (checked per compiled kernel by
`_direct_launchable`; without them that kernel goes through Triton's Python launcher). Host-time benchmarks stub
the compile and the driver from the outside (testsupport/triton_compile.py, testsupport/triton_stub.py).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Optional

import torch

from ._common import HAS_TRITON

__all__ = ["LeanKernel", "spec_key", "triton_launch_knobs", "cdiv", "next_pow2", "rows_view"]


def triton_launch_knobs() -> Optional[tuple[Any, type]]:
    """(``triton.knobs.runtime``, ``knobs.HookChain``) where this Triton has them, else None. The cached direct
    launch must see a profiler's launch hooks to step aside for them; a Triton without ``knobs.runtime``'s hooks
    therefore gets no cache (every launch is Triton's own ``kernel[grid](...)``: same results, a few µs more host
    time) and no C++ host path."""
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    if not all(hasattr(runtime, h) for h in ("launch_enter_hook", "launch_exit_hook")):
        return None
    return runtime, getattr(knobs, "HookChain", type(None))


_KNOBS = triton_launch_knobs() if HAS_TRITON else None
_RUNTIME, _HookChain = _KNOBS if _KNOBS is not None else (None, type(None))
if HAS_TRITON:
    from triton.runtime import driver as _triton_driver


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints (plain integer maths: triton.cdiv is a ConstexprFunction in 3.8)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def rows_view(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """(t or a (rows, n) view of it with unit column stride, row stride) for a row-wise kernel; copies only when
    no such view exists. A contiguous t is passed as is (its row stride is n): no reshape on the common path."""
    if t.is_contiguous():
        return t, n
    t2 = t.reshape(-1, n)
    if n > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2, t2.stride(0)


_Tensor = torch.Tensor
_MAX_ENTRIES = 4096


def _tensor_spec(t: torch.Tensor) -> tuple:
    """What Triton specialises a pointer argument on: pointee dtype, 16-byte alignment."""
    return t.dtype, t.data_ptr() & 15 == 0


def _int_spec(v: int) -> tuple:
    """What Triton specialises an int argument on: width (i32 / i64 / u64), == 1 (a constant), % 16 == 0."""
    return -0x80000000 <= v < 0x80000000, v < 0x8000000000000000, v == 1, v & 15 == 0


class _Entry:
    """One compiled variant, launched by calling Triton's C launcher directly: the arguments Triton's Python
    ``CudaLauncher.__call__`` would pass are fixed per compiled kernel except grid, stream and the kernel args."""

    __slots__ = ("compiled", "c", "function", "coop", "pdl", "metadata", "annotations", "signature", "tail",
                 "stream", "device")

    def __init__(self, compiled: Any, tail: tuple, stream: Any, device: Any) -> None:
        run = compiled.run  # the driver launcher (CudaLauncher), bound once
        self.compiled = compiled
        self.device = device  # current-device getter, only on multi-GPU machines (else None)
        self.function = compiled.function
        self.metadata = compiled.packed_metadata
        self.tail = tail  # constexpr values: the launcher takes every kernel parameter, in order
        self.stream = stream  # the driver's current-stream getter
        if _direct_launchable(run):
            self.c = run.launch
            self.coop, self.pdl = run.launch_cooperative_grid, run.launch_pdl
            self.annotations, self.signature = run.arg_annotations, run.kernel_signature
        else:  # scratch buffers, sanitiser, another backend: Triton's own launcher, same call shape
            self.c = _ViaLauncher(run).__call__
            self.coop = self.pdl = self.annotations = self.signature = None


def _direct_launchable(run: Any) -> bool:
    """Whether ``run`` is Triton 3.8's CudaLauncher with nothing to allocate per launch, so its C ``launch``
    can be called with the same arguments ``CudaLauncher.__call__`` would pass it."""
    return (type(run).__name__ == "CudaLauncher"
            and all(hasattr(run, a) for a in ("launch", "arg_annotations", "kernel_signature",
                                               "launch_cooperative_grid", "launch_pdl"))
            and getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0
            and not getattr(run, "gsan_enabled", True))


class _ViaLauncher:
    """Takes the C launcher's arguments and calls Triton's Python launcher (for kernels that need scratch)."""

    __slots__ = ("run",)

    def __init__(self, run: Any) -> None:
        self.run = run

    def __call__(self, gx, gy, gz, stream, function, _coop, _pdl, metadata, _m, _h0, _h1, _s0, _s1, _ann, _sig,
                 args):
        self.run(gx, gy, gz, stream, function, metadata, None, None, None, *args)


_ALL_KERNELS: "weakref.WeakSet[LeanKernel]" = weakref.WeakSet()


class LeanKernel:
    """A ``@triton.jit`` kernel launched through a cache of its compiled variants.

    ``launch(key, grid, args, device_index, consts, num_warps)``: ``args`` are the runtime parameters in order,
    ``consts`` the trailing constexpr parameters in order (the kernels put them last). ``key`` is the caller's
    cache key; it must determine everything the compiled variant depends on: the constexprs and num_warps, the
    device index, and what Triton specialises the runtime ``args`` on (the value class of every int, i.e. width,
    ``== 1`` and ``% 16 == 0``; the dtype and 16-byte alignment of every tensor except fresh allocations, whose
    dtype the key must still fix). `spec_key` computes such a key from the arguments (slower; for callers
    without a cheaper one).
    """

    __slots__ = ("fn", "name", "const_names", "cache", "__weakref__")

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.name = getattr(fn, "__name__", repr(fn))
        params = getattr(fn, "params", None)
        if params is None:  # the interpreter's wrapper: names from the Python signature
            import inspect
            params = list(inspect.signature(fn.fn).parameters.values())
            consts = [p.name for p in params if "constexpr" in str(p.annotation)]
        else:
            consts = [p.name for p in params if p.is_constexpr]
        n = len(params)
        if [getattr(p, "name", None) for p in params][n - len(consts):] != consts:
            raise TypeError(f"{self.name}: constexpr parameters must come last")
        self.const_names = tuple(consts)
        self.cache: dict = {}
        _ALL_KERNELS.add(self)

    def launch(self, key: Any, grid: tuple[int, int, int], args: tuple, device_index: Optional[int],
               consts: tuple, num_warps: int = 4) -> None:
        """Launch: the cached variant's C launcher when ``key`` is known (and no launch hook is set and its
        device is current), else Triton's ordinary launch, whose compiled kernel is then cached."""
        e = self.cache.get(key)
        if e is not None:
            h0, h1 = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook  # no launch hook set (Triton 3.8 keeps empty HookChains)
            if ((h0 is None or h0.__class__ is _HookChain and not h0.calls)
                    and (h1 is None or h1.__class__ is _HookChain and not h1.calls)
                    and (e.device is None or e.device() == device_index)):
                e.c(grid[0], grid[1], grid[2], e.stream(device_index), e.function, e.coop, e.pdl, e.metadata, None,
                    None, None, None, None, e.annotations, e.signature, args + e.tail)
                return
        self._first_launch(key, grid, device_index, args, consts, num_warps)

    def launch_traced(self, grid: tuple[int, int, int], device_index: Optional[int], args: tuple, consts: tuple,
                      num_warps: int = 4) -> None:
        """The launch inside a ``torch.library.triton_op``: through ``wrap_triton``, which records the kernel
        for inductor when tracing and launches it normally otherwise."""
        torch.library.wrap_triton(self.fn)[grid](*args, num_warps=num_warps, **dict(zip(self.const_names, consts)))

    def _first_launch(self, key: Any, grid: tuple, device_index: Optional[int], args: tuple, consts: tuple,
                      num_warps: int) -> None:
        meta = dict(zip(self.const_names, consts))
        ctx = (torch.cuda.device(device_index) if device_index is not None and device_index >= 0
               and torch.cuda.is_available()
               else contextlib.nullcontext())
        with ctx:
            compiled = self.fn[grid](*args, num_warps=num_warps, **meta)
        # Cache only real compiled kernels on the current device: the interpreter returns none, and a launch
        # on a non-current device must go through Triton's own device switch every time. Without the launch
        # hooks to check (`triton_launch_knobs`), nothing is cached.
        if (_KNOBS is None or compiled is None or not hasattr(compiled, "packed_metadata")
                or not _is_current(device_index)):
            return
        if len(self.cache) >= _MAX_ENTRIES:  # one entry per shape class: bounded even for ever-changing shapes
            self.cache.clear()
        # A compiled kernel is loaded in the device's context: with several GPUs, launch it directly only while
        # that device is current (Triton's own path switches otherwise).
        active = _triton_driver.active
        multi = device_index is not None and device_index >= 0 and torch.cuda.is_available() \
            and torch.cuda.device_count() > 1
        self.cache[key] = _Entry(compiled, consts, active.get_current_stream,
                                 active.get_current_device if multi else None)


def spec_key(args: tuple, device_index: Optional[int], consts: tuple, num_warps: int) -> tuple:
    """A `LeanKernel.launch` key computed from the arguments themselves (every tensor's dtype and alignment,
    every int's value class)."""
    return (tuple([_tensor_spec(a) if a.__class__ is _Tensor else _int_spec(a) if a.__class__ is int
                   else a.__class__ for a in args]), device_index, num_warps, consts)


def _is_current(device_index: Optional[int]) -> bool:
    """Whether launches for ``device_index`` (a tensor's ``get_device()``: -1 off CUDA; None: unknown) go to the
    driver's current device."""
    try:
        return max(device_index or 0, 0) == _triton_driver.active.get_current_device()
    except Exception:  # pragma: no cover - no driver
        return False
