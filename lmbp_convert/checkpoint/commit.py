"""Putting a finished DST in place without losing anything, and mending what a killed run left beside it.

DST is written into a hidden sibling ``.DST.lmbp-tmp-<pid>-<random>`` and renamed into place only once it is
complete and fsync'ed. Without ``--force`` the final rename refuses an existing DST (atomically: of two runs racing
for one new DST exactly one wins). With ``--force`` the old DST is first renamed aside to
``.DST.lmbp-old-<pid>-<random>``, the new one renamed in, and only then the old one deleted. A run killed in
between leaves those siblings; the next run on the same DST restores the old DST if DST is missing and removes the
rest — but never a sibling whose run is still alive (its pid exists, or it holds the sibling's flock).

Torch-free: only the standard library.
"""
from __future__ import annotations

import hashlib
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import fsops
from .errors import CheckpointError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: liveness falls back to the pid alone
    fcntl = None  # type: ignore[assignment]


_in_process = threading.Lock()  # a workspace is created and locked, or leftovers mended, one at a time


def parent_of(dst: Path) -> Path:
    return Path(os.path.realpath(dst.parent if str(dst.parent) else Path(".")))


def _lock(path: Path) -> int | None:
    """Hold an exclusive flock on ``path`` for as long as the returned descriptor is open: the sign, seen by other
    runs, that this run is alive (it outlives pid reuse and works across pid namespaces)."""
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_NOFOLLOW if hasattr(os, "O_NOFOLLOW") else 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


@dataclass
class Workspace:
    """The temporary DST of one run and the locks that mark it alive."""

    dst: Path
    tmp: Path
    fds: list[int] = field(default_factory=list)
    committed: bool = False

    def release(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()


def make_workspace(dst: Path) -> Workspace:
    """Create the hidden temporary directory beside DST (same file system, so the final rename is atomic)."""
    parent = parent_of(dst)
    with _in_process:  # another thread of this process mending leftovers sees it only once locked
        try:
            fsops.at("mkdir", parent / f".{_stem(dst)}.lmbp-tmp-")
            while True:
                tmp = sibling(dst, "tmp")
                try:
                    os.mkdir(tmp, 0o700)
                    break
                except FileExistsError:
                    continue
        except OSError as exc:
            raise CheckpointError(f"cannot write DST {dst}: {exc.strerror or exc}") from exc
        ws = Workspace(dst, tmp)
        fd = _lock(tmp)
        if fd is not None:
            ws.fds.append(fd)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o777 & ~mask)  # made private above; DST should look like any new directory
    return ws


_STEM_BYTES = 200  # DST names up to this long appear whole in the siblings' names; the rest fit NAME_MAX (255)


def _stem(dst: Path) -> str:
    """DST's name as its siblings carry it: whole, or for a name too long to take the suffixes, a prefix plus a
    hash of the whole name (so that a DST name of up to 255 bytes still gets its siblings)."""
    name = dst.name
    raw = os.fsencode(name)
    if len(raw) <= _STEM_BYTES:
        return name
    cut = name
    while len(os.fsencode(cut)) > _STEM_BYTES - 9:
        cut = cut[:-1]
    return f"{cut}~{hashlib.sha256(raw).hexdigest()[:8]}"


def sibling(dst: Path, kind: str) -> Path:
    """A new name ``.DST.lmbp-<kind>-<pid>-<8 random characters>`` beside DST: the only names that the mending
    of leftovers ever touches."""
    return parent_of(dst) / f".{_stem(dst)}.lmbp-{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def _appeared(dst: Path) -> CheckpointError:
    return CheckpointError(f"DST {dst} was created by another process while this run was converting; it was left "
                           "as it is (pass --force to replace it)")


