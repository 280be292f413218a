"""Every change the converter makes to a file system goes through here: durable writes (fsync of files and
directories), atomic no-replace renames, and one fault-injection point (``fault_hook``) that tests use to fail
each write, fsync and rename in turn.

Torch-free on purpose: the CLI checks and mends DST before it imports anything heavy.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Callable

#: called as ``fault_hook(op, path)`` before every file system change (op: "mkdir", "write", "copy", "fsync",
#: "rename", "remove"); a test sets it to raise at a chosen operation. None in normal use.
fault_hook: Callable[[str, str], None] | None = None

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_renameat2: Callable | None = None
_renameat2_lock = threading.Lock()
_renameat2_tried = False


def at(op: str, path: str | os.PathLike) -> None:
    """Announce a file system change (the fault-injection point)."""
    hook = fault_hook
    if hook is not None:
        hook(op, os.fspath(path))


def _libc_renameat2() -> Callable | None:
    global _renameat2, _renameat2_tried
    with _renameat2_lock:
        if not _renameat2_tried:
            _renameat2_tried = True
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
                fn = libc.renameat2
                fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                fn.restype = ctypes.c_int
                _renameat2 = fn
            except (OSError, AttributeError):  # not Linux, or a libc without renameat2 (glibc < 2.28)
                _renameat2 = None
        return _renameat2


def rename(src: Path, dst: Path) -> None:
    """Plain rename (replaces a file DST atomically)."""
    at("rename", dst)
    os.rename(src, dst)


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` atomically, failing with FileExistsError if ``dst`` exists (also a dangling
    link): of two processes racing for one new DST exactly one succeeds. ``renameat2(RENAME_NOREPLACE)`` where the
    kernel and file system have it; otherwise a hard link for files, and for directories an empty directory
    claimed with mkdir (which fails on an existing name) that rename then replaces atomically."""
    at("rename", dst)
    fn = _libc_renameat2()
    if fn is not None:
        rc = fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
            raise OSError(err, os.strerror(err), os.fspath(dst))
    if os.path.isdir(src) and not os.path.islink(src):
        os.mkdir(dst)  # FileExistsError if taken; from here on the empty directory is ours
        try:
            os.rename(src, dst)  # a directory may replace an empty directory atomically
        except BaseException:
            try:
                os.rmdir(dst)  # only if still empty: never removes what another process put there
            except OSError:
                pass
            raise
    else:
        os.link(src, dst, follow_symlinks=False)  # FileExistsError if taken
        os.unlink(src)


def fsync_file(path: Path) -> None:
    at("fsync", path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_fd(fd: int, path: Path) -> None:
    at("fsync", path)
    os.fsync(fd)


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (new names, renames) durable; a no-op where directories cannot be opened."""
    at("fsync", path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EBADF):  # some file systems cannot fsync a directory
            raise
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    """Create ``path`` (which must not exist) holding ``data``, durably."""
    at("write", path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        mv = memoryview(data)
        while len(mv):
            mv = mv[os.write(fd, mv):]
        fsync_fd(fd, path)
    finally:
        os.close(fd)


def copy_file(src: Path, dst: Path) -> None:
    """Copy a file's bytes to a new ``dst``, durably."""
    at("write", dst)
    shutil.copyfile(src, dst)
    fsync_file(dst)


def remove_tree(path: Path) -> bool:
    """Remove a file, link or directory tree, never crossing into another file system (a mount point inside an
    old DST, e.g. a bind-mounted data set, keeps its contents) and never following links. What cannot be removed
    stays; returns whether ``path`` is gone (the caller reports what stays)."""
    at("remove", path)
    if not (os.path.isdir(path) and not os.path.islink(path)):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError:
            return False
        return True
    try:
        dev = os.lstat(path).st_dev
    except OSError:
        return not os.path.lexists(path)
    root = os.path.realpath(path)
    mounts = _mount_points_under(root)  # bind mounts of the same file system keep st_dev: listed by the kernel
    stack: list[tuple[str, bool]] = [(root, False)]  # (directory, its entries already removed)
    while stack:
        d, emptied = stack.pop()
        if emptied:
            try:
                os.rmdir(d)
            except OSError:
                pass
            continue
        stack.append((d, True))
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    if e.stat(follow_symlinks=False).st_dev == dev and e.path not in mounts:
                        stack.append((e.path, False))
                    # else: a mount point: neither entered nor removed
                else:
                    os.unlink(e.path)
            except OSError:
                pass
    return not os.path.lexists(path)


def _mount_points_under(root: str) -> set[str]:
    """Mount points strictly below ``root`` (Linux: /proc/self/mountinfo; empty where unknown)."""
    out: set[str] = set()
    prefix = os.fsencode(root).rstrip(b"/") + b"/"
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4:
                    mp = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields[4])
                    if mp.startswith(prefix):
                        out.add(os.fsdecode(mp))
    except OSError:
        pass
    return out


def prefetch(paths: list[Path], budget: int) -> None:
    """Bring ``paths`` into the page cache, in order, up to ``budget`` bytes, so that the reads overlap the seconds
    the CLI spends importing torch and transformers. ``sendfile`` to /dev/null makes the kernel read the pages
    without copying them anywhere: nearly free when they are cached already (0.02 s of CPU for 1.2 GiB, where
    reading them costs 0.07-0.3 s), and it releases the GIL. ``POSIX_FADV_WILLNEED`` alone did not fill the cache
    in our measurements. A warm-up only: errors are ignored. (Beyond the budget a cold read would evict pages
    before they are used.)"""
    try:
        sink = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        for p in paths:
            if budget <= 0:
                return
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                n = min(os.fstat(fd).st_size, budget)
                budget -= n
                _drain(fd, sink, n)
            except OSError:
                pass
            finally:
                os.close(fd)
    finally:
        os.close(sink)


def _drain(fd: int, sink: int, n: int) -> None:
    off = 0
    if hasattr(os, "sendfile"):
        while off < n:
            k = os.sendfile(sink, fd, off, n - off)
            if k <= 0:
                return
            off += k
        return
    buf = memoryview(bytearray(8 << 20))  # pragma: no cover - no sendfile on this platform
    while off < n:
        k = os.preadv(fd, [buf[:n - off]], off)
        if k <= 0:
            return
        off += k


def available_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes), 0 where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
