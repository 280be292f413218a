"""DST is only ever replaced when asked (--force), atomically: a DST that appears while converting is kept, of two
runs racing for one new DST exactly one wins, and what a killed run leaves beside DST is found and mended by the
next run — never the temporary output of a run that is still alive."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from ckpt_helpers import leftovers, tree_hash

import lmbp_convert.checkpoint.api as api
import lmbp_convert.checkpoint.fsops as fsops

ROOT = Path(__file__).resolve().parents[2]


def user_dir(path: Path) -> dict[str, str]:
    path.mkdir()
    (path / "mine.txt").write_text("a user's file")
    return tree_hash(path)


def appear_while_writing(monkeypatch, make) -> None:
    """Create DST (``make``) after planning, while the temporary DST is written: the run cannot have seen it."""
    real = api.write_into

    def write_then_appear(*a, **k):
        real(*a, **k)
        make()

    monkeypatch.setattr(api, "write_into", write_then_appear)


def test_dst_appearing_while_converting_is_kept(saved, tmp_path, cli, monkeypatch):
    dst = tmp_path / "dst"
    theirs: dict = {}
    appear_while_writing(monkeypatch, lambda: theirs.update(user_dir(dst)))
    rc, _, err = cli(saved("llama"), dst)
    assert rc == 1 and err.count("\n") == 1 and "created by another process" in err and "--force" in err, err
    assert tree_hash(dst) == theirs and not leftovers(tmp_path)


def test_timm_dst_file_appearing_while_converting_is_kept(tmp_path, cli, monkeypatch):
    import torch
    from test_streaming import timm_cli_args, timm_vit

    src = tmp_path / "vit.pth"
    torch.save(timm_vit().state_dict(), src)
    dst = tmp_path / "vit.safetensors"
    appear_while_writing(monkeypatch, lambda: dst.write_text("a user's file"))
    rc, _, err = cli(src, dst, *timm_cli_args())
    assert rc == 1 and err.count("\n") == 1 and "created by another process" in err, err
    assert dst.read_text() == "a user's file" and not leftovers(tmp_path)


def test_force_replaces_dst_appearing_while_converting(saved, tmp_path, cli, monkeypatch):
    dst = tmp_path / "dst"
    appear_while_writing(monkeypatch, lambda: user_dir(dst))
    rc, _, err = cli(saved("llama"), dst, "--force", "-q")
    assert rc == 0, err
    assert (dst / "config.json").exists() and not (dst / "mine.txt").exists() and not leftovers(tmp_path)


def test_two_concurrent_runs_to_one_new_dst_one_wins(saved, tmp_path, capsys, monkeypatch):
    """Both runs finish writing, wait for each other (a barrier, no sleeps), then both commit: exactly one wins."""
    dst = tmp_path / "dst"
    both_written = threading.Barrier(2, timeout=300)
    real = api.write_into

    def write_then_wait(*a, **k):
        real(*a, **k)
        both_written.wait()

    monkeypatch.setattr(api, "write_into", write_then_wait)
    from lmbp_convert.cli import main

    saved("llama")  # built before the runs start
    capsys.readouterr()
    rcs: list[int] = []
    threads = [threading.Thread(target=lambda: rcs.append(main([str(saved("llama")), str(dst), "-q"])))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    err = capsys.readouterr().err  # both runs' stderr
    assert sorted(rcs) == [0, 1], (rcs, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "created by another process" in lines[0], err
    assert json.loads((dst / "config.json").read_text())["lmbp_convert"]["folded_norms"]
    assert not leftovers(tmp_path)


def test_files_and_directories_are_fsynced_before_the_renames(saved, tmp_path, cli, monkeypatch):
    dst = tmp_path / "dst"
    user_dir(dst)
    ops: list[tuple[str, str]] = []
    lock = threading.Lock()

    def record(op, path):
        with lock:
            ops.append((op, path))

    monkeypatch.setattr(fsops, "fault_hook", record)
    rc, _, err = cli(saved("llama"), dst, "--force", "-q")
    assert rc == 0, err
    renames = [i for i, (op, _) in enumerate(ops) if op == "rename"]
    first_rename = renames[0]
    written = {p for op, p in ops[:first_rename] if op == "write"}
    synced = {p for op, p in ops[:first_rename] if op == "fsync"}
    assert written and written <= synced  # every file, before any rename
    tmp_dir = {str(Path(p).parent) for p in written}
    assert len(tmp_dir) == 1 and tmp_dir <= synced  # and the temporary directory itself
    assert ("fsync", str(tmp_path)) in ops[renames[-1]:]  # the parent, after the renames
    assert ops[-1] == ("remove", ops[renames[0]][1])  # the old DST goes last, once the new one is in place


# -- leftovers of killed runs -------------------------------------------------------------------------------
def dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(p.stdout)


@pytest.mark.slow  # kills a converter process
def test_kill_between_the_two_renames_is_mended_by_the_next_run(saved, tmp_path, cli):
    """A real crash (os._exit) right after the old DST went aside: DST is missing, both siblings are left. The next
    run restores the old DST, removes the temporary one, and says so in one line."""
    src, dst = saved("llama"), tmp_path / "dst"
    mine = user_dir(dst)
    script = (
        "import os, sys\n"
        "import lmbp_convert.checkpoint.fsops as fsops\n"
        "from lmbp_convert.cli import main\n"
        f"dst = {str(dst)!r}\n"
        "def crash(op, path):\n"
        "    if op == 'rename' and path == dst:\n"
        "        os._exit(9)\n"
        "fsops.fault_hook = crash\n"
        f"sys.exit(main([{str(src)!r}, dst, '--force', '-q']))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 9, proc.stderr
    assert not dst.exists()
    left = sorted(leftovers(tmp_path))
    assert len(left) == 2 and ".dst.lmbp-old-" in left[0] and ".dst.lmbp-tmp-" in left[1]
    rc, _, err = cli(src, dst, "--dry-run", "-q")  # a dry run only tells
    assert rc == 0 and "would restore" in err and not dst.exists() and len(leftovers(tmp_path)) == 2
    rc, _, err = cli(src, dst)  # no --force: restores, then refuses to replace
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 2, err
    assert lines[0].startswith("lmbp-convert: note: found leftovers") and "restored the previous DST" in lines[0]
    assert "removed 1 stale temporary output" in lines[0] and "exists" in lines[1]
    assert tree_hash(dst) == mine and not leftovers(tmp_path)


def test_leftover_after_completed_replace_is_removed(saved, tmp_path, cli):
    """Killed after the second rename: DST is the new one and the old copy is stale."""
    dst = tmp_path / "dst"
    user_dir(dst)
    stale = tmp_path / f".dst.lmbp-old-{dead_pid()}-abc12345"
    shutil.copytree(dst, stale)
    rc, _, err = cli(saved("llama"), dst, "--force", "-q")
    assert rc == 0 and err.count("\n") == 1 and "removed 1 stale" in err and stale.name in err
    assert not leftovers(tmp_path) and (dst / "config.json").exists()


def test_temp_dir_of_a_live_run_is_never_removed(saved, tmp_path, cli):
    """Siblings of a run that is alive stay: its pid exists (here: our parent process), or it holds the
    sibling's flock (a pid from another host or pid namespace, which looks dead here)."""
    import fcntl

    dst = tmp_path / "dst"
    by_pid = tmp_path / f".dst.lmbp-tmp-{os.getppid()}-live0001"  # another live process
    by_lock = tmp_path / f".dst.lmbp-tmp-{dead_pid()}-live0002"
    dead = tmp_path / f".dst.lmbp-tmp-{dead_pid()}-dead0003"
    for p in (by_pid, by_lock, dead):
        p.mkdir()
        (p / "model.safetensors").write_bytes(b"x" * 100)
    fd = os.open(by_lock, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        rc, _, err = cli(saved("llama"), dst, "-q")
    finally:
        os.close(fd)
    assert rc == 0, err
    assert by_pid.exists() and by_lock.exists() and not dead.exists()
    assert err.count("\n") == 1 and "removed 1 stale" in err and "left 2 in use" in err, err


@pytest.mark.parametrize("native", [True, False], ids=["renameat2", "fallback"])
def test_rename_noreplace_never_replaces(tmp_path, monkeypatch, native):
    """Both ways of the atomic no-replace rename: renameat2(RENAME_NOREPLACE), and where the kernel or file system
    lacks it, a hard link (files) or an empty directory claimed with mkdir (directories)."""
    if not native:
        monkeypatch.setattr(fsops, "_renameat2_tried", True)
        monkeypatch.setattr(fsops, "_renameat2", None)
    elif fsops._libc_renameat2() is None:
        pytest.skip("no renameat2 in this libc")
    for make in (lambda p: p.write_text("data"), lambda p: (p.mkdir(), (p / "f").write_text("data"))):
        src, dst = tmp_path / "src", tmp_path / "dst"
        make(src)
        for existing in (lambda p: p.write_text("theirs"), lambda p: p.mkdir(), lambda p: p.symlink_to("nowhere")):
            existing(dst)
            before = os.readlink(dst) if dst.is_symlink() else tree_hash(dst) if dst.is_dir() else dst.read_text()
            with pytest.raises(FileExistsError):
                fsops.rename_noreplace(src, dst)
            after = os.readlink(dst) if dst.is_symlink() else tree_hash(dst) if dst.is_dir() else dst.read_text()
            assert after == before and src.exists()
            shutil.rmtree(dst) if dst.is_dir() and not dst.is_symlink() else dst.unlink()
        fsops.rename_noreplace(src, dst)
        assert not src.exists() and (dst.read_text() if dst.is_file() else (dst / "f").read_text()) == "data"
        shutil.rmtree(dst) if dst.is_dir() else dst.unlink()


_RACER = """
import fcntl, os, sys
import lmbp_convert.checkpoint.fsops as fsops
from lmbp_convert.cli import main

src, dst, mine, theirs = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
reached = []

def at_commit(op, path):
    if op == "rename" and path == dst and not reached:
        reached.append(path)
        fcntl.flock(mine, fcntl.LOCK_UN)  # "I am at the commit"
        other = os.open(theirs, os.O_RDONLY)
        fcntl.flock(other, fcntl.LOCK_EX)  # returns once the other run is at its commit too (or has exited)
        os.close(other)

fsops.fault_hook = at_commit
sys.exit(main([src, dst, "-q"]))
"""


@pytest.mark.slow  # two converter processes
def test_two_processes_racing_for_one_new_dst_one_wins(saved, tmp_path):
    """Two real processes, each held at its final rename until the other has reached its own: a flock that the
    parent takes for each and hands over (pass_fds) is released by its process at the commit point, and the
    process then waits for the other's. No sleeps; a process that dies releases its lock, so nothing hangs."""
    import fcntl

    src, dst = saved("llama"), tmp_path / "dst"
    locks = [tmp_path / "a.lock", tmp_path / "b.lock"]
    fds = []
    for lock in locks:  # both taken before either process starts
        lock.write_text("")
        fds.append(os.open(lock, os.O_RDONLY))
        fcntl.flock(fds[-1], fcntl.LOCK_EX)  # held by the child (shared open file description) until its commit
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(src), str(dst), str(fds[i]), str(locks[1 - i])],
                              cwd=ROOT, pass_fds=(fds[i],), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    for fd in fds:
        os.close(fd)
    results = [(p.returncode, *out) for p in procs for out in [p.communicate(timeout=600)]]
    assert sorted(rc for rc, _, _ in results) == [0, 1], results
    loser_err = next(err for rc, _, err in results if rc == 1)
    assert loser_err.count("\n") == 1 and "created by another process" in loser_err, loser_err
    assert json.loads((dst / "config.json").read_text())["lmbp_convert"]["folded_norms"]
    assert not leftovers(tmp_path)
