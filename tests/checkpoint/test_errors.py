"""Every bad input gets one clear line on stderr and a non-zero exit, no traceback; SRC stays byte-identical and
no DST (nor any temporary directory) is left behind — also after a full disk or Ctrl-C in the middle."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import leftovers, tree_hash
from safetensors.torch import load_file, save_file

import lmbp_convert.checkpoint.fsops as fsops
import lmbp_convert.checkpoint.safetensors_io as sio


def expect_error(cli, src: Path, dst: Path, *args, match: str, code: int = 1) -> str:
    before = tree_hash(src)
    dst_before = tree_hash(dst) if dst.exists() else None
    rc, out, err = cli(src, dst, *args)
    assert rc == code, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmbp-convert: error: "), err
    assert "Traceback" not in out + err
    assert re.search(match, lines[0]), lines[0]
    assert tree_hash(src) == before, "SRC changed"
    if dst_before is None:
        assert not os.path.lexists(dst), "a DST was left behind"
    else:
        assert tree_hash(dst) == dst_before, "the existing DST changed"
    assert not leftovers(dst.parent), leftovers(dst.parent)
    return lines[0]


@pytest.fixture
def src(saved, tmp_path) -> Path:
    """A private copy of the sharded LLaMA checkpoint, free to damage."""
    path = tmp_path / "src"
    shutil.copytree(saved("llama"), path)
    return path


def shards(src: Path) -> list[Path]:
    return sorted(src.glob("model-*.safetensors"))


def edit_config(src: Path, **changes) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg))


# -- config.json ---------------------------------------------------------------------------------------------
def test_missing_config(cli, src, tmp_path):
    (src / "config.json").unlink()
    expect_error(cli, src, tmp_path / "dst", match="has no config.json")


@pytest.mark.parametrize("text,match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not an object"),
    ('{"hidden_size": 8}', "no model_type"),
])
def test_invalid_config(cli, src, tmp_path, text, match):
    (src / "config.json").write_text(text)
    expect_error(cli, src, tmp_path / "dst", match=match)


def test_unknown_model_type(cli, src, tmp_path):
    edit_config(src, model_type="no_such_model_xyz")
    expect_error(cli, src, tmp_path / "dst", match="unknown architecture: model_type 'no_such_model_xyz'")


def test_unknown_architecture_class(cli, src, tmp_path):
    edit_config(src, architectures=["NoSuchModelForCausalLM"])
    expect_error(cli, src, tmp_path / "dst", match="unknown architecture: .*NoSuchModelForCausalLM")


def test_quantized_source_refused(cli, src, tmp_path):
    edit_config(src, quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    expect_error(cli, src, tmp_path / "dst", match="quantized")


# -- weights ------------------------------------------------------------------------------------------------
def test_truncated_shard(cli, src, tmp_path):
    p = shards(src)[-1]
    data = p.read_bytes()
    p.write_bytes(data[:-100])
    expect_error(cli, src, tmp_path / "dst", match=rf"{p.name} is truncated")


@pytest.mark.parametrize("damage,match", [
    (lambda d: (10**12).to_bytes(8, "little") + d[8:], "truncated or corrupt"),
    (lambda d: d[:8] + b"#" + d[9:], "corrupt .*not valid JSON"),
    (lambda d: d[:5], "truncated or not a safetensors file"),
    (lambda d: d + b"\0" * 16, r"corrupt \(trailing bytes"),
])
def test_corrupt_shard(cli, src, tmp_path, damage, match):
    p = shards(src)[1]
    p.write_bytes(damage(p.read_bytes()))
    expect_error(cli, src, tmp_path / "dst", match=f"{p.name} is {match}")


def test_shard_named_in_index_missing(cli, src, tmp_path):
    p = shards(src)[2]
    p.unlink()
    expect_error(cli, src, tmp_path / "dst", match=f"shard {p.name} named in model.safetensors.index.json is missing")


def test_corrupt_index(cli, src, tmp_path):
    (src / "model.safetensors.index.json").write_text('{"weight_map": ')
    expect_error(cli, src, tmp_path / "dst", match="model.safetensors.index.json is not valid JSON")


def test_index_disagrees_with_shard(cli, src, tmp_path):
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    key = next(iter(idx["weight_map"]))
    other = next(s for s in idx["weight_map"].values() if s != idx["weight_map"][key])
    idx["weight_map"][key] = other
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    expect_error(cli, src, tmp_path / "dst", match="corrupt index or shard")


def test_unexpected_tensor(cli, src, tmp_path):
    p = shards(src)[0]
    tensors = load_file(p)
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, p, metadata={"format": "pt"})
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.layers.0.mlp.extra_proj.weight"] = p.name
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    expect_error(cli, src, tmp_path / "dst", match="'model.layers.0.mlp.extra_proj.weight' .* not expected by the "
                                                   "config")


def test_shape_disagrees_with_config(cli, src, tmp_path):
    edit_config(src, intermediate_size=48)
    expect_error(cli, src, tmp_path / "dst", match="has shape .* but the config expects")


class NotATensor:  # a pickled object: torch.load(weights_only=True) must refuse it
    pass


def test_bin_loaded_only_with_weights_only(cli, saved, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(saved("llama") / "config.json", src / "config.json")
    torch.save({"model.embed_tokens.weight": torch.zeros(96, 32), "payload": NotATensor()},
               src / "pytorch_model.bin")
    expect_error(cli, src, tmp_path / "dst", match=r"cannot load pytorch_model.bin with torch.load\(weights_only"
                                                   r"=True\)")


def test_no_weights(cli, src, tmp_path):
    for p in [*shards(src), src / "model.safetensors.index.json"]:
        p.unlink()
    expect_error(cli, src, tmp_path / "dst", match="no weights in")


# -- paths ----------------------------------------------------------------------------------------------------
def test_missing_src(cli, tmp_path):
    rc, _, err = cli(tmp_path / "nope", tmp_path / "dst")
    assert rc == 1 and "does not exist" in err and not (tmp_path / "dst").exists()


def test_dst_inside_src(cli, src):
    expect_error(cli, src, src / "folded", match="inside SRC")


def test_dst_is_src(cli, src):
    before = tree_hash(src)
    rc, _, err = cli(src, src, "--force")
    assert rc == 1 and "DST is SRC" in err and tree_hash(src) == before


def test_src_inside_dst_refused_even_with_force(cli, src):
    before = tree_hash(src.parent)
    rc, _, err = cli(src, src.parent, "--force")
    assert rc == 1 and "inside DST" in err and tree_hash(src.parent) == before


def test_existing_dst_refused_without_force(cli, src, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    expect_error(cli, src, dst, match="exists .*--force")


def test_unwritable_dst_parent_is_a_file(cli, src, tmp_path):
    (tmp_path / "afile").write_text("x")
    expect_error(cli, src, tmp_path / "afile" / "dst", match="not a directory")


def test_unwritable_dst_parent_missing(cli, src, tmp_path):
    expect_error(cli, src, tmp_path / "no" / "dst", match="does not exist")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes to read-only directories")
def test_unwritable_dst_read_only_dir(cli, src, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        expect_error(cli, src, ro / "dst", match="not writable")
    finally:
        ro.chmod(0o755)


def test_unwritable_dst_mkdir_fails(cli, src, tmp_path, monkeypatch):
    """Permission checks can pass and creating the temporary directory still fail (ACLs, read-only mounts)."""
    def refuse(op, path):
        if op == "mkdir":
            raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(fsops, "fault_hook", refuse)
    expect_error(cli, src, tmp_path / "dst", match="cannot write DST .*Permission denied")


# -- failures while writing -----------------------------------------------------------------------------------
def _fail_after(monkeypatch, module, name: str, calls: int, exc: BaseException) -> dict:
    real = getattr(module, name)
    count = {"n": 0}

    def wrapper(*a, **k):
        count["n"] += 1
        if count["n"] > calls:
            raise exc
        return real(*a, **k)

    monkeypatch.setattr(module, name, wrapper)
    return count


def test_full_disk_mid_write(cli, src, tmp_path, monkeypatch):
    count = _fail_after(monkeypatch, sio, "_write_all", 6, OSError(errno.ENOSPC, "No space left on device"))
    expect_error(cli, src, tmp_path / "dst", match="no space left on device")
    assert count["n"] > 6  # it did fail in the middle of writing


@pytest.mark.parametrize("existing", [False, True])
def test_ctrl_c_mid_write_leaves_no_partial_dst(cli, src, tmp_path, monkeypatch, existing):
    dst = tmp_path / "dst"
    if existing:
        dst.mkdir()
        (dst / "old.txt").write_text("previous result")
    seen: list[list[str]] = []
    real = sio._copy_range

    def interrupt(*a, **k):
        if len(seen) == 3:
            raise KeyboardInterrupt
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        return real(*a, **k)

    monkeypatch.setattr(sio, "_copy_range", interrupt)
    expect_error(cli, src, dst, *(["--force"] if existing else []), match="interrupted", code=130)
    # while writing, the output was a hidden temporary directory beside DST, never DST itself
    assert any(".lmbp-tmp-" in n for n in seen[-1])
    if existing:
        assert (dst / "old.txt").read_text() == "previous result"


def test_commit_failure_restores_existing_dst(cli, src, tmp_path, monkeypatch):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old.txt").write_text("previous result")
    failed = []

    def fail_rename_in(op, path):
        if op == "rename" and path == str(dst) and not failed:  # the new DST into place (the old one is aside)
            failed.append(path)
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fsops, "fault_hook", fail_rename_in)
    expect_error(cli, src, dst, "--force", match="I/O error .*Input/output error")


# -- options and other inputs ---------------------------------------------------------------------------------
def test_nothing_to_fold(cli, saved, tmp_path):
    src = saved("llama")  # (an include that names a module, but no norm)
    expect_error(cli, src, tmp_path / "dst", "--include", "model.embed_tokens", match="nothing to fold")
    rc, _, err = cli(src, tmp_path / "dst", "--include", "model.embed_tokens", "--allow-empty", "-q")
    assert rc == 0, err
    assert (tmp_path / "dst" / "config.json").exists()


def _convert_says(**patterns) -> tuple[Exception | None, list[str]]:
    """What convert() raises and warns about these patterns on the model the "llama" checkpoint holds."""
    import warnings

    from ckpt_helpers import build_model

    from lmbp_convert import convert

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            convert(build_model("llama"), **patterns)
        except Exception as exc:  # noqa: BLE001 - compared below
            return exc, [str(w.message) for w in caught]
    return None, [str(w.message) for w in caught if issubclass(w.category, UserWarning)
                  and "pattern(s)" in str(w.message)]


@pytest.mark.parametrize("extra", [["--dry-run"], [], ["--allow-empty"], ["--json", "--dry-run"]])
def test_include_matching_no_module_is_the_error_convert_raises(cli, saved, tmp_path, extra):
    """Once '0 norm(s) folded', exit 0 in --dry-run (and a DST with --allow-empty): now convert()'s own error."""
    from lmbp_convert import NothingToConvertError

    exc, _ = _convert_says(include=["no_such_module"])
    assert isinstance(exc, NothingToConvertError) and "'no_such_module'" in str(exc)
    line = expect_error(cli, saved("llama"), tmp_path / "dst", "--include", "no_such_module", *extra, match="")
    assert line == f"lmbp-convert: error: {exc}"


