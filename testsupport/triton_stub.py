"""Run the CUDA (Triton) path of the lmbp ops on a machine without a GPU, every launch a no-op, to time its host side.

Why: on a GPU the converted model's step is bound by host time (Python launchers, argument specialisation,
allocation) as much as by kernels; that part can be measured on any CPU. The kernels are compiled for a real
target (sm_90 by default, Triton's own ptxas), and everything between the op's Python entry and the driver
call runs for real: the op's launcher, ``JITFunction.run`` (specialisation, cache key, the compiled-kernel
cache), Triton's Python launcher and its C launcher (``driver.c``: argument parsing, ``data_ptr()`` of every
tensor). Only the driver is a stub: a tiny ``libcuda.so.1`` built here with gcc whose functions succeed and do
nothing (``cuLaunchKernelEx`` counts launches). Tensors are CPU tensors; ``torch.empty`` and friends run on the
CPU allocator, which costs about what the CUDA caching allocator does on the host. The driver's current
device and stream are Python lambdas returning 0 (in production: ``torch.cuda.current_device`` and a C getter),
a fraction of a µs either way.

When no C compiler (or no Python headers) is available, Triton's C launcher cannot be built either; the
stub (or ``activate(native=False)``) then replaces only the final C call with a Python no-op (``mode == "python-launch"``), which omits its argument
parsing (a few µs per launch): the report says which mode ran.

Routing: the ops pick the Triton path for CUDA tensors (``use_triton``); inside ``with triton_path():`` every
``use_triton`` in ``lmbp_convert.ops`` accepts CPU tensors of the Triton dtypes too (outside it, and during
``convert()``, whose verification needs real values, the ops keep their PyTorch path). Kernels never run, so
outputs hold whatever memory ``torch.empty`` returned (denormals are flushed so garbage cannot slow the CPU
maths around them); use this only for timing, never for values. Call :func:`activate` once per process,
before the first op call, and do not use ``torch.cuda`` afterwards (the stub is not a CUDA driver for torch).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib
import os
import pkgutil
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

_STUB_C = r"""
#include <stddef.h>
#include <string.h>
typedef unsigned long long u64;
static long long launches = 0;
long long lmbp_stub_launches(void) { return launches; }
int cuInit(unsigned f) { return 0; }
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
int cuDeviceGet(int *d, int o) { *d = o; return 0; }
int cuDeviceGetCount(int *n) { *n = 1; return 0; }
int cuDeviceGetAttribute(int *v, int a, int d) {
  switch (a) {
    case 97: *v = 232448; break;  /* MAX_SHARED_MEMORY_PER_BLOCK_OPTIN (H100/H200) */
    case 81: *v = 233472; break;  /* MAX_SHARED_MEMORY_PER_MULTIPROCESSOR */
    case 12: *v = 65536; break;   /* MAX_REGISTERS_PER_BLOCK */
    case 16: *v = 132; break;     /* MULTIPROCESSOR_COUNT */
    case 10: *v = 32; break;      /* WARP_SIZE */
    case 13: *v = 1980000; break; /* CLOCK_RATE */
    case 36: *v = 3201000; break; /* MEMORY_CLOCK_RATE */
    case 37: *v = 6144; break;    /* GLOBAL_MEMORY_BUS_WIDTH */
    case 75: *v = CC_MAJOR; break;
    case 76: *v = CC_MINOR; break;
    default: *v = 0;
  }
  return 0;
}
int cuDevicePrimaryCtxRetain(void **c, int d) { *c = (void *)1; return 0; }
int cuCtxGetCurrent(void **c) { *c = (void *)1; return 0; }
int cuCtxSetCurrent(void *c) { return 0; }
int cuCtxGetDevice(int *d) { *d = 0; return 0; }
int cuCtxGetLimit(size_t *v, int l) { *v = 0; return 0; }
int cuCtxSetLimit(int l, size_t v) { return 0; }
int cuModuleLoadData(void **m, const void *img) { *m = (void *)1; return 0; }
int cuModuleUnload(void *m) { return 0; }
int cuModuleGetFunction(void **f, void *m, const char *n) { *f = (void *)1; return 0; }
int cuFuncGetAttribute(int *v, int a, void *f) {
  *v = a == 0 ? 1024 : (a == 4 ? 32 : 0); /* MAX_THREADS_PER_BLOCK, NUM_REGS; no spills, no static smem */
  return 0;
}
int cuFuncSetAttribute(void *f, int a, int v) { return 0; }
int cuFuncSetCacheConfig(void *f, int c) { return 0; }
int cuGetErrorString(int e, const char **s) { *s = "lmbp stub driver"; return 0; }
int cuPointerGetAttribute(void *data, int a, u64 p) { *(u64 *)data = p; return 0; }
int cuPointerGetAttributes(unsigned n, int *a, void **data, u64 p) {
  for (unsigned i = 0; i < n; i++) if (data[i]) memset(data[i], 0, sizeof(int));
  return 0;
}
/* The last launches, for tests comparing launch paths: config, attributes and parameter words. A kernel handle
   tagged RECORD_TAG | (id << 8) | nparams (tests' fake kernels) says how many parameters to read. */
