"""Native CPU kernels for approx_act, the MS norms and the exact norm's affine: loader and Python entry points.

The PyTorch path costs ~10 passes over memory per approx-act forward and round-trips bf16 through fp32
copies; ``csrc/cpu_ops.cpp`` does each direction in one pass, in fp32 registers, rounding once to the output
dtype. It is plain C++ (no torch headers), compiled at first use with the host's C++ compiler for the host
CPU (``-O3 -march=native``: AVX2, AVX-512, ...), cached on disk, and called through ctypes.

Cache: ``$LMBP_CPU_NATIVE_DIR`` or ``<torch_extensions>/lmbp_convert_cpu``, one build per (source, compiler,
flags, torch version, CPU): a cache shared by different machines never runs code built for another CPU.
Concurrent first uses (pytest-xdist, DDP ranks) build once under a file lock and install atomically. A build
first prints one line on stderr (what it compiles, about how long, where it is cached). These steps and the
state below (`LIBRARY`) are the shared build/load helper's (`build`); this file holds the flags, the cache key
and the entry points.

Fallback: ``LMBP_CPU_NATIVE=0`` turns the kernels off; without a compiler, or when the build or load fails,
one warning says why and the PyTorch path runs, with the same results. Each entry point returns None when
it does not apply (non-CPU or meta tensor, fp64, tensor subclass, a torch.func transform's tensor, a dispatch
mode or torch.compile tracing, an input autograd is recording as in double backward, a dtype combination the
kernels lack), and the caller then runs its PyTorch path: the kernels never see an input they are not correct for.

Threads: ``torch.get_num_threads()``, through the OpenMP runtime torch already loaded (one thread pool, with
at::parallel_for's chunking and grain size); where torch's runtime is not GNU's libgomp the library is built
without OpenMP (single-threaded) rather than load a second runtime.
"""
from __future__ import annotations

import ctypes
import os
import platform
import subprocess
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from .._common import env_off
from ..activations import ACTIVATIONS
from . import build
from .build import ENV_DIR, NativeBuild, build_once, build_root, cache_key, compiler

__all__ = ["available", "status", "usable", "disabled", "build_info", "act", "act_fwd", "act_bwd", "norm_fwd",
           "norm_bwd", "affine_fwd", "affine_bwd", "norm_affine_fwd", "norm_affine_bwd", "ENV_DIR"]

ENV_SWITCH = "LMBP_CPU_NATIVE"
ENV_ARCH = "LMBP_CPU_NATIVE_ARCH"
_SOURCE = build.SOURCES / "cpu_ops.cpp"
_ABI_VERSION = 4
_BUILD_TIMEOUT_S = 300

_DTYPE_ID = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The C++ enum (csrc/cpu_ops.cpp) numbers the kinds with the shared activation table's codes; the byte-exact
# tests against the PyTorch path catch any drift.
_KIND_ID = {name: a.code for name, a in ACTIVATIONS.items()}
_thresholds_cache: dict = {}