def test_unmatched_exclude_and_include_warn_as_convert_does(cli, saved, tmp_path):
    """An exclude that matches nothing excludes nothing (a typo protects no module): the warning convert() gives,
    one line each; the plan is the one without them. -q leaves it out (errors only)."""
    src = saved("llama")
    args = ["--exclude", "model.layers.9.input_layernorm", "--include", "model.norm", "--include", "nope"]
    _, warned = _convert_says(exclude=args[1], include=[args[3], args[5]])
    assert len(warned) == 2
    rc, out, err = cli(src, tmp_path / "dst", *args, "--dry-run")
    assert rc == 0, err
    assert err.splitlines() == [f"lmbp-convert: warning: {w}" for w in warned], err
    rc, plain, _ = cli(src, tmp_path / "dst", "--include", "model.norm", "--dry-run")
    assert rc == 0 and out == plain
    rc, _, err = cli(src, tmp_path / "dst", *args, "--dry-run", "-q")
    assert rc == 0 and err == ""


@pytest.mark.parametrize("flag", ["--exclude", "--include"])
def test_invalid_regex_is_a_usage_error(cli, capsys, saved, tmp_path, flag):
    """Exit 2, as the epilog reserves for usage errors (it was 1), before anything is read."""
    src = saved("llama")
    before = tree_hash(src)
    with pytest.raises(SystemExit) as stop:
        cli(src, tmp_path / "dst", flag, "(", "--dry-run")
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: lmbp-convert") and err.splitlines()[-1].startswith(
        f"lmbp-convert: error: {flag[2:]} pattern '(' is not a valid regular expression: "), err
    assert not os.path.lexists(tmp_path / "dst") and tree_hash(src) == before