typedef struct {
  unsigned gx, gy, gz, bx, by, bz, shared;
  void *stream;
  void *attrs;
  unsigned nattrs;
} cfg_t;
typedef struct { int id; char pad[4]; char value[64]; } attr_t;
typedef struct {
  unsigned grid[3], block[3], shared, nattrs;
  u64 stream, function;
  int attr_id[4], attr_value[4];
  int nparams;
  u64 params[32];
} record_t;
#define RECORD_TAG 0x7a3b000000ull
static record_t records[64];
long long lmbp_stub_records(record_t *out, long long i) {
  if (out && i >= 0 && i < launches && i >= launches - 64) memcpy(out, &records[i % 64], sizeof(record_t));
  return launches;
}
int cuLaunchKernelEx(const void *cfg_, void *f, void **params, void **extra) {
  const cfg_t *cfg = (const cfg_t *)cfg_;
  record_t *r = &records[launches % 64];
  memset(r, 0, sizeof(*r));
  r->grid[0] = cfg->gx; r->grid[1] = cfg->gy; r->grid[2] = cfg->gz;
  r->block[0] = cfg->bx; r->block[1] = cfg->by; r->block[2] = cfg->bz;
  r->shared = cfg->shared; r->stream = (u64)cfg->stream; r->function = (u64)f;
  r->nattrs = cfg->nattrs;
  for (unsigned i = 0; i < cfg->nattrs && i < 4; i++) {
    const attr_t *a = (const attr_t *)cfg->attrs + i;
    r->attr_id[i] = a->id;
    memcpy(&r->attr_value[i], a->value, sizeof(int));
  }
  if (((u64)f & ~0xffffffull) == RECORD_TAG) {
    r->nparams = (int)((u64)f & 0xff);
    for (int i = 0; i < r->nparams && i < 32; i++) memcpy(&r->params[i], params[i], sizeof(u64));
  }
  launches++;
  return 0;
}
int cuLaunchKernel(void *f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g, unsigned s,
                   void *st, void **params, void **extra) { launches++; return 0; }
