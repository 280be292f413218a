"""Hostile inputs around DST and the fold that once got past the CLI: names that look like our leftovers but are a
user's, a killed run's pid reused by an unrelated process, a DST with no name of its own, and norm affines that are
non-finite or make the folded weights overflow. Each fails on the code before its fix."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from ckpt_helpers import leftovers, tree_hash
from safetensors.torch import load_file, save_file

from lmbp_convert.checkpoint.commit import mend_leftovers, preflight
from lmbp_convert.checkpoint.errors import CheckpointError


def dead_pid() -> int:
    p = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True)
    return int(p.stdout)


# -- leftovers ----------------------------------------------------------------------------------------------------
def test_user_entries_named_like_leftovers_are_never_touched(tmp_path):
    """Only the exact names a run gives its siblings (pid and 8 random characters) are leftovers: a user's
    ".dst.lmbp-old-notes" was restored as DST (DST missing) or deleted (DST present)."""
    dst = tmp_path / "dst"
    theirs = [tmp_path / ".dst.lmbp-old-notes", tmp_path / ".dst.lmbp-tmp-backup",
              tmp_path / f".dst.lmbp-old-{dead_pid()}-my_notes_v2", tmp_path / f".dst.lmbp-tmp-{dead_pid()}-ab.cdefg"]
    for p in theirs:
        p.mkdir()
        (p / "mine.txt").write_text("a user's file")
    before = tree_hash(tmp_path)
    for present in (False, True):
        if present:
            dst.mkdir()
            before = tree_hash(tmp_path)
        assert mend_leftovers(dst) is None
        assert tree_hash(tmp_path) == before and dst.exists() == present


def test_leftover_of_a_killed_run_whose_pid_was_reused_is_removed(tmp_path):
    """The killed run's pid now belongs to an unrelated process that started after the leftover was last written:
    the leftover is stale (before: "left 1 in use by a running lmbp-convert", forever). A live process that
    started before the leftover was written (our parent) still protects it."""
    dst = tmp_path / "dst"
    hour_ago = time.time() - 3600
    reused = subprocess.Popen(["cat"], stdin=subprocess.PIPE)  # alive, started now
    try:
        stale = tmp_path / f".dst.lmbp-tmp-{reused.pid}-abcd1234"
        live = tmp_path / f".dst.lmbp-tmp-{os.getppid()}-abcd5678"
        for p in (stale, live):
            p.mkdir()
            (p / "model.safetensors").write_bytes(b"x" * 64)
        os.utime(stale, (hour_ago, hour_ago))  # last written an hour ago, by the run that was killed
        note = mend_leftovers(dst)
    finally:
        reused.stdin.close()
        reused.wait()
    assert not stale.exists() and live.exists(), note
    assert "removed 1 stale temporary output" in note and stale.name in note and "left 1 in use" in note, note


@pytest.mark.parametrize("spelling", [".", "..", "sub/..", "/"])
def test_dst_without_a_name_of_its_own_is_refused_before_converting(tmp_path, monkeypatch, spelling):
    """DST "." or "x/.." cannot be renamed into place: before, the whole conversion ran and the commit then failed
    with "Device or resource busy" (or, with SRC beside it, a confusing "SRC inside DST")."""
    src = tmp_path / "src"
    src.mkdir()
    work = tmp_path / "elsewhere"
    (work / "sub").mkdir(parents=True)
    monkeypatch.chdir(work)
    with pytest.raises(CheckpointError, match="names no new entry"):
        preflight("hf", src, Path(spelling), force=True, dry_run=False)


# -- non-finite values --------------------------------------------------------------------------------------------
def _edit_tensors(src: Path, edit) -> None:
    """Apply ``edit(name, tensor) -> tensor | None`` to every tensor of every shard of ``src`` (in place)."""
    for shard in sorted(src.glob("*.safetensors")):
        tensors = load_file(shard)
        changed = False
        for k, t in tensors.items():
            new = edit(k, t)
            if new is not None:
                tensors[k], changed = new, True
        if changed:
            save_file(tensors, shard, metadata={"format": "pt"})


@pytest.fixture
def src16(saved, tmp_path) -> Path:
    path = tmp_path / "src"
    shutil.copytree(saved("llama", torch.float16), path)
    return path


def _expect_refused(cli, src: Path, dst: Path, match: str) -> None:
    before = tree_hash(src)
    rc, out, err = cli(src, dst, "-q")
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in out + err, (rc, err)
    assert match in err, err
    assert tree_hash(src) == before and not os.path.lexists(dst) and not leftovers(dst.parent)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_norm_weight_is_refused(cli, src16, tmp_path, value):
    """A NaN/inf γ would be spread over a whole column of each following Linear; before, DST was written with
    NaN weights and exit 0."""
    def damage(k, t):
        if k == "model.layers.0.post_attention_layernorm.weight":
            t = t.clone()
            t[3] = value
            return t
        return None

    _edit_tensors(src16, damage)
    _expect_refused(cli, src16, tmp_path / "dst", "model.layers.0.post_attention_layernorm.weight holds 1 "
                                                  "non-finite value(s)")


def test_fold_that_overflows_the_weight_dtype_is_refused(cli, src16, tmp_path):
    """Finite γ and W whose product passes float16's largest value (65504): before, the folded weight held inf
    where the source was finite, and the run said it converted."""
    def big(k, t):
        if k == "model.layers.0.input_layernorm.weight":
            return torch.full_like(t, 300.0)
        if k == "model.layers.0.self_attn.k_proj.weight":
            t = t.clone()
            t[1, 2] = 400.0  # 400 * 300 = 120000 > 65504
            return t
        return None

    _edit_tensors(src16, big)
    _expect_refused(cli, src16, tmp_path / "dst", "folding norm model.layers.0.input_layernorm into "
                                                  "model.layers.0.self_attn.k_proj.weight overflows float16: 1 value")


def test_non_finite_source_weight_is_passed_on_not_refused(cli, src16, tmp_path):
    """The rule is about what the fold makes: a NaN the source Linear already holds stays where it was (the
    source model computes with it too), and large γ that stays in range is folded."""
    def edit(k, t):
        if k == "model.layers.0.input_layernorm.weight":
            return torch.full_like(t, 30.0)  # |γ| > 1: the overflow test runs, finds nothing
        if k == "model.layers.0.self_attn.q_proj.weight":
            t = t.clone()
            t[0, 0] = float("nan")
            return t
        return None

    _edit_tensors(src16, edit)
    dst = tmp_path / "dst"
    rc, _, err = cli(src16, dst, "-q")
    assert rc == 0, err
    out = {}
    for shard in dst.glob("*.safetensors"):
        out.update(load_file(shard))
    q = out["model.layers.0.self_attn.q_proj.weight"]
    assert torch.isnan(q[0, 0]) and torch.isfinite(q).sum() == q.numel() - 1
    assert json.loads((dst / "config.json").read_text())["lmbp_convert"]["folded_norms"]


# -- inputs that changed or lie -----------------------------------------------------------------------------------
@pytest.fixture
def src32(saved, tmp_path) -> Path:
    path = tmp_path / "src"
    shutil.copytree(saved("llama"), path)
    return path


def test_shard_replaced_on_disk_after_planning_is_read_as_planned(cli, src32, tmp_path, monkeypatch):
    """SRC re-saved (each shard atomically replaced, with a longer header) between planning and writing: before,
    the planned offsets were read from the new files — garbage weights, or a bogus error. Now the data comes
    through the descriptors whose headers were checked: DST is the conversion of SRC as it was planned."""
    import lmbp_convert.checkpoint.api as api

    pristine = tmp_path / "pristine"
    shutil.copytree(src32, pristine)
    rc, _, err = cli(pristine, tmp_path / "expected", "-q")
    assert rc == 0, err
    real = api.write_into

    def resave_then_write(prep, out_dir, progress=False):
        for p in sorted(src32.glob("model-*.safetensors")):
            new = {k: v + 1 for k, v in load_file(p).items()}
            save_file(new, p.with_suffix(".new"), metadata={"format": "pt", "pad": "x" * 40})
            os.replace(p.with_suffix(".new"), p)
        return real(prep, out_dir, progress)

    monkeypatch.setattr(api, "write_into", resave_then_write)
    rc, _, err = cli(src32, tmp_path / "dst", "-q")
    assert rc == 0, err
    assert tree_hash(tmp_path / "dst") == tree_hash(tmp_path / "expected")


def test_header_dtype_that_is_not_a_string_is_corrupt(cli, src32, tmp_path):
    """Before: "internal error: TypeError: unhashable type: 'list'"."""
    p = sorted(src32.glob("model-*.safetensors"))[0]
    raw = p.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    key = next(k for k in header if k != "__metadata__")
    header[key]["dtype"] = ["F32"]
    blob = json.dumps(header).encode()
    blob += b" " * ((-len(blob)) % 8)
    p.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n:])
    _expect_refused(cli, src32, tmp_path / "dst", f"{p.name} is corrupt (dtype of {key!r} is not a string")


def test_config_error_spanning_lines_is_told_whole_on_one_line(cli, src32, tmp_path):
    """transformers' validation errors start with a bare heading line; before, only "Validation error for field
    'num_hidden_layers':" was shown, without what was wrong."""
    cfg = json.loads((src32 / "config.json").read_text())
    cfg["num_hidden_layers"] = "two"
    (src32 / "config.json").write_text(json.dumps(cfg))
    before = tree_hash(src32)
    rc, _, err = cli(src32, tmp_path / "dst", "-q")
    # transformers 5 validates the config ("config.json is invalid"); 4.x configs take any value and building the
    # model from it fails ("cannot build LlamaForCausalLM from config.json: ...").
    assert rc == 1 and err.count("\n") == 1 and re.search(r"config\.json is invalid|from config\.json:", err), err
    assert "'two'" in err or "int" in err, err  # the reason, not only the heading
    assert tree_hash(src32) == before and not (tmp_path / "dst").exists()


