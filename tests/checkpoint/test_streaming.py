"""The streaming machinery: safetensors I/O, chunked folds (bit-identical to whole-tensor folds), bounded reads,
and timm checkpoint files."""
from __future__ import annotations

import json

import pytest
import torch
from ckpt_helpers import build_model, leftovers, save_model, tree_hash
from safetensors import safe_open

import lmbp_convert.checkpoint.api as api
from lmbp_convert import convert
from lmbp_convert.apply.convert import CONFIG_KEY
from lmbp_convert.checkpoint import CheckpointError, mark_prefolded, read_record
from lmbp_convert.checkpoint.safetensors_io import SafetensorsFile, SafetensorsWriter, read_entry
from lmbp_convert.checkpoint.sources import SafetensorsSource


def test_writer_reader_roundtrip(tmp_path):
    tensors = {
        "bf16": torch.randn(5, 7).to(torch.bfloat16),
        "f16": torch.randn(3).half(),
        "f32": torch.randn(2, 3, 4),
        "i64": torch.arange(6).reshape(2, 3),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }
    from lmbp_convert.checkpoint.safetensors_io import TORCH_TO_CODE

    path = tmp_path / "x.safetensors"
    w = SafetensorsWriter(path, [(k, TORCH_TO_CODE[t.dtype], tuple(t.shape), t.numel() * t.element_size())
                                 for k, t in tensors.items()], {"format": "pt", "note": "hi"})
    for k, t in reversed(list(tensors.items())):  # any order: each tensor has its own region
        w.append(k, t)
    w.close()
    with safe_open(path, "pt") as f:  # the reference reader accepts it
        assert f.metadata() == {"format": "pt", "note": "hi"}
        for k, t in tensors.items():
            assert torch.equal(f.get_tensor(k), t)
    parsed = SafetensorsFile(path)
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        for k, t in tensors.items():
            assert torch.equal(read_entry(fd, parsed.entries[k], "x"), t)
        assert torch.equal(read_entry(fd, parsed.entries["bf16"], "x", (1, 4)), tensors["bf16"][1:4])
    finally:
        os.close(fd)


def test_writer_checks_it_wrote_everything(tmp_path):
    w = SafetensorsWriter(tmp_path / "y.safetensors", [("a", "F32", (4,), 16), ("b", "F32", (2,), 8)])
    w.append("a", torch.zeros(4))
    with pytest.raises(RuntimeError, match="'b' incomplete"):
        w.close()
    w = SafetensorsWriter(tmp_path / "z.safetensors", [("a", "F32", (4,), 16)])
    with pytest.raises(RuntimeError, match="20 bytes for 'a'"):
        w.append("a", torch.zeros(5))
    w.abort()


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_chunked_folds_are_bit_identical(saved, tmp_path, cli, monkeypatch, arch):
    """Folding row chunk by row chunk (out_in and Conv1D's in_out layouts, weights and biases) gives exactly the
    bytes of one whole-tensor fold."""
    src = saved(arch)
    args = ["--untie", "-q"] if arch == "bert" else ["-q"]
    monkeypatch.setattr(api, "CHUNK_ELEMS", 1 << 30)
    assert cli(src, tmp_path / "whole", *args)[0] == 0
    monkeypatch.setattr(api, "CHUNK_ELEMS", 40)  # a few rows at a time, and uneven last chunks
    assert cli(src, tmp_path / "chunked", *args)[0] == 0
    assert tree_hash(tmp_path / "whole") == tree_hash(tmp_path / "chunked")


def test_single_core_path_gives_the_same_bytes(saved, tmp_path, cli, monkeypatch):
    """Without a second core the chunks are folded inline instead of by the worker thread: same result."""
    src = saved("llama")
    monkeypatch.setattr(api, "CHUNK_ELEMS", 40)
    assert cli(src, tmp_path / "pooled", "-q")[0] == 0
    monkeypatch.setattr(api.os, "cpu_count", lambda: 1)
    assert cli(src, tmp_path / "inline", "-q")[0] == 0
    assert tree_hash(tmp_path / "pooled") == tree_hash(tmp_path / "inline")


