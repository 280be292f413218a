"""The ops' CUDA host path in C++ (``csrc/cuda_host.cpp``): loader, kernel slots and the launch-miss callback.

Why: a Python ``autograd.Function`` around two direct launches already costs ~13 µs of host time per op call
over the native op it replaces; the C++ path does the forward, the graph node and the backward with one
Python -> C++ call, and launches the Triton-compiled kernels through ``cuLaunchKernelEx`` itself.

Division of work: Python owns the kernels. A *slot* is one Triton kernel with its constexprs and num_warps
(`slot`); the ops register the slots their calls may use. C++ computes what Triton specialises the runtime
arguments on and keeps one launch entry per (slot, specialisation class, device). On a miss it calls
`_miss`, which launches through `LeanKernel` (Triton compiles on first use, so that call is exactly today's)
and describes the compiled kernel for C++, or returns None where the kernel needs Triton's own launcher
(scratch buffers, clusters, another backend); such calls keep going through Python.

Self-check: the first C++ launch of every new variant on a GPU writes into fresh outputs, compared bit for bit
with what Triton's launcher wrote for the same call (one sync per variant); a mismatch warns once and turns the
C++ launches off for the process (``LMBP_CUDA_HOST_CHECK=0`` skips the check).

Build: at first use with the host's C++ compiler against torch's headers and libraries (no CUDA toolkit:
the driver is reached with dlopen), cached on disk next to the native CPU kernels
(``$LMBP_CPU_NATIVE_DIR`` or ``<torch_extensions>/lmbp_convert_cpu``) per (source, compiler, flags, torch,
Python), one build under a file lock for concurrent first uses; when the build or load fails, one warning says
why and the Python path runs (the shared build/load helper, `build`; the state is one `_HostState`, `HOST`).

Off unless asked for (``LMBP_CUDA_HOST=1``): it has run only on the stub driver so far. A wrong launch parameter is
not a wrong value the self-check could catch but an illegal memory access that kills the process, so until a GPU
run has validated it the Python launch path (Triton's own launcher) is the default. The variable is read at the
first CUDA op of the process; `reload` reads it again.
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from .. import _launch
from .._common import env_off, env_on, triton_interpreting
from . import build
from .build import NativeBuild, build_once, build_root, cache_key, compiler

__all__ = ["ext", "available", "status", "on", "disabled", "slot", "build_info", "state_cache", "clear",
           "under_interpreter", "reload"]

ENV_SWITCH = "LMBP_CUDA_HOST"
ENV_CHECK = "LMBP_CUDA_HOST_CHECK"
_SOURCE = build.SOURCES / "cuda_host.cpp"
_MODULE = "lmbp_cuda_host"
_BUILD_TIMEOUT_S = 600


# --------------------------------------------------------------------------------------------- build
def _flags() -> list[str]:
    from torch.utils import cpp_extension

    torch_lib = str(Path(torch.__file__).parent / "lib")
    inc = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    return ["-O2", "-std=c++20", "-fPIC", "-shared", "-fvisibility=hidden",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *inc,
            f"-L{torch_lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{torch_lib}",
            "-ldl"]


def _first_error(stderr: str) -> str:
    errs = [ln for ln in stderr.splitlines() if "error" in ln] or stderr.strip().splitlines()
    return (errs or ["no output"])[0][:300]


def _compile(cxx: str, flags: list[str], out: Path) -> None:
    build.compile_into(out, lambda tmp: [cxx, str(_SOURCE), "-o", tmp, *flags], _BUILD_TIMEOUT_S, _first_error)


def _build_and_load() -> tuple[Any, dict]:
    """The extension module and its build info (the module is built once per source, compiler, flags, torch and
    Python)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    if sys.platform != "linux":
        raise RuntimeError("the C++ host path is built for Linux only")
    flags = _flags()
    key = cache_key(_SOURCE.read_bytes(), cxx, " ".join(flags), torch.__version__, sys.version)
    target = build_root() / f"cuda_host-{key}" / f"{_MODULE}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    built = build_once(target, cxx, flags, _compile, "the C++ CUDA host path", _SOURCE, "cuda_host")
    spec = importlib.util.spec_from_file_location(_MODULE, target)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, dict(path=str(target), compiler=cxx, built=built)


def _off_reason() -> Optional[str]:
    if env_on(ENV_SWITCH):
        return None
    return (f"{ENV_SWITCH}={os.environ[ENV_SWITCH]}" if env_off(ENV_SWITCH) else
            f"C++ host path off by default until a GPU run validates it; {ENV_SWITCH}=1 turns it on")


def _build_and_connect() -> tuple[Any, dict]:
    knobs = _launch.triton_launch_knobs()
    if knobs is None:
        raise RuntimeError("this Triton has no triton.knobs.runtime launch hooks")
    mod, info = _build_and_load()
    mod.set_launcher(_miss, *knobs)
    mod.set_self_check(not env_off(ENV_CHECK))
    return mod, info