int cuOccupancyMaxActiveClusters(int *n, void *f, const void *cfg) { *n = 1; return 0; }
int cuTensorMapEncodeTiled() { return 0; }
int cuTensorMapEncodeIm2col() { return 0; }
"""


@dataclass
class StubState:
    """What :func:`activate` did: ``mode`` is "native-launch" (Triton's C launcher on the stub libcuda) or
    "python-launch" (its final C call replaced by a Python no-op)."""

    mode: str
    arch: int
    patched: list = field(default_factory=list)
    launch_count: Callable[[], int] = lambda: 0
    lib: object = None  # the stub libcuda (ctypes), in "native-launch" mode
    note: str = ""
    routing: object = None


_STATE: Optional[StubState] = None


def _build_libcuda(arch: int) -> str:
    """Build the stub driver once per (source, arch) into a cache folder; returns its directory."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    src = _STUB_C.replace("CC_MAJOR", str(arch // 10)).replace("CC_MINOR", str(arch % 10))
    key = hashlib.sha1(src.encode()).hexdigest()[:16]
    d = os.path.join(tempfile.gettempdir(), f"lmbp_stub_libcuda_{key}")
    so = os.path.join(d, "libcuda.so.1")
    if not os.path.exists(so):
        tmp = tempfile.mkdtemp(prefix="lmbp_stub_build_")
        with open(os.path.join(tmp, "stub.c"), "w") as f:
            f.write(src)
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                        os.path.join(tmp, "libcuda.so.1"), os.path.join(tmp, "stub.c")],
                       check=True, capture_output=True)
        os.symlink("libcuda.so.1", os.path.join(tmp, "libcuda.so"))
        try:
            os.rename(tmp, d)
        except OSError:  # built concurrently by another process: use theirs
            shutil.rmtree(tmp, ignore_errors=True)
    return d


def _stub_driver(arch: int, native: bool):
    """A Triton CudaDriver whose device, stream and target come from the stub, not from torch.cuda."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia import driver as nv

    if native:
        nv.CudaUtils()  # builds and loads Triton's driver.c against the stub libcuda.so.1
        drv = nv.CudaDriver.__new__(nv.CudaDriver)
        drv.utils = nv.CudaUtils()
    else:
        drv = nv.CudaDriver.__new__(nv.CudaDriver)
        drv.utils = _PythonUtils()
        nv.PyKernelArg = lambda nested_tuple, type: (type, nested_tuple)  # what annotate_arguments builds
        nv.ARG_CONSTEXPR, nv.ARG_KERNEL, nv.ARG_TUPLE = 0, 1, 2
    drv.launcher_cls = nv.CudaLauncher
    drv.get_current_device = lambda: 0
    drv.set_current_device = lambda device: None
    drv.get_current_stream = lambda device=None: 0
    drv.get_device_capability = lambda device=None: (arch // 10, arch % 10)
    target = GPUTarget("cuda", arch, 32)
    drv.get_current_target = lambda: target
    drv.get_active_torch_device = lambda: torch.device("cpu")
    return drv


class _PythonUtils:
    """Triton's CudaUtils with every driver call a Python no-op (used when no C compiler is present)."""

    def __init__(self):
        self.launches = 0

    def launch(self, *args):
        self.launches += 1

    def load_binary(self, name, kernel, shared, device):
        return 1, 1, 32, 0, 1024

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "max_num_regs": 65536, "multiprocessor_count": 132, "warpSize": 32,
                "sm_clock_rate": 1980000, "mem_clock_rate": 3201000, "mem_bus_width": 6144}

    def unload_module(self, module):
        pass

    def build_signature_metadata(self, sig):
        return None


class _Routing:
    """Swaps every ``use_triton`` in lmbp_convert.ops for one that also accepts CPU tensors, and back."""

    def __init__(self):
        import lmbp_convert.ops as ops_pkg
        from lmbp_convert.ops import _common

        def use_triton_any_device(x: torch.Tensor) -> bool:
            return x.dtype in _common.TRITON_DTYPES

        self.mods = []
        for info in pkgutil.iter_modules(ops_pkg.__path__):
            mod = importlib.import_module(f"{ops_pkg.__name__}.{info.name}")
            if callable(getattr(mod, "use_triton", None)):
                self.mods.append((mod, mod.use_triton))
        if not self.mods:
            raise RuntimeError("lmbp_convert.ops exposes no use_triton to route CPU tensors to the Triton path; "
                               "update testsupport/triton_stub.py for the new dispatch")
        self.stub = use_triton_any_device

    def set(self, on: bool) -> None:
        for mod, orig in self.mods:
            mod.use_triton = self.stub if on else orig