def commit(ws: Workspace, kind: str, force: bool) -> None:
    """Move the finished, fsync'ed temporary output to DST. Sets ``ws.committed`` once DST is the new one."""
    dst, tmp = ws.dst, ws.tmp
    parent = parent_of(dst)
    if kind == "timm":  # DST is a file: rename replaces a file atomically, so --force needs no aside copy
        out = tmp / dst.name
        try:
            (fsops.rename if force else fsops.rename_noreplace)(out, dst)
        except FileExistsError:
            raise _appeared(dst) from None
        ws.committed = True
        fsops.fsync_dir(parent)
        fsops.remove_tree(tmp)
        return
    fsops.fsync_dir(tmp)
    if not (force and os.path.lexists(dst)):
        try:
            fsops.rename_noreplace(tmp, dst)
        except FileExistsError:
            raise _appeared(dst) from None
        ws.committed = True
        fsops.fsync_dir(parent)
        return
    old = sibling(dst, "old")
    fd = _lock(dst) if not os.path.islink(dst) else None  # the old DST stays marked alive while it is aside
    if fd is not None:
        ws.fds.append(fd)
    fsops.rename_noreplace(dst, old)
    try:
        fsops.rename_noreplace(tmp, dst)
    except BaseException as exc:
        try:
            fsops.rename_noreplace(old, dst)
        except FileExistsError:
            raise CheckpointError(f"DST {dst} was re-created by another process during the replace and is left as "
                                  f"it is; the previous DST, which --force was replacing, is at {old} until the next "
                                  f"run on {dst} removes it") from exc
        except OSError as exc2:
            raise CheckpointError(f"cannot put the previous DST back after a failed replace ({exc2.strerror or exc2});"
                                  f" it is kept at {old} (the next run on {dst} restores it)") from exc
        raise
    ws.committed = True
    fsops.fsync_dir(parent)
    fsops.remove_tree(old)


def _real(p: Path) -> Path:
    return Path(os.path.realpath(p))


def check_paths(kind: str, src: Path, dst: Path, force: bool, dry_run: bool) -> None:
    """Refuse DST = SRC, DST inside SRC (or SRC inside DST), an existing DST without force, an unwritable DST."""
    if dst.name in ("", ".", ".."):  # no name of its own to rename a new DST to ("/", ".", "x/..")
        raise CheckpointError(f"DST {dst} names no new entry in a directory; give DST a name, e.g. {dst}/folded")
    rs, rd = _real(src), _real(dst)
    if rs == rd:
        raise CheckpointError("DST is SRC: lmbp-convert never modifies SRC; choose another DST")
    if kind == "hf" and rd.is_relative_to(rs):
        raise CheckpointError(f"DST {dst} is inside SRC {src}; choose a DST outside it")
    if rs.is_relative_to(rd):
        raise CheckpointError(f"SRC {src} is inside DST {dst}; choose another DST")
    if kind == "timm" and dst.suffix != ".safetensors":
        raise CheckpointError(f"DST {dst} must be a .safetensors file for a timm checkpoint")
    if dry_run:
        return
    if os.path.lexists(dst):
        if not force:
            raise CheckpointError(f"DST {dst} exists (pass --force to replace it)")
        if kind == "timm" and dst.is_dir():
            raise CheckpointError(f"DST {dst} is a directory; a timm DST is a .safetensors file")
    parent = _real(dst.parent if str(dst.parent) else Path("."))
    if not parent.exists():
        raise CheckpointError(f"cannot write DST {dst}: directory {parent} does not exist")
    if not parent.is_dir():
        raise CheckpointError(f"cannot write DST {dst}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write DST {dst}: directory {parent} is not writable")


def preflight(kind: str, src: Path, dst: Path, force: bool, dry_run: bool,
              on_note: Callable[[str], None] | None = None) -> None:
    """The path checks, with leftovers of an earlier interrupted run on DST mended first (that may restore DST)."""
    if not os.path.exists(src):
        raise CheckpointError(f"SRC {src} does not exist")
    check_paths(kind, src, dst, force, dry_run=True)  # the checks that need no DST state
    note = mend_leftovers(dst, dry_run=dry_run)
    if note and on_note is not None:
        on_note(note)
    check_paths(kind, src, dst, force, dry_run)


# -- leftovers of killed runs -------------------------------------------------------------------------------------
#: seconds of slack between a process's start time (clock ticks) and file time stamps (coarse on some file systems)
_CLOCK_SLACK = 2.0