def test_reads_are_bounded_and_unchanged_tensors_never_loaded(tmp_path, cli, monkeypatch):
    """Streaming: only folded tensors are read into memory, a few rows at a time, plus the small norm vectors;
    everything else goes file to file."""
    model = build_model("llama", hidden_size=64, intermediate_size=128, vocab_size=512)
    src = save_model(model, tmp_path / "src", max_shard_size="64KB")
    reads: list[tuple[str, int]] = []
    real_tensor, real_rows = SafetensorsSource.tensor, SafetensorsSource.rows

    def tensor(self, key):
        t = real_tensor(self, key)
        reads.append(("tensor", t.numel() * t.element_size()))
        return t

    def rows(self, key, r0, r1, out=None):
        t = real_rows(self, key, r0, r1, out)
        reads.append(("rows", t.numel() * t.element_size()))
        return t

    monkeypatch.setattr(SafetensorsSource, "tensor", tensor)
    monkeypatch.setattr(SafetensorsSource, "rows", rows)
    monkeypatch.setattr(api, "CHUNK_ELEMS", 2048)
    rc, _, err = cli(src, tmp_path / "dst", "-q")
    assert rc == 0, err
    total = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    assert max(n for kind, n in reads if kind == "rows") <= 2048 * 4
    assert max(n for kind, n in reads if kind == "tensor") <= 64 * 4  # norm weights only
    folded = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head"}
    with open(src / "model.safetensors.index.json") as f:
        keys = json.load(f)["weight_map"]
    sd = model.state_dict()
    folded_bytes = sum(sd[k].numel() * 4 for k in keys if any(p in k for p in folded))
    assert sum(n for kind, n in reads if kind == "rows") == folded_bytes < total


# -- timm ------------------------------------------------------------------------------------------------------
TIMM_ARGS = dict(img_size=32, patch_size=8, depth=2, num_classes=10)


def timm_vit():
    import timm

    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, **TIMM_ARGS)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.LayerNorm):
                mod.weight.copy_(torch.rand(mod.weight.shape, generator=gen) + 0.5)
                mod.bias.copy_(0.5 * torch.randn(mod.bias.shape, generator=gen))
    return m.eval()


def timm_cli_args() -> list[str]:
    out = ["--timm-model", "vit_tiny_patch16_224"]
    for k, v in TIMM_ARGS.items():
        out += ["--timm-arg", f"{k}={v}"]
    return out


@pytest.mark.parametrize("fmt", ["pth-training", "safetensors"])
def test_timm_checkpoint_file(tmp_path, cli, fmt):
    import timm
    from safetensors.torch import save_file

    model = timm_vit()
    if fmt == "safetensors":
        src = tmp_path / "vit.safetensors"
        save_file(model.state_dict(), src)
    else:  # a DDP training checkpoint: wrapped state dict, "module." prefixes, other entries
        src = tmp_path / "vit.pth"
        torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in model.state_dict().items()},
                    "optimizer": {"lr": 0.1}}, src)
    before = tree_hash(src)
    dst = tmp_path / "out" / "vit-folded.safetensors"
    dst.parent.mkdir()
    rc, out, err = cli(src, dst, *timm_cli_args())
    assert rc == 0, err
    assert tree_hash(src) == before and not leftovers(dst.parent)
    assert sorted(p.name for p in dst.parent.iterdir()) == ["vit-folded.safetensors"]
    assert "fold blocks.0.norm1 [layer, w, +bias] -> blocks.0.attn.qkv" in out
    plain = timm.create_model("vit_tiny_patch16_224", pretrained=False, checkpoint_path=str(dst), **TIMM_ARGS).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, got = model(x), plain(x)
    assert ((ref - got).norm() / ref.norm()).item() <= 1e-5
    rec = read_record(dst)
    assert rec["folded_norms"] and rec["architecture"] == "vit_tiny_patch16_224"
    # convert() on the loaded model, told what is folded, swaps the norms and changes no weight
    before_sd = {k: v.clone() for k, v in plain.state_dict().items()}
    mark_prefolded(plain, rec)
    report = convert(plain, activations=False, gated_mlp=False).lmbp_report
    assert sorted(f.name for f in report.plan.norm_folds if f.prefolded) == sorted(rec["folded_norms"])
    after = plain.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before_sd.items() if k in after)
    with torch.no_grad():
        assert ((ref - plain(x)).norm() / ref.norm()).item() <= 1e-5


def test_timm_dst_must_be_safetensors_and_model_must_match(tmp_path, cli):
    model = timm_vit()
    src = tmp_path / "vit.pth"
    torch.save(model.state_dict(), src)
    rc, _, err = cli(src, tmp_path / "out.pth", *timm_cli_args())
    assert rc == 1 and "must be a .safetensors file" in err and not (tmp_path / "out.pth").exists()
    rc, _, err = cli(src, tmp_path / "out.safetensors", "--timm-model", "vit_tiny_patch16_224",
                     "--timm-arg", "img_size=32", "--timm-arg", "patch_size=8")  # depth 12: blocks.2 missing
    assert rc == 1 and "but the config expects" in err or "not expected" in err, err
    assert not (tmp_path / "out.safetensors").exists()


def test_read_record_of_hf_dst(saved, tmp_path, cli):
    dst = tmp_path / "dst"
    assert cli(saved("gpt2"), dst, "-q")[0] == 0
    rec = read_record(dst)
    assert rec == json.loads((dst / "config.json").read_text())[CONFIG_KEY]
    assert read_record(next(dst.glob("*.safetensors"))) == rec