@contextlib.contextmanager
def triton_path(on: bool = True):
    """Inside: the ops take their Triton path (stubbed launches) for CPU tensors; ``on=False``: the PyTorch path."""
    if _STATE is None:
        raise RuntimeError("call _triton_stub.activate() first")
    _STATE.routing.set(on)
    try:
        yield
    finally:
        _STATE.routing.set(False)


#: Marks a kernel handle whose launches the stub records with their parameters: RECORD_TAG | (id << 8) | nparams.
RECORD_TAG = 0x7a3b000000


class _Record(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("nattrs", ctypes.c_uint), ("stream", ctypes.c_uint64), ("function", ctypes.c_uint64),
                ("attr_id", ctypes.c_int * 4), ("attr_value", ctypes.c_int * 4), ("nparams", ctypes.c_int),
                ("params", ctypes.c_uint64 * 32)]


def launch_records(since: int) -> list[dict]:
    """The driver launches made since launch number ``since`` (at most the last 64), as the stub libcuda saw
    them: grid, block, shared bytes, stream, function handle, launch attributes (id, first int of the value)
    and, for tagged handles (`RECORD_TAG`), the raw 8-byte word at each parameter address. Native mode only."""
    st = state()
    if st.lib is None:
        raise RuntimeError("launch records need the stub libcuda (native-launch mode)")
    fn = st.lib.lmbp_stub_records
    fn.restype = ctypes.c_longlong
    total = fn(None, ctypes.c_longlong(0))
    out = []
    for i in range(max(since, total - 64), total):
        r = _Record()
        fn(ctypes.byref(r), ctypes.c_longlong(i))
        out.append({"grid": tuple(r.grid), "block": tuple(r.block), "shared": r.shared, "stream": r.stream,
                    "function": r.function,
                    "attrs": [(r.attr_id[j], r.attr_value[j]) for j in range(min(r.nattrs, 4))],
                    "params": [r.params[j] for j in range(min(r.nparams, 32))]})
    return out


def state() -> StubState:
    """What :func:`activate` installed (RuntimeError before it)."""
    if _STATE is None:
        raise RuntimeError("call _triton_stub.activate() first")
    return _STATE


def activate(arch: int = 90, native: Optional[bool] = None) -> StubState:
    """Install the stub driver and route the ops' CPU tensors to their Triton path (idempotent).

    native: True = Triton's C launcher on the stub libcuda (needs gcc); False = Python no-op launch;
    None = native when it builds, else Python (the reason goes into ``StubState.note``).
    """
    global _STATE
    if _STATE is not None:
        return _STATE
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("the Triton stub needs compiled kernels: unset TRITON_INTERPRET")
    from lmbp_convert.ops import _common

    if not _common.HAS_TRITON:
        raise RuntimeError("Triton is not installed: the ops have no CUDA path to measure")
    torch.cuda.is_available()  # let torch settle its own CUDA probe before a libcuda.so.1 appears
    from triton import knobs
    from triton.runtime import driver

    note = ""
    state_mode = "python-launch"
    lib = None
    if native is not False:
        try:
            d = _build_libcuda(arch)
            lib = ctypes.CDLL(os.path.join(d, "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
            knobs.nvidia.libcuda_path = d
            drv = _stub_driver(arch, native=True)
            state_mode = "native-launch"
        except Exception as e:  # no compiler, or Triton's launcher did not build
            if native:
                raise
            note = f"Triton's C launcher unavailable ({type(e).__name__}: {str(e).strip()[:200]}); Python no-op launch"
            drv = _stub_driver(arch, native=False)
    else:
        drv = _stub_driver(arch, native=False)
    driver.set_active(drv)
    torch.set_flush_denormal(True)
    if lib is not None:
        lib.lmbp_stub_launches.restype = ctypes.c_longlong
        count = lib.lmbp_stub_launches
    else:
        count = lambda: drv.utils.launches  # noqa: E731
    routing = _Routing()
    _STATE = StubState(mode=state_mode, arch=arch, patched=[m.__name__ for m, _ in routing.mods],
                       launch_count=count, note=note, routing=routing, lib=lib)
    return _STATE