def test_file_src_without_timm_model(cli, src, tmp_path):
    expect_error(cli, shards(src)[0], tmp_path / "dst", match="pass --timm-model")


def test_unknown_timm_model(cli, tmp_path):
    ckpt = tmp_path / "w.pth"
    torch.save({"a": torch.zeros(2)}, ckpt)
    expect_error(cli, ckpt, tmp_path / "dst.safetensors", "--timm-model", "no_such_timm_model_xyz",
                 match="unknown architecture: timm .* has no model 'no_such_timm_model_xyz'")


def test_head_checkpoint_without_architectures_says_so(cli, src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("architectures")
    (src / "config.json").write_text(json.dumps(cfg))
    expect_error(cli, src, tmp_path / "dst", match="'lm_head.weight' .* names no architectures")


@pytest.mark.parametrize("existing", [False, True])
def test_ctrl_c_during_commit_is_held_until_dst_is_in_place(cli, src, tmp_path, monkeypatch, existing):
    """An interrupt that arrives while DST is renamed into place is delivered after the swap: never a missing
    or half-swapped DST, and the message says DST is complete. The signal is raised synchronously in the main
    thread at the rename itself (signal.raise_signal), so its handler runs at that point on any machine load —
    os.kill may deliver a process-directed signal to another thread, whose handler then runs at a later,
    load-dependent point."""
    import signal

    dst = tmp_path / "dst"
    if existing:
        dst.mkdir()
        (dst / "old.txt").write_text("previous result")
    raised = []

    def interrupt_at_rename_in(op, path):
        if op == "rename" and path == str(dst):
            signal.raise_signal(signal.SIGINT)  # held: the rename below still runs
            raised.append(path)

    monkeypatch.setattr(fsops, "fault_hook", interrupt_at_rename_in)
    before = tree_hash(src)
    rc, _, err = cli(src, dst, *(["--force"] if existing else []))
    assert raised == [str(dst)]  # the handler held it: the hook went on to the rename
    assert rc == 130 and f"interrupted after {dst} was complete" in err and err.count("\n") == 1
    assert tree_hash(src) == before and not leftovers(tmp_path)
    assert (dst / "config.json").exists() and not (dst / "old.txt").exists()


# -- issue 10, item 7: smaller holes ---------------------------------------------------------------------------
def test_use_ema_without_ema_weights_is_an_error(cli, tmp_path):
    """--use-ema on a training checkpoint that holds only the regular weights: before, they were converted with
    exit 0, as if they were the EMA ones."""
    from test_streaming import timm_cli_args, timm_vit

    src = tmp_path / "train.pth"
    torch.save({"state_dict": timm_vit().state_dict(), "epoch": 3}, src)
    expect_error(cli, src, tmp_path / "ema.safetensors", *timm_cli_args(), "--use-ema",
                 match=r"train.pth has no EMA weights .*'state_dict'.*drop --use-ema")


def test_index_omitting_a_tensor_names_the_unindexed_shard(cli, src, tmp_path):
    """The index leaves out the only tensor of a shard: that shard is then named nowhere. Before, the run
    reported it as "weights in another format" and wrote a DST missing the tensor, with exit 0."""
    idx_path = src / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    counts: dict[str, list[str]] = {}
    for k, s in idx["weight_map"].items():
        counts.setdefault(s, []).append(k)
    shard, keys = next((s, ks) for s, ks in sorted(counts.items()) if len(ks) == 1)
    del idx["weight_map"][keys[0]]
    idx_path.write_text(json.dumps(idx))
    expect_error(cli, src, tmp_path / "dst", match=rf"index.json does not list tensor '{re.escape(keys[0])}': it is "
                                                   rf"in {shard}, a shard the index does not name")


def test_config_with_more_layers_than_the_checkpoint(cli, src, tmp_path):
    edit_config(src, num_hidden_layers=4)  # the checkpoint holds 2
    expect_error(cli, src, tmp_path / "dst", match=r"lacks \d+ tensor\(s\) .* e\.g\. 'model\.layers\.2\..*more "
                                                   r"layers than the checkpoint holds .*layer\(s\) 2, 3")


def test_help_and_path_errors_come_before_the_heavy_imports(src, tmp_path):
    """``--help``, usage errors and path errors answer without importing torch or transformers (seconds of the
    CLI's fixed cost): the package imports its public names lazily and the path checks are torch-free."""
    import subprocess
    import sys

    dst = tmp_path / "dst"
    dst.mkdir()
    script = (
        "import contextlib, io, sys\n"
        "from lmbp_convert.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        f"rc = main([{str(src)!r}, {str(dst)!r}])\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'timm', 'numpy') if m in sys.modules)\n"
        "print(rc, heavy)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.stdout.split("\n")[0] == "1 []", (proc.stdout, proc.stderr)
    assert "exists (pass --force" in proc.stderr
    import lmbp_convert

    assert lmbp_convert.convert.__module__ == "lmbp_convert.apply.convert"  # public names unchanged
    from lmbp_convert import ConvertOptions, SavedTensorLedger, convert  # noqa: F401