def test_reconverting_dst_is_idempotent(saved, tmp_path, cli):
    """DST of DST: the recorded norms are skipped as already folded, the weights stay byte-identical."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert cli(saved("llama"), a, "-q")[0] == 0
    rc, out, err = cli(a, b, "--allow-empty")
    assert rc == 0, err
    assert "already folded on disk" in out
    ha, hb = tree_hash(a), tree_hash(b)
    assert {k: v for k, v in ha.items() if k != "config.json" and not k.endswith(".safetensors")} == \
        {k: v for k, v in hb.items() if k != "config.json" and not k.endswith(".safetensors")}
    for p in a.glob("*.safetensors"):
        with safe_open(p, "pt") as fa, safe_open(b / p.name, "pt") as fb:
            assert all(torch.equal(fa.get_tensor(k), fb.get_tensor(k)) for k in fa.keys())
    assert read_record(b)["folded_norms"] == read_record(a)["folded_norms"]


def test_checkpoint_error_is_one_line():
    assert str(CheckpointError("a\n  b\tc")) == "a b c"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["out_in", "in_out"])
@pytest.mark.parametrize("in_place", [False, True])
def test_fold_rows_matches_fold_affine_bit_for_bit(dtype, layout, in_place):
    from lmbp_convert.fold import Scratch, fold_rows
    from lmbp_convert.fold import effective_scale, fold_affine

    w = torch.randn(37, 23, dtype=torch.float64).to(dtype)
    d = w.shape[1] if layout == "out_in" else w.shape[0]
    gamma = effective_scale((torch.randn(d) * 0.3).to(dtype), "1+w")
    want = fold_affine(w, None, gamma, None, layout)[0]
    scratch = Scratch()
    parts = []
    for r0 in range(0, w.shape[0], 5):
        x = w[r0:r0 + 5].clone()
        parts.append(fold_rows(x, gamma, layout, r0, scratch, in_place=in_place).clone())
    got = torch.cat(parts)
    assert got.dtype == dtype and torch.equal(got, want)


def test_progress_bar_when_asked(saved, tmp_path, capsys):
    from lmbp_convert.checkpoint import convert_checkpoint

    convert_checkpoint(saved("llama"), tmp_path / "dst", progress=True)
    err = capsys.readouterr().err
    assert "lmbp-convert:" in err and "%|" in err  # a tqdm bar (left off the screen when done)


def test_sigterm_mid_write_removes_partial_dst(saved, tmp_path, cli, monkeypatch):
    """SIGTERM raised synchronously on the main thread at its third write (signal.raise_signal in the fault hook):
    the handler runs right there on any machine load. (os.kill from a copying thread, as before, let the handler
    run at a load-dependent point of the main thread.)"""
    import signal
    import threading

    import lmbp_convert.checkpoint.fsops as fsops

    src = saved("llama")
    before = tree_hash(src)
    writes = []

    def term(op, path):
        if op == "write" and threading.current_thread() is threading.main_thread():
            writes.append(path)
            if len(writes) == 3:
                signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(fsops, "fault_hook", term)
    old = signal.getsignal(signal.SIGTERM)
    rc, _, err = cli(src, tmp_path / "dst")
    assert len(writes) == 3  # the handler raised at once: no write after the signal
    assert rc == 143 and "terminated" in err and err.count("\n") == 1
    assert not (tmp_path / "dst").exists() and not leftovers(tmp_path) and tree_hash(src) == before
    assert signal.getsignal(signal.SIGTERM) == old  # the CLI restores the handler


def test_timm_use_ema(tmp_path, cli):
    import timm

    model, ema = timm_vit(), timm_vit()
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.9)
    src = tmp_path / "train.pth"
    torch.save({"state_dict": model.state_dict(), "state_dict_ema": ema.state_dict()}, src)
    dst = tmp_path / "ema.safetensors"
    rc, _, err = cli(src, dst, *timm_cli_args(), "--use-ema", "-q")
    assert rc == 0, err
    plain = timm.create_model("vit_tiny_patch16_224", pretrained=False, checkpoint_path=str(dst), **TIMM_ARGS).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, got = ema(x), plain(x)
    assert ((ref - got).norm() / ref.norm()).item() <= 1e-5


def test_prefetch_reads_files_in_order_up_to_the_budget(tmp_path, monkeypatch):
    import os

    import lmbp_convert.checkpoint.fsops as fsops

    files = []
    for i, size in enumerate((100, 300, 50)):
        p = tmp_path / f"s{i}.safetensors"
        p.write_bytes(b"x" * size)
        files.append(p)
    real = os.sendfile
    reads = []

    def sendfile(out_fd, in_fd, offset, count):
        reads.append((os.fstat(in_fd).st_size, offset, count))
        return real(out_fd, in_fd, offset, count)

    monkeypatch.setattr(os, "sendfile", sendfile)
    fsops.prefetch([*files, tmp_path / "missing"], budget=250)
    assert reads == [(100, 0, 100), (300, 0, 150)]  # in order; the second file up to the budget