@pytest.mark.parametrize("name", ["d" * 255, "é" * 127], ids=["ascii255", "utf8-254"])
def test_dst_name_of_full_length_converts_replaces_and_mends(cli, saved, tmp_path, name):
    """A DST name of up to NAME_MAX (255 bytes) is valid: before, ".DST.lmbp-tmp-..." was too long to create and
    the run failed after planning ("File name too long"). Long names' siblings carry a prefix and a hash."""
    from lmbp_convert.checkpoint.commit import _stem

    dst = tmp_path / name
    rc, _, err = cli(saved("llama"), dst, "-q")
    assert rc == 0 and (dst / "config.json").exists(), err
    rc, _, err = cli(saved("llama"), dst, "-q", "--force")
    assert rc == 0 and not leftovers(tmp_path), err
    stale = tmp_path / f".{_stem(dst)}.lmbp-tmp-{dead_pid()}-abcd1234"
    stale.mkdir()
    note = mend_leftovers(dst)
    assert note and "removed 1 stale" in note and not stale.exists()
    other = tmp_path / ("d" * 254 + "e")  # another long name: never takes the first one's siblings
    stale.mkdir()
    assert mend_leftovers(other) is None and stale.exists()


def test_src_entries_that_are_not_regular_files_are_reported_not_dropped(cli, src32, tmp_path):
    """A FIFO or a dangling link among SRC's top-level files was neither copied nor mentioned in the plan."""
    os.mkfifo(src32 / "events.fifo")
    (src32 / "vocab.txt").symlink_to(tmp_path / "nowhere")
    rc, out, err = cli(src32, tmp_path / "dst")
    assert rc == 0, err
    line = next(ln for ln in out.splitlines() if ln.startswith("not copied:"))
    assert "events.fifo (not a regular file)" in line and "vocab.txt (not a regular file)" in line, out
    assert not (tmp_path / "dst" / "events.fifo").exists()


