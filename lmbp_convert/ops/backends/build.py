"""The one build/load helper of the back ends compiled on the user's machine (`cpu_native`, `cuda_host`).

Both are C++ built at first use with the host's compiler, cached on disk, and loaded into the process; both must
survive concurrent first uses (pytest-xdist, DDP ranks), a missing compiler and a failing build. So the steps are
written once here: compiler discovery (`compiler`), the cache folder and key (`build_root`, `cache_key`), one build
under a file lock with an atomic install (`build_once`), the one stderr line a first build prints
(`announce_build`), and `NativeBuild`, the state a back end is in (unloaded -> ready, off or failed) with its
status, build info, `disabled()` switch, and the one warning plus fallback when the build or the load fails.

Cache: ``$LMBP_CPU_NATIVE_DIR`` or ``<torch_extensions>/lmbp_convert_cpu``; each back end's key folds in
everything its binary depends on (source, compiler, flags, torch, and the CPU or the Python it was built for), so a
cache shared by different machines never runs code built for another.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

__all__ = ["ENV_DIR", "BUILD_SECONDS", "build_root", "compiler", "cache_key", "file_lock", "build_once",
           "announce_build", "compile_into", "NativeBuild"]

ENV_DIR = "LMBP_CPU_NATIVE_DIR"
SOURCES = Path(__file__).with_name("csrc")

#: Seconds a first build took, measured on a 2-core VM (`csrc/cpu_ops.cpp` 12.6 s, `csrc/cuda_host.cpp` 24 s):
#: the figure the one line announcing a build quotes.
BUILD_SECONDS = {"cpu_ops": 15, "cuda_host": 25}
_announced: set = set()


def build_root() -> Path:
    """The cache folder every back end's builds live under."""
    root = os.environ.get(ENV_DIR)
    if root:
        return Path(root)
    base = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not base:
        from torch import _appdirs

        base = _appdirs.user_cache_dir(appname="torch_extensions")
    return Path(base) / "lmbp_convert_cpu"


def compiler() -> Optional[str]:
    """``$CXX``, else the first of c++, g++, clang++ on PATH; None when there is none."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or (cxx if os.path.isfile(cxx) else None)
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def cache_key(*parts: bytes | str) -> str:
    """16 hex digits of a hash over ``parts`` (each ended by a NUL): the name of one build in the cache."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock across processes (POSIX); elsewhere the atomic install alone keeps builds safe."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def announce_build(what: str, source: Path, cxx: str, root: Path, key: str) -> None:
    """One line on stderr before a first build (once per process and ``key``): a silent ~10-25 s pause at the
    first op looks like a hang. Not a warning: nothing is wrong, and it must not turn into an error under
    ``-W error``."""
    if key in _announced:
        return
    _announced.add(key)
    print(f"lmbp_convert: compiling {what} ({source.name}, {Path(cxx).name}), once per machine: about "
          f"{BUILD_SECONDS[key]} s; cached in {root}", file=sys.stderr, flush=True)


#: ``compile(cxx, flags, out)``: builds into ``out`` or raises RuntimeError (each back end's command line).
Compile = Callable[[str, list, Path], None]


def build_once(target: Path, cxx: str, flags: list[str], compile_fn: Compile, what: str, source: Path,
               key: str) -> bool:
    """Build ``target`` unless the cache holds it; True when this call compiled it. Under a file lock beside the
    target, so concurrent first uses build once; announced on stderr first (`announce_build`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / "lock"):
        if target.exists():
            return False
        announce_build(what, source, cxx, build_root(), key)
        compile_fn(cxx, flags, target)
        return True


def compile_into(out: Path, command: Callable[[str], list], timeout_s: int, error_line: Callable[[str], str]) -> None:
    """Run the compiler line ``command(tmp)``, which writes ``tmp`` (a fresh file beside ``out``: same file
    system), then rename it onto ``out``: a concurrent reader sees no file or the whole library. ``tmp`` is
    removed whatever happens; a failure raises RuntimeError with ``error_line(stderr)``."""
    fd, tmp = tempfile.mkstemp(suffix=".so", prefix=".build-", dir=out.parent)
    os.close(fd)
    try:
        cmd = command(tmp)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"{Path(cmd[0]).name} failed: {error_line(proc.stderr)}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class NativeBuild:
    """The state of one back end that is built at first use: ``state`` is "unloaded", "ready" (``handle`` is the
    loaded library or module), "off" (not asked for, or switched off) or "failed" (one warning said why; the
    fallback runs). ``suspended`` > 0 inside `disabled`.

    ``off_reason()``: why the back end is off before any build (None: build it). ``build()``: builds and loads,
    returning (handle, info) or raising. ``on_change``: called after every switch (load, `disabled`, `reload`).
    """

    def __init__(self, what: str, fallback: str, skip_hint: str, off_reason: Callable[[], Optional[str]],
                 build: Callable[[], tuple[Any, dict]], on_change: Callable[[], None] = lambda: None) -> None:
        self.what, self.fallback, self.skip_hint = what, fallback, skip_hint
        self.off_reason, self.build, self.on_change = off_reason, build, on_change
        self.lock = threading.Lock()
        self.handle: Any = None
        self.state = "unloaded"
        self.reason = ""
        self.info: dict = {}
        self.suspended = 0

    def load(self) -> Any:
        """The handle, building and loading it on the first call; None when off or failed."""
        with self.lock:
            if self.state == "unloaded":
                off = self.off_reason()
                if off is not None:
                    self.state, self.reason = "off", off
                elif self.handle is not None:  # asked for again after `reload`: loaded already
                    self.state = "ready"
                else:
                    try:
                        t0 = time.perf_counter()
                        self.handle, info = self.build()
                        self.info.update(info, seconds=time.perf_counter() - t0)
                        self.state = "ready"
                    except Exception as e:  # any failure: the fallback runs instead
                        self.state, self.reason = "failed", str(e) or type(e).__name__
                        warnings.warn(f"lmbp_convert: {self.what} unavailable ({self.reason}); using the "
                                      f"{self.fallback} ({self.skip_hint})", RuntimeWarning, stacklevel=4)
                self.on_change()
        return self.handle if self.state == "ready" else None

    def get(self) -> Any:
        """`load` without the lock once loaded (the hot paths' check)."""
        return self.handle if self.state == "ready" else self.load()

    def reload(self) -> None:
        """Read the switches again at the next use (a loaded handle is kept, not rebuilt)."""
        with self.lock:
            self.state = "unloaded"
            self.on_change()

    def build_info(self) -> dict:
        """Library path, compiler, flags, whether this process compiled it and the seconds build + load took."""
        self.load()
        return dict(self.info)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The fallback inside the block (tests and benchmarks compare the two)."""
        self.suspended += 1
        self.on_change()
        try:
            yield
        finally:
            self.suspended -= 1
            self.on_change()