def _process_start(pid: int) -> float | None:
    """When process ``pid`` started (wall-clock seconds, from Linux's /proc), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        ticks = int(stat[stat.rindex(b")") + 2:].split()[19])  # field 22, starttime, in clock ticks since boot
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _alive(path: Path, pid: int, kind: str) -> bool:
    """Whether the run that made ``path`` may still be running: it holds the sibling's flock, or its pid exists —
    unless that process started after the sibling was last changed (a killed run's pid, reused by an unrelated
    process: a run writes into its temporary directory, and renaming the old DST aside sets its ctime)."""
    if pid != os.getpid():  # (this process: its live runs hold their flock)
        try:
            os.kill(pid, 0)
            exists = True
        except ProcessLookupError:
            exists = False
        except PermissionError:
            exists = True
        except OSError:
            exists = False
        if exists:
            try:
                st = path.lstat()
            except OSError:
                return False
            started = _process_start(pid)
            changed = st.st_mtime if kind == "tmp" else st.st_ctime
            if started is None or started <= changed + _CLOCK_SLACK:
                return True
    if fcntl is None or os.path.islink(path):
        return False
    fd = _lock(path)
    if fd is None:
        return os.path.lexists(path)  # held by a live run (on another host or pid namespace)
    os.close(fd)
    return False


def _size(path: Path) -> int:
    if os.path.islink(path) or not path.is_dir():
        try:
            return path.lstat().st_size
        except OSError:
            return 0
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _fmt(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def mend_leftovers(dst: Path, dry_run: bool = False) -> str | None:
    """Find the siblings ``.DST.lmbp-old-*`` / ``.DST.lmbp-tmp-*`` of killed runs; restore the old DST when DST is
    missing, remove the rest. Returns one line saying what was found and done (None when there was nothing)."""
    with _in_process:
        return _mend(dst, dry_run)


def _mend(dst: Path, dry_run: bool) -> str | None:
    parent = parent_of(dst)
    if not parent.is_dir():
        return None
    # exactly the names that sibling() gives (and tempfile gave before it): a user's
    # ".DST.lmbp-old-notes" is none of ours
    pat = re.compile(rf"^\.{re.escape(_stem(dst))}\.lmbp-(tmp|old)-(\d+)-[a-z0-9_]{{8}}$")
    found: list[tuple[str, Path, int]] = []
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return None
    for name in names:
        m = pat.match(name)
        if m:
            found.append((m.group(1), parent / name, int(m.group(2))))
    if not found:
        return None
    busy = [p for kind, p, pid in found if _alive(p, pid, kind)]
    olds = [p for kind, p, _ in found if kind == "old" and p not in busy]
    tmps = [p for kind, p, _ in found if kind == "tmp" and p not in busy]
    done: list[str] = []
    verb = "would " if dry_run else ""
    if olds and not os.path.lexists(dst):
        newest = max(olds, key=lambda p: p.lstat().st_ctime)  # the last DST renamed aside
        olds.remove(newest)
        if not dry_run:
            fsops.rename_noreplace(newest, dst)
            fsops.fsync_dir(parent)
        done.append(f"{verb}restore the previous DST from {newest.name}" if dry_run else
                    f"restored the previous DST from {newest.name}")
    stale = olds + tmps
    if stale:
        sizes = {p: _size(p) for p in stale}
        kept = [] if dry_run else [p for p in stale if not fsops.remove_tree(p)]
        gone = [p for p in stale if p not in kept]
        size = sum(sizes[p] for p in gone)
        names_ = ", ".join(p.name for p in gone)
        if gone:
            done.append(f"{verb}remove {len(gone)} stale temporary output(s) ({_fmt(size)}: {names_})" if dry_run
                        else f"removed {len(gone)} stale temporary output(s) ({_fmt(size)}: {names_})")
        if kept:
            done.append(f"could not remove {', '.join(p.name for p in kept)} (a mount point or an entry this user "
                        "cannot remove is inside; remove it by hand)")
    if busy:
        done.append(f"left {len(busy)} in use by a run that may still be alive (its process exists or holds the "
                    f"sibling's lock; remove by hand once no lmbp-convert runs on {dst.name}): "
                    f"{', '.join(p.name for p in busy)}")
    return f"found leftovers of an interrupted lmbp-convert beside {dst}: " + "; ".join(done)