class _HostState(NativeBuild):
    """The host path's one state: the build (`NativeBuild`), `under_interpreter`'s count, the kernel slots C++
    launches by id, the ops' entry caches (emptied at every switch) and ``active``, whether the ops' CUDA calls
    take the C++ path (None: not known since the last switch)."""

    def __init__(self) -> None:
        super().__init__("C++ host path", "Python launch path", f"unset {ENV_SWITCH} to skip the build",
                         _off_reason, lambda: _build_and_connect(), self._changed)
        self.interpreter_ok = 0
        self.caches: list = []
        self.slots: list = []  # slot id -> (LeanKernel, constexprs, num_warps)
        self.slot_ids: dict = {}
        self.active: Optional[bool] = None

    def _changed(self) -> None:
        self.active = None
        for d in self.caches:
            d.clear()


HOST = _HostState()


def reload() -> None:
    """Read ``LMBP_CUDA_HOST`` again at the next CUDA op (it is read once per process): for a test or a notebook
    that sets it after the first use. A built extension is not rebuilt."""
    HOST.reload()


def ext() -> Any:
    """The loaded extension (building it on first call), or None: switched off, failed, inside `disabled`, or
    under Triton's interpreter (which compiles nothing, so every launch would go back through Python) unless
    `under_interpreter` asks for it."""
    if HOST.suspended or (not HOST.interpreter_ok and triton_interpreting()):
        return None
    return HOST.get()


def available() -> bool:
    return ext() is not None


def on() -> bool:
    """Whether the ops' CUDA calls take the C++ path now (the dispatch table's condition): `ext` is not None,
    asked once per switch."""
    active = HOST.active
    if active is None:
        active = HOST.active = ext() is not None
    return active


def status() -> str:
    """One line: which launch path the ops' CUDA path takes, and why."""
    if HOST.suspended:
        return "Python launch path (disabled())"
    if not HOST.interpreter_ok and triton_interpreting():
        return "Python launch path (Triton interpreter)"
    if ext() is not None:
        return f"C++ host path ({HOST.info.get('path', '')})"
    return f"Python launch path ({HOST.reason})"


def build_info() -> dict:
    return HOST.build_info()


def disabled() -> contextlib.AbstractContextManager:
    """The Python launch path inside the block (tests and benchmarks compare the two)."""
    return HOST.disabled()


@contextlib.contextmanager
def under_interpreter() -> Iterator[None]:
    """Use the C++ path under TRITON_INTERPRET=1 too: its autograd, allocations and saved tensors then run on
    CPU tensors, every launch through Python's interpreted kernels (tests check its semantics this way)."""
    HOST.interpreter_ok += 1
    HOST.on_change()
    try:
        yield
    finally:
        HOST.interpreter_ok -= 1
        HOST.on_change()


def state_cache() -> dict:
    """A dict the ops keep their bound C++ entry points in; emptied whenever the path switches (load,
    `disabled`), so a hot path can look its entry up with one ``dict.get``."""
    d: dict = {}
    HOST.caches.append(d)
    return d


def clear() -> None:
    """Drop every launch entry C++ holds (they name compiled kernels: when those go, e.g. a stub driver's)."""
    if HOST.handle is not None:
        HOST.handle.clear()
    HOST.on_change()


# ------------------------------------------------------------------------------------------- slots
def slot(kernel: Any, consts: tuple, num_warps: int) -> int:
    """The id C++ launches ``kernel`` with these constexprs and num_warps under."""
    key = (id(kernel), consts, num_warps)
    sid = HOST.slot_ids.get(key)
    if sid is None:
        HOST.slots.append((kernel, consts, num_warps))
        sid = HOST.slot_ids[key] = len(HOST.slots) - 1
    return sid


def _miss(sid: int, gx: int, gy: int, gz: int, args: tuple, device: int) -> Optional[tuple]:
    """Launch through `LeanKernel` (Triton's path the first time) and describe the compiled kernel for C++."""
    kernel, consts, warps = HOST.slots[sid]
    key = ("cuda_host", _launch.spec_key(args, device, consts, warps))
    kernel.launch(key, (gx, gy, gz), args, device, consts, warps)
    return describe(kernel.cache.get(key), len(args))


def describe(entry: Any, nargs: int) -> Optional[tuple]:
    """(function, num_warps, num_ctas, shared, cooperative, pdl, kept, types) of a cached direct-launch entry:
    ``kept`` one byte per runtime argument (0: Triton made it a constexpr), ``types`` Triton's extractor index
    of every kernel parameter (its C launcher's ``kernel_signature``). None: not launchable from C++."""
    if entry is None or entry.annotations is None or entry.metadata is None:
        return None
    src = getattr(entry.compiled, "src", None)
    sig = getattr(src, "signature", None)
    if not isinstance(sig, dict):
        return None
    kinds = list(sig.values())
    if len(kinds) < nargs or any(k != "constexpr" for k in kinds[nargs:]) or any(
            isinstance(k, tuple) for k in kinds):
        return None
    kept = bytes(int(k != "constexpr") for k in kinds[:nargs])
    types = bytes(entry.signature)
    warps, ctas, shared = entry.metadata
    return (int(entry.function), int(warps), int(ctas), int(shared), bool(entry.coop), bool(entry.pdl), kept,
            types)