def test_architectures_that_is_not_a_list_is_named_as_such(cli, src32, tmp_path):
    """A string "LlamaForCausalLM" was read letter by letter: "has no model class 'L'"."""
    cfg = json.loads((src32 / "config.json").read_text())
    cfg["architectures"] = "LlamaForCausalLM"
    (src32 / "config.json").write_text(json.dumps(cfg))
    _expect_refused(cli, src32, tmp_path / "dst", "\"architectures\" is a JSON str, not a list of model class names")


_BIND_AND_MEND = """
import os, subprocess, sys
from pathlib import Path
from lmbp_convert.checkpoint.commit import mend_leftovers
root, old = Path(sys.argv[1]), Path(sys.argv[2])
subprocess.run(["mount", "--bind", str(root / "data"), str(old / "sub")], check=True)
print(mend_leftovers(root / "dst"))
print(sorted(os.listdir(root / "data")))
"""


def test_removing_an_old_dst_never_empties_a_file_system_mounted_inside(tmp_path):
    """A bind mount inside the DST that --force replaces (a data set mounted into an output directory): the old
    copy's removal went into the mount and deleted the data set's files. Now nothing below a mount point is
    touched, the rest is removed, and the note says what stays. Runs in a private mount namespace (unshare)."""
    (tmp_path / "dst").mkdir()
    data = tmp_path / "data"
    data.mkdir()
    (data / "precious.txt").write_text("a user's data set")
    old = tmp_path / f".dst.lmbp-old-{dead_pid()}-abcd1234"
    (old / "sub").mkdir(parents=True)
    (old / "model.safetensors").write_text("old weights")
    (old / "link").symlink_to(data)
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    probe = subprocess.run(["unshare", "-Urm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("no user and mount namespaces here")
    proc = subprocess.run(["unshare", "-Urm", sys.executable, "-c", _BIND_AND_MEND, str(tmp_path), str(old)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    note, listing = proc.stdout.strip().splitlines()
    assert listing == "['precious.txt']" and (data / "precious.txt").read_text() == "a user's data set"
    assert f"could not remove {old.name}" in note and "mount point" in note, note
    assert sorted(os.listdir(old)) == ["sub"]  # the rest of the old copy is gone


def test_out_of_memory_while_writing_is_one_clear_line(cli, src32, tmp_path, monkeypatch):
    """Before: "internal error: MemoryError (run with --debug for a traceback)", as if it were a bug."""
    import lmbp_convert.checkpoint.fsops as fsops

    calls = []

    def oom(op, path):
        calls.append(op)
        if op == "write" and calls.count("write") == 3:
            raise MemoryError()

    monkeypatch.setattr(fsops, "fault_hook", oom)
    _expect_refused(cli, src32, tmp_path / "dst", f"out of memory while converting to {tmp_path / 'dst'}; no DST "
                                                  "written")


def test_bin_shard_replaced_after_planning_is_read_as_planned(cli, saved, tmp_path, monkeypatch):
    """The same race for pytorch_model.bin: its tensors were loaded again at write time from whatever file then
    had the name (the catalogue is made shard by shard and dropped)."""
    import lmbp_convert.checkpoint.api as api

    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(saved("llama") / "config.json", src / "config.json")
    sd = {}
    for p in saved("llama").glob("*.safetensors"):
        sd.update(load_file(p))
    torch.save(sd, src / "pytorch_model.bin")
    rc, _, err = cli(src, tmp_path / "expected", "-q")
    assert rc == 0, err
    real = api.write_into

    def resave_then_write(prep, out_dir, progress=False):
        torch.save({k: v + 1 for k, v in sd.items()}, src / "new.bin")
        os.replace(src / "new.bin", src / "pytorch_model.bin")
        return real(prep, out_dir, progress)

    monkeypatch.setattr(api, "write_into", resave_then_write)
    rc, _, err = cli(src, tmp_path / "dst", "-q")
    assert rc == 0, err
    assert tree_hash(tmp_path / "dst") == tree_hash(tmp_path / "expected")