# --------------------------------------------------------------------------------------------- build
def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as fh:
            keep = [ln for ln in fh.read().splitlines()
                    if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _torch_uses_libgomp() -> bool:
    """True when the OpenMP runtime in this process is GNU's (pip torch on Linux bundles libgomp.so.1)."""
    try:
        with open("/proc/self/maps") as fh:
            return "libgomp" in fh.read()
    except OSError:
        return False


def _flag_sets(cxx: str) -> list[list[str]]:
    """Compiler flags to try, best first. ``$LMBP_CPU_NATIVE_ARCH`` replaces the target flags (e.g. "-mavx2 -mfma"
    to build the AVX2 kernels on an AVX-512 host, "" for the portable scalar loops)."""
    arch = ["-mcpu=native"] if platform.machine().lower() in ("arm64", "aarch64") else ["-march=native"]
    if ENV_ARCH in os.environ:
        arch = os.environ[ENV_ARCH].split()
    base = ["-O3", *arch, "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared", "-std=c++17"]
    sets = []
    if torch._C.has_openmp and _torch_uses_libgomp():
        sets.append(base + ["-fopenmp"])  # links libgomp.so.1: the copy torch loaded (same soname) is reused
    sets.append(base)
    return sets


def _cache_key(cxx: str, flags: Sequence[str], source: bytes) -> str:
    return cache_key(source, cxx, " ".join(flags), torch.__version__, _cpu_identity(), platform.platform())


def _compile(cxx: str, flags: list[str], out: Path) -> None:
    build.compile_into(out, lambda tmp: [cxx, *flags, str(_SOURCE), "-o", tmp], _BUILD_TIMEOUT_S,
                       lambda err: (err.strip().splitlines() or ["no output"])[-1][:200])


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    lib.lmbp_abi_version.argtypes, lib.lmbp_abi_version.restype = [], i32
    lib.lmbp_act_fwd.argtypes = [p, p, p, i64, i32, i32, i32, p, i32]
    lib.lmbp_act_bwd.argtypes = [p, p, p, i64, i32, i32, p, i32]
    lib.lmbp_norm_fwd.argtypes = [p, p, p, i64, i64, f64, i32, i32, i32, i32]
    lib.lmbp_norm_bwd.argtypes = [p, p, p, p, i64, i64, i32, i32, i32, i32]
    lib.lmbp_affine_fwd.argtypes = [p, p, p, p, i64, i64, i32, i32, i32]
    lib.lmbp_affine_bwd.argtypes = [p, p, p, p, p, p, p, i64, i64, i32, i32, i32]
    lib.lmbp_norm_affine_fwd.argtypes = [p, p, p, p, p, p, i64, i64, f64, i32, i32, i32, i32, i32]
    lib.lmbp_norm_affine_bwd.argtypes = [p, p, p, p, p, p, p, p, i64, i64, i32, i32, i32, i32, i32]
    for f in (lib.lmbp_norm_affine_fwd, lib.lmbp_norm_affine_bwd, lib.lmbp_act_fwd, lib.lmbp_act_bwd,
              lib.lmbp_norm_fwd, lib.lmbp_norm_bwd, lib.lmbp_affine_fwd, lib.lmbp_affine_bwd):
        f.restype = i32


def _build_and_load() -> tuple[ctypes.CDLL, dict]:
    """The library and its build info, for the first flag set that builds and loads (or the last error)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    source = _SOURCE.read_bytes()
    root = build_root()
    root.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in _flag_sets(cxx):
        target = root / _cache_key(cxx, flags, source) / "lmbp_cpu_ops.so"
        try:
            built = build_once(target, cxx, flags, _compile, "the native CPU kernels", _SOURCE, "cpu_ops")
            lib = ctypes.CDLL(str(target))
            _declare(lib)
            if lib.lmbp_abi_version() != _ABI_VERSION:
                raise RuntimeError(f"{target} has ABI version {lib.lmbp_abi_version()}, expected {_ABI_VERSION}")
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            errors.append(str(e))
            continue
        return lib, dict(path=str(target), compiler=cxx, flags=" ".join(flags), built=built)
    raise RuntimeError(errors[-1] if errors else "build failed")


def _off_reason() -> Optional[str]:
    return f"{ENV_SWITCH}={os.environ[ENV_SWITCH]}" if env_off(ENV_SWITCH) else None


#: The library's state (`build.NativeBuild`): built and loaded at the first call that could use it.
LIBRARY = NativeBuild("native CPU kernels", "PyTorch path", f"set {ENV_SWITCH}=0 to skip the build", _off_reason,
                      lambda: _build_and_load())


def available() -> bool:
    """True when the native kernels are built and loaded (builds them on first call)."""
    return LIBRARY.load() is not None


def _off() -> bool:
    """Known not to run now: switched off, failed, or inside `disabled` (reads state; builds nothing)."""
    lib = LIBRARY
    if lib.state == "unloaded":
        return bool(lib.suspended) or _off_reason() is not None
    return bool(lib.suspended) or lib.state != "ready"


def usable() -> bool:
    """The dispatch table's condition: eager and not `_off`. Builds nothing (a traced call must not; an fp64-only
    process never builds): the first entry-point call that applies builds them, and each still declines the calls
    it is not correct for."""
    return not torch.compiler.is_compiling() and not _off()


def status() -> str:
    """One line: where the kernels come from, or why the PyTorch path runs."""
    if LIBRARY.load() is not None:
        return f"native ({LIBRARY.info.get('flags', '')}; {LIBRARY.info.get('path', '')})"
    return f"PyTorch path ({LIBRARY.reason})"


def build_info() -> dict:
    """Library path, compiler, flags, whether this process compiled it and the seconds build + load took."""
    return LIBRARY.build_info()


def disabled() -> Iterator[None]:
    """Run the PyTorch path inside the block (tests and benchmarks compare the two)."""
    return LIBRARY.disabled()


# ------------------------------------------------------------------------------------------ dispatch
def _plain_cpu(t: torch.Tensor) -> bool:
    """A dense CPU tensor whose memory the kernels may read directly (not a torch.func wrapper: a batched or
    gradient-tracking tensor of a transform has no storage of its own)."""
    return (t.device.type == "cpu" and t.layout == torch.strided and type(t) in (torch.Tensor, torch.nn.Parameter)
            and not t.is_neg() and not torch._C._functorch.is_functorch_wrapped_tensor(t))


#: A TorchDispatchMode class attribute: True says the mode only observes which storages exist (a memory tracker),
#: so the kernels may run under it: they allocate every output with torch.empty, which the mode sees, and hold
#: nothing else but one row of fp32 scratch per thread.
OBSERVES_ALLOCATIONS_ONLY = "lmbp_observes_allocations_only"


def _modes_observe_allocations_only() -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return all(getattr(m, OBSERVES_ALLOCATIONS_ONLY, False) for m in _get_current_dispatch_mode_stack())


def _ready(*ts: torch.Tensor) -> Optional[ctypes.CDLL]:
    lib = LIBRARY
    if lib.suspended or lib.state in ("off", "failed"):
        return None
    if torch._C._len_torch_dispatch_stack() > 0 and not _modes_observe_allocations_only():
        return None  # a dispatch mode (tracer, FLOP counter, fake tensors) must see every op
    if not all(_plain_cpu(t) for t in ts):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return None  # a result autograd must record (double backward): the PyTorch path's ops
    return lib.handle if lib.state == "ready" else lib.load()


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _thresholds(values: Sequence[float]) -> ctypes.Array:
    key = tuple(values)
    arr = _thresholds_cache.get(key)
    if arr is None:
        arr = _thresholds_cache[key] = (ctypes.c_float * len(key))(*key)
    return arr


def act_fwd(x: torch.Tensor, kind: str, bits: int, thresholds_f32: Sequence[float]
            ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(act(x) in x's dtype and shape, packed codes) as approx_act's ``_fwd_torch``, or None (not applicable)."""
    if torch.compiler.is_compiling():  # dynamo traces the PyTorch path (no data pointers in a graph)
        return None
    dt = _DTYPE_ID.get(x.dtype)
    if dt is None or x.numel() == 0 or len(thresholds_f32) != 2 ** bits - 1:
        return None
    lib = _ready(x)
    if lib is None:
        return None
    xc = _contig(x)
    n = xc.numel()
    per_byte = 8 // (4 if bits == 3 else bits)
    y = torch.empty(x.shape, dtype=x.dtype)
    packed = torch.empty(-(-n // per_byte), dtype=torch.uint8)
    rc = lib.lmbp_act_fwd(xc.data_ptr(), y.data_ptr(), packed.data_ptr(), n, dt, _KIND_ID[kind], bits,
                          ctypes.addressof(_thresholds(thresholds_f32)), torch.get_num_threads())
    return (y, packed) if rc == 0 else None


def act(x: torch.Tensor, kind: str) -> Optional[torch.Tensor]:
    """The activation alone (no codes), the same values as :func:`act_fwd`'s, or None."""
    if torch.compiler.is_compiling():
        return None
    dt = _DTYPE_ID.get(x.dtype)
    if dt is None or x.numel() == 0:
        return None
    lib = _ready(x)
    if lib is None:
        return None
    xc = _contig(x)
    y = torch.empty(x.shape, dtype=x.dtype)
    rc = lib.lmbp_act_fwd(xc.data_ptr(), y.data_ptr(), None, xc.numel(), dt, _KIND_ID[kind], 0, None,
                          torch.get_num_threads())
    return y if rc == 0 else None


def act_bwd(grad: torch.Tensor, packed: torch.Tensor, bits: int, byte_table: torch.Tensor) -> Optional[torch.Tensor]:
    """grad * slope[code] in grad's dtype and shape, as approx_act's ``_bwd_torch``, or None.

    ``byte_table``: fp32 [256, P], the P slopes each packed byte stands for.
    """
    if torch.compiler.is_compiling():  # dynamo traces the PyTorch path (no data pointers in a graph)
        return None
    dt = _DTYPE_ID.get(grad.dtype)
    slot = 4 if bits == 3 else bits
    n = grad.numel()
    if (dt is None or n == 0 or packed.dtype != torch.uint8 or packed.numel() != -(-n // (8 // slot))
            or byte_table.dtype != torch.float32 or tuple(byte_table.shape) != (256, 8 // slot)):
        return None
    lib = _ready(grad, packed, byte_table)
    if lib is None:
        return None
    gc, pc, tc = _contig(grad), _contig(packed), _contig(byte_table)
    dx = torch.empty(grad.shape, dtype=grad.dtype)
    rc = lib.lmbp_act_bwd(gc.data_ptr(), pc.data_ptr(), dx.data_ptr(), n, dt, slot, tc.data_ptr(),
                          torch.get_num_threads())
    return dx if rc == 0 else None


def norm_fwd(x: torch.Tensor, n: int, eps: float, is_rms: bool, out_dtype: torch.dtype
             ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(ŷ with x's shape in out_dtype, rstd (rows,) fp32) as ms_norm's ``_fwd_torch``, or None."""
    if torch.compiler.is_compiling():  # dynamo traces the PyTorch path (no data pointers in a graph)
        return None
    dt, odt = _DTYPE_ID.get(x.dtype), _DTYPE_ID.get(out_dtype)
    if dt is None or odt is None or n <= 0 or x.numel() == 0 or x.numel() % n:
        return None
    lib = _ready(x)
    if lib is None:
        return None
    xc = _contig(x)
    rows = xc.numel() // n
    y = torch.empty(x.shape, dtype=out_dtype)
    rstd = torch.empty(rows, dtype=torch.float32)
    rc = lib.lmbp_norm_fwd(xc.data_ptr(), y.data_ptr(), rstd.data_ptr(), rows, n, float(eps), int(is_rms), dt,
                           odt, torch.get_num_threads())
    return (y, rstd) if rc == 0 else None


def norm_bwd(g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, is_rms: bool, x_dtype: torch.dtype
             ) -> Optional[torch.Tensor]:
    """dx with y's shape in x_dtype from the saved ŷ and rstd, as ms_norm's ``_bwd_torch``, or None."""
    if torch.compiler.is_compiling():  # dynamo traces the PyTorch path (no data pointers in a graph)
        return None
    ydt, ddt = _DTYPE_ID.get(y.dtype), _DTYPE_ID.get(x_dtype)
    rows = rstd.numel()
    if (ydt is None or ddt is None or g.dtype != y.dtype or g.shape != y.shape or rstd.dtype != torch.float32
            or rows == 0 or y.numel() == 0 or y.numel() % rows):
        return None
    lib = _ready(g, y, rstd)
    if lib is None:
        return None
    gc, yc, rc_ = _contig(g), _contig(y), _contig(rstd)
    dx = torch.empty(y.shape, dtype=x_dtype)
    rc = lib.lmbp_norm_bwd(gc.data_ptr(), yc.data_ptr(), rc_.data_ptr(), dx.data_ptr(), rows, y.numel() // rows,
                           int(is_rms), ydt, ddt, torch.get_num_threads())
    return dx if rc == 0 else None


def _row_param(p: Optional[torch.Tensor], n: int) -> bool:
    return p is None or (p.dtype == torch.float32 and tuple(p.shape) == (n,))


def affine_fwd(xhat: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor], out_dtype: torch.dtype
               ) -> Optional[torch.Tensor]:
    """``x̂·γ + β`` over x̂'s last dim in ``out_dtype``, bitwise norm_affine's ``torch.mul`` / ``torch.add`` route
    (γ, β: fp32 vectors), in one pass; or None."""
    if torch.compiler.is_compiling():
        return None
    dt, odt = _DTYPE_ID.get(xhat.dtype), _DTYPE_ID.get(out_dtype)
    n = xhat.shape[-1] if xhat.dim() else 0
    if dt is None or odt is None or n == 0 or xhat.numel() == 0 or not (_row_param(gamma, n) and _row_param(beta, n)):
        return None
    lib = _ready(xhat, gamma, *(() if beta is None else (beta,)))
    if lib is None:
        return None
    xc, gc = _contig(xhat), _contig(gamma)
    bc = None if beta is None else _contig(beta)
    y = torch.empty(xhat.shape, dtype=out_dtype)
    rc = lib.lmbp_affine_fwd(xc.data_ptr(), gc.data_ptr(), None if bc is None else bc.data_ptr(), y.data_ptr(),
                             xc.numel() // n, n, dt, odt, torch.get_num_threads())
    return y if rc == 0 else None


#: Rows per block of the affine backward's column sums (csrc/cpu_ops.cpp ``kAffineRows``).
_AFFINE_ROWS = 64


def _column_sums(rows: int, n: int, need_dw: bool, need_db: bool) -> tuple:
    """(dw, dβ, per-block partial sums) fp32 buffers of the affine backward; None for those not needed."""
    dw = torch.empty(n, dtype=torch.float32) if need_dw else None
    db = torch.empty(n, dtype=torch.float32) if need_db else None
    part = torch.empty(-(-rows // _AFFINE_ROWS), 2, n, dtype=torch.float32) if need_dw or need_db else None
    return dw, db, part


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def affine_bwd(g: torch.Tensor, xhat: torch.Tensor, gamma: torch.Tensor, need_dx: bool, need_dw: bool,
               need_db: bool) -> Optional[tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]]:
    """(dx̂ = g·γ in x̂'s dtype, dw = Σ g·x̂, dβ = Σ g in fp32; None for those not needed) of ``x̂·γ + β`` in one
    pass over g and x̂; or None. dx̂ is bitwise norm_affine's; the sums are fp32 in a fixed order (per block of
    rows, then the blocks in order), whatever the thread count."""
    if torch.compiler.is_compiling():
        return None
    gdt, xdt = _DTYPE_ID.get(g.dtype), _DTYPE_ID.get(xhat.dtype)
    n = xhat.shape[-1] if xhat.dim() else 0
    if (gdt is None or xdt is None or g.shape != xhat.shape or n == 0 or xhat.numel() == 0
            or not _row_param(gamma, n) or not (need_dx or need_dw or need_db)):
        return None
    lib = _ready(g, xhat, gamma)
    if lib is None:
        return None
    gc, xc, wc = _contig(g), _contig(xhat), _contig(gamma)
    rows = xc.numel() // n
    dx = torch.empty(xhat.shape, dtype=xhat.dtype) if need_dx else None
    dw, db, part = _column_sums(rows, n, need_dw, need_db)
    rc = lib.lmbp_affine_bwd(gc.data_ptr(), xc.data_ptr(), wc.data_ptr(), _ptr(dx), _ptr(dw), _ptr(db), _ptr(part),
                             rows, n, gdt, xdt, torch.get_num_threads())
    return (dx, dw, db) if rc == 0 else None


def norm_affine_fwd(x: torch.Tensor, n: int, eps: float, is_rms: bool, xhat_dtype: torch.dtype, gamma: torch.Tensor,
                    beta: Optional[torch.Tensor], out_dtype: torch.dtype
                    ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(x̂, rstd, y) of the exact norm in one pass over x: x̂ and rstd as :func:`norm_fwd`, y bitwise
    :func:`affine_fwd` of that x̂ (γ, β: fp32 vectors of n); or None."""
    if torch.compiler.is_compiling():
        return None
    dt, hdt, odt = _DTYPE_ID.get(x.dtype), _DTYPE_ID.get(xhat_dtype), _DTYPE_ID.get(out_dtype)
    if (dt is None or hdt is None or odt is None or n <= 0 or x.numel() == 0 or x.numel() % n
            or not (_row_param(gamma, n) and _row_param(beta, n))):
        return None
    lib = _ready(x, gamma, *(() if beta is None else (beta,)))
    if lib is None:
        return None
    xc, gc = _contig(x), _contig(gamma)
    bc = None if beta is None else _contig(beta)
    rows = xc.numel() // n
    xhat = torch.empty(x.shape, dtype=xhat_dtype)
    rstd = torch.empty(rows, dtype=torch.float32)
    y = torch.empty(x.shape, dtype=out_dtype)
    rc = lib.lmbp_norm_affine_fwd(xc.data_ptr(), xhat.data_ptr(), rstd.data_ptr(), gc.data_ptr(),
                                  None if bc is None else bc.data_ptr(), y.data_ptr(), rows, n, float(eps),
                                  int(is_rms), dt, hdt, odt, torch.get_num_threads())
    return (xhat, rstd, y) if rc == 0 else None


def norm_affine_bwd(g: torch.Tensor, xhat: torch.Tensor, rstd: torch.Tensor, gamma: torch.Tensor, is_rms: bool,
                    x_dtype: torch.dtype, need_dw: bool, need_db: bool
                    ) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]]:
    """(dx in x_dtype, dw, dβ fp32 or None) of the exact norm in one pass over g and x̂: bitwise :func:`affine_bwd`
    then :func:`norm_bwd` on its dx̂; or None."""
    if torch.compiler.is_compiling():
        return None
    gdt, xdt, ddt = _DTYPE_ID.get(g.dtype), _DTYPE_ID.get(xhat.dtype), _DTYPE_ID.get(x_dtype)
    n = xhat.shape[-1] if xhat.dim() else 0
    rows = xhat.numel() // n if n else 0
    if (gdt is None or xdt is None or ddt is None or g.shape != xhat.shape or rows == 0
            or rstd.dtype != torch.float32 or rstd.numel() != rows or not _row_param(gamma, n)):
        return None
    lib = _ready(g, xhat, rstd, gamma)
    if lib is None:
        return None
    gc, xc, rc_, wc = _contig(g), _contig(xhat), _contig(rstd), _contig(gamma)
    dx = torch.empty(xhat.shape, dtype=x_dtype)
    dw, db, part = _column_sums(rows, n, need_dw, need_db)
    rc = lib.lmbp_norm_affine_bwd(gc.data_ptr(), xc.data_ptr(), rc_.data_ptr(), wc.data_ptr(), dx.data_ptr(),
                                  _ptr(dw), _ptr(db), _ptr(part), rows, n, int(is_rms), gdt, xdt, ddt,
                                  torch.get_num_threads())
    return (dx, dw, db) if rc == 0 else None
