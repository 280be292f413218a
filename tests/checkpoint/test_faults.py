"""Fault injection over the whole CLI: every write, copy, fsync, rename (and directory creation and removal) that
``lmbp-convert`` makes is failed in turn, once with KeyboardInterrupt and once with OSError (for a timm file DST,
the operations of its own commit path). After each: SRC is
byte-identical, DST is the old one, the complete new one, or absent — never partial, never a user's directory
lost — the CLI printed one line and exited 130 / 1, and the next run on DST finds nothing left to mend except,
at most, the old copy of a finished --force replace.

The operations are those ``fsops.fault_hook`` announces; a clean run lists them first, so a new file system
change added without announcing itself is not walked (fsops is the one module that changes files).
"""
from __future__ import annotations

import errno
import re
import shutil
import threading
from collections import Counter
from pathlib import Path

import pytest
from ckpt_helpers import build_model, leftovers, save_model, tree_hash

import lmbp_convert.checkpoint.fsops as fsops
from lmbp_convert.checkpoint.commit import mend_leftovers


def _key(path: str) -> str:
    return re.sub(r"\.lmbp-(tmp|old)-\d+-[A-Za-z0-9_]+", r".lmbp-\1-X", path)


class Walker:
    """Records the operations of a run as (op, path with temporary names normalised, occurrence); raises at one."""

    def __init__(self, target: tuple[str, str, int] | None = None, exc: BaseException | None = None) -> None:
        self.target, self.exc = target, exc
        self.seen: list[tuple[str, str, int]] = []
        self.count: Counter = Counter()
        self.hit = False
        self.lock = threading.Lock()

    def __call__(self, op: str, path: str) -> None:
        with self.lock:
            k = (op, _key(path))
            self.count[k] += 1
            item = (*k, self.count[k])
            self.seen.append(item)
            fire = item == self.target and not self.hit
            if fire:
                self.hit = True
        if fire:
            raise self.exc


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("faults")
    hf = save_model(build_model("llama", num_hidden_layers=1), root / "hf", max_shard_size="10GB")
    from test_streaming import timm_vit

    from safetensors.torch import save_file

    timm_src = root / "vit.safetensors"
    save_file({k: v.contiguous() for k, v in timm_vit().state_dict().items()}, timm_src)
    return {"hf": hf, "timm": timm_src}


def _state(p: Path) -> dict | None:
    return tree_hash(p) if p.exists() else None


@pytest.mark.slow  # one conversion per injected fault
@pytest.mark.parametrize("scenario", ["hf-new", "hf-force", "timm-force"])
def test_every_file_system_change_fails_safely(tiny, tmp_path, cli, monkeypatch, scenario):
    from test_streaming import timm_cli_args

    kind, mode = scenario.split("-")
    src = tiny[kind]
    args = [*(timm_cli_args() if kind == "timm" else []), *(["--force"] if mode == "force" else [])]
    dst = tmp_path / ("dst.safetensors" if kind == "timm" else "dst")

    def fresh_dst() -> dict | None:
        if dst.is_dir():
            shutil.rmtree(dst)
        elif dst.exists():
            dst.unlink()
        if mode != "force":
            return None
        if kind == "timm":
            dst.write_text("a user's previous file")
        else:
            dst.mkdir()
            (dst / "mine.txt").write_text("a user's previous result")
        return tree_hash(dst)

    src_hash = tree_hash(src)
    fresh_dst()
    clean = Walker()
    monkeypatch.setattr(fsops, "fault_hook", clean)
    rc, _, err = cli(src, dst, *args, "-q")
    assert rc == 0, err
    new = tree_hash(dst)
    ops = clean.seen
    assert {o for o, _, _ in ops} >= {"write", "fsync", "rename", "mkdir"}, ops
    if kind == "timm":  # its writes are the hf scenarios' machinery; walk what differs: the file's commit
        last_write = max(i for i, (o, _, _) in enumerate(ops) if o in ("write", "copy"))
        ops = ops[last_write + 1:]
        assert [o for o, _, _ in ops] == ["fsync", "rename", "fsync", "remove"], ops

    results = []
    for target in ops:
        for exc, code in ((KeyboardInterrupt(), 130), (OSError(errno.EIO, "Input/output error"), 1)):
            old = fresh_dst()
            walker = Walker(target, exc)
            monkeypatch.setattr(fsops, "fault_hook", walker)
            rc, out, err = cli(src, dst, *args, "-q")
            monkeypatch.setattr(fsops, "fault_hook", None)
            case = f"{type(exc).__name__} at {target}"
            assert walker.hit, case
            assert tree_hash(src) == src_hash, case
            assert rc == code and err.count("\n") == 1 and err.startswith("lmbp-convert: error: "), (case, rc, err)
            state = _state(dst)
            assert state in (old, new), f"{case}: DST is partial or foreign"
            outcome = "absent" if state is None else "new" if state == new else "old"
            if outcome == "absent":
                assert old is None, f"{case}: the user's DST is gone"
            rest = leftovers(tmp_path)
            if rest:  # only the old copy of a finished replace (removal failed), which the next run removes
                assert outcome == "new" and all(".lmbp-old-" in n for n in rest), (case, rest)
                assert "removed" in mend_leftovers(dst)
                assert not leftovers(tmp_path)
            if outcome == "new":
                assert "was complete" in err or "is complete" in err, (case, err)
            results.append((case, outcome))
    print(f"\n{scenario}: {len(results)} faults")  # the list of cases and results (pytest -s shows it)
    for case, outcome in results:
        print(f"  {case.replace(str(tmp_path), '<tmp>')}: DST {outcome}")
    outcomes = Counter(o for _, o in results)
    assert outcomes["new"] >= 2  # faults after the commit rename (parent fsync) leave the complete DST
    assert outcomes["old" if mode == "force" else "absent"] >= (len(ops) if kind == "hf" else 2)