# -- a closed stdout (`lmbp-convert SRC DST --dry-run | head -1`) ---------------------------------------------
class _ClosedPipe:
    """The write end of a pipe whose read end is closed before anything is written: every write fails with EPIPE
    at once (Python ignores SIGPIPE), so no test depends on when a reader exits."""

    def __enter__(self):
        r, w = os.pipe()
        os.close(r)
        self.fd = w
        self.file = os.fdopen(w, "w")
        return self

    def __exit__(self, *exc):
        try:
            self.file.close()
        except BrokenPipeError:  # what the command left in the buffer
            pass


@pytest.mark.parametrize("extra", [["--dry-run"], ["--dry-run", "--json"], [], ["--force"]])
def test_closed_stdout_ends_quietly_with_no_dst(monkeypatch, capsys, saved, tmp_path, extra):
    """Once "I/O error ...: Broken pipe; no DST written", exit 1. Now no word (the reader has gone), exit 141
    (128 + SIGPIPE, what a shell reports for `cp` or `head` ended so), and DST as it was: none, or the old one."""
    from lmbp_convert.cli import EXIT_STDOUT_CLOSED, main

    src, dst = saved("llama"), tmp_path / "dst"
    if "--force" in extra:
        dst.mkdir()
        (dst / "old.txt").write_text("previous result")
    before = tree_hash(dst) if dst.exists() else None
    with _ClosedPipe() as pipe:
        monkeypatch.setattr(sys, "stdout", pipe.file)
        rc = main([str(src), str(dst), *extra])
    assert rc == EXIT_STDOUT_CLOSED == 141
    assert capsys.readouterr().err == ""
    assert (tree_hash(dst) if dst.exists() else None) == before
    assert not leftovers(tmp_path), leftovers(tmp_path)


@pytest.mark.slow  # a fresh interpreter (torch import)
def test_closed_stdout_ends_the_command_as_sigpipe_ends_head(saved, tmp_path):
    """The command itself (`cli.run`): ended by SIGPIPE like `head` or `cp`, after the exit handlers, silently."""
    import signal
    import subprocess

    root = Path(__file__).resolve().parents[2]
    command = ("import atexit, sys\n"
               "atexit.register(lambda: print('exit handler ran', file=sys.stderr))\n"
               "sys.argv = ['lmbp-convert', *sys.argv[1:]]\n"
               "from lmbp_convert.cli import run\n"
               "run()\n")
    with _ClosedPipe() as pipe:
        proc = subprocess.run([sys.executable, "-c", command, str(saved("llama")), str(tmp_path / "dst"), "--dry-run"],
                              cwd=root, stdout=pipe.fd, stderr=subprocess.PIPE, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == -signal.SIGPIPE, proc.stderr
    assert proc.stderr == "exit handler ran\n"
    assert not os.path.lexists(tmp_path / "dst")
