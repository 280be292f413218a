"""Smoke run of the benchmarks at tiny sizes: per-block byte accounting, the variants, the CPU step
timer, the GPU mode's code (on CPU tensors; it must refuse to start without CUDA), the rendering of
docs/benchmarks.md and its charts from the JSON results, and scripts/gpu_run.sh's commands. The end-to-end runs
are `slow`; the argument, refusal and phase-order checks stay in the fast loop."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from benchmarks import all as A
from benchmarks import common as C
from benchmarks import host as H
from benchmarks import memory as M
from benchmarks import qlora as Q
from benchmarks import speed as S
from benchmarks import speed_gpu as SG

ROOT = C.ROOT


@pytest.fixture(scope="module")
def mem_data():
    args = M.parse_args(["--tiny", "--families", "llama,vit", "--modes", "bf16", "--no-compile", "--no-scaling"])
    return M.run(args, log=lambda *a: None)


@pytest.mark.slow
def test_per_block_bytes_closed_form():
    """Checkpointing keeps exactly each block's input, so one block is batch x seq x hidden x 2 bytes (bf16);
    the block difference sees nothing of the embedding or the final norm."""
    fam = C.TINY["llama"].with_(batch=2)
    m = C.build(fam, torch.bfloat16)
    x = C.make_input(fam, torch.bfloat16)
    C.set_checkpointing(m, True)
    assert C.per_block_bytes(fam, m, x, False) == 2 * fam.seq * fam.hidden * 2
    C.set_checkpointing(m, False)
    one = C.per_block_bytes(fam, m, x, False)
    assert one > 10 * 2 * fam.seq * fam.hidden * 2  # a real block keeps much more than its input
    assert C.per_block_bytes(fam, m, C.make_input(fam.with_(batch=4), torch.bfloat16), False) == 2 * one
    assert len(C.block_list(m)) == 2  # truncation restored the blocks


@pytest.mark.slow
def test_ledger_frees_the_graph():
    """The benchmark ledger must not keep what it measured alive (lmbp_convert.SavedTensorLedger hands autograd detached aliases)."""
    import weakref

    fam = C.TINY["llama"]

    def measure():
        m = C.build(fam, torch.float32)
        C.saved_bytes(fam, m, C.make_input(fam, torch.float32), False)
        return weakref.ref(m.layers[0].mlp.up_proj.weight)

    ref = measure()
    import gc

    gc.collect()
    assert ref() is None


@pytest.mark.slow
def test_memory_rows(mem_data):
    k = M.by_key(mem_data["blocks"])
    for fam in ("llama", "vit"):
        orig = k[(fam, "bf16", M.V_ORIG)]["bytes"]
        conv = k[(fam, "bf16", M.V_CONV)]["bytes"]
        ckpt = k[(fam, "bf16", M.V_CKPT)]["bytes"]
        assert 0 < ckpt < conv < orig, (fam, orig, conv, ckpt)
        liger = k[(fam, "bf16", M.V_LIGER)]
        assert liger["bytes"] is None and "CUDA" in liger["note"]
    # LLaMA: the paper's two rewrites alone save less than with the memory-sharing gated MLP
    assert k[("llama", "bf16", M.V_CONV)]["bytes"] < k[("llama", "bf16", M.V_PAPER)]["bytes"] < \
        k[("llama", "bf16", M.V_ORIG)]["bytes"]
    assert k[("llama", "bf16", M.V_EAGER)]["bytes"] > k[("llama", "bf16", M.V_ORIG)]["bytes"]  # fp32 softmax kept
    assert not [r for r in mem_data["blocks"] if r.get("error")]
    table = M.summary_table(mem_data)
    assert "LLaMA (tiny)" in table and "−29.19 %" in table and "n/a" in table


@pytest.mark.slow
def test_compiled_block_is_counted():
    """torch.compile's saved tensors reach the ledger: the compiled LLaMA block keeps less than eager (it
    recomputes the norm's fp32 copies) but not nothing."""
    fam = C.TINY["llama"]
    m = C.build(fam, torch.bfloat16)
    x = C.make_input(fam, torch.bfloat16)
    eager = C.per_block_bytes(fam, m, x, False)
    compiled, info = M._compiled_bytes(fam, m, x, False)
    assert info["graphs"] >= 1
    assert 0.3 * eager < compiled < eager


@pytest.mark.slow
def test_speed_cpu(tmp_path, monkeypatch):
    args = S.parse_args(["--tiny", "--families", "vit", "--modes", "bf16", "--repeats", "1", "--warmup", "0",
                         "--json", str(tmp_path / "speed.json")])
    monkeypatch.setattr(S, "CONVERT_SIZES_TINY", S.CONVERT_SIZES_TINY[:1])
    threads = torch.get_num_threads()
    data = S.cpu_run(args, log=lambda *a: None)
    assert {r["variant"] for r in data["steps"]} == {S.V_ORIG, S.V_CONV, S.V_CKPT}
    assert all(r["median_s"] > 0 for r in data["steps"])
    assert data["convert"][0]["verified"] is True and data["convert"][0]["convert_s"] > 0
    assert json.loads((tmp_path / "speed.json").read_text())["steps"]
    assert "converted / original" in S.cpu_table(data)
    assert data["threads"] == 1 and data["clock"] == "thread_time" and torch.get_num_threads() == threads


def test_speed_cpu_modes_and_threads():
    """Without --modes the CPU steps run each family's default modes (ViT/BERT add fp32); --threads picks torch's."""
    a = S.parse_args([])
    assert a.threads == 1 and a.modes is None
    assert S.CPU_MODES["vit"] == S.CPU_MODES["bert"] == ("fp32", "bf16", "autocast")
    assert S.parse_args(["--threads", "2", "--modes", "fp32"]).mode_list == ["fp32"]
    with pytest.raises(SystemExit):
        S.parse_args(["--threads", "0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_gpu_mode_fails_fast_without_cuda(capsys):
    assert S.main(["--gpu"]) == 2
    assert S.NO_CUDA in capsys.readouterr().err


@pytest.mark.slow
def test_gpu_mode_code_on_cpu():
    """The GPU sections run their code on CPU tensors (no peak memory there); Liger is CUDA-only."""
    budget = S.Budget(600)
    v = S.vit_lora("cpu", True, 1, 0, budget, log=lambda *a: None, compile_=False)
    assert [r["variant"] for r in v["rows"]] == [S.V_ORIG, S.V_CONV]
    assert all("error" not in r and r["img_s"] > 0 for r in v["rows"]), v
    assert v["rows"][1]["saved_bytes"] < v["rows"][0]["saved_bytes"]
    s = S.llama_slice("cpu", True, ["bf16"], 1, 0, budget, compile_=False, log=lambda *a: None)
    rows = {r["variant"]: r for r in s["rows"]}
    assert rows[S.V_CONV]["block_bytes"] < rows[S.V_ORIG]["block_bytes"]
    liger = rows[S.V_LIGER]  # a measured row, or one that says why not (Liger-Kernel missing here, CUDA-only ops)
    assert (isinstance(liger.get("error"), str) and ":" in liger["error"]) if "error" in liger else \
        liger["block_bytes"] > 0, liger
    md = S.gpu_tables({"machine": "test", "vit_lora": v, "llama_slice": s})
    assert "ViT-B/16 LoRA" in md and "3827" in md and "LLaMA-7B-shaped slice" in md


def test_gpu_mode_phases(monkeypatch, tmp_path):
    """The GPU mode runs eager rows of both models first, then compiled ones, then CUDA graphs; rows accumulate
    per section, the JSON is rewritten after each row, and a phase that fails as a whole is listed, not lost."""
    seen = []

    def fake_vit(device, tiny, steps, warmup, budget, log, compile_, only, into, on_row):
        into["shape"] = "vit"
        for v in sorted(only):
            into["rows"].append({"variant": v})
            on_row()
            seen.append(json.loads((tmp_path / "g.json").read_text())["vit_lora"]["rows"][-1]["variant"])
        return into

    def fake_llama(device, tiny, modes, steps, warmup, budget, compile_, log, seq, batch, ckpt, only, into,
                   on_row):
        if S.V_COMPILE in only:
            raise RuntimeError("boom")
        into["rows"] += [{"mode": "bf16", "variant": v} for v in sorted(only)]
        return into

    monkeypatch.setattr(SG, "vit_lora", fake_vit)  # gpu_run's own module
    monkeypatch.setattr(SG, "llama_slice", fake_llama)
    args = S.parse_args(["--gpu", "--device", "cpu", "--tiny", "--sections", "vit_lora,llama_slice",
                         "--json", str(tmp_path / "g.json")])
    data = S.gpu_run(args, log=lambda *a: None)
    vit = [r["variant"] for r in data["vit_lora"]["rows"]]
    assert vit == [v for ph in S.VIT_PHASES for v in sorted(ph)] == seen
    assert set(vit) == {v[0] for v in S.VIT_VARIANTS}
    assert [r["variant"] for r in data["llama_slice"]["rows"]] == sorted(S.LLAMA_PHASES[0])
    assert data["llama_slice"]["errors"] == ["RuntimeError: boom"]
    assert json.loads((tmp_path / "g.json").read_text())["llama_slice"]["errors"] == ["RuntimeError: boom"]
    assert len(data["date"]) == 10 and data["date"][4] == "-"  # the run's date, which the docs then give


@pytest.mark.slow
def test_gpu_mode_compiled_vit_row_on_cpu(monkeypatch):
    """A compiled ViT LoRA row (dynamo with the eager backend, to keep it fast): counted graphs, no break,
    and a table row that compares it with the compiled original."""
    monkeypatch.setattr(SG, "COMPILE_BACKEND", "eager")
    fam = S.C.TINY["vit"].with_(batch=2)
    row = S._vit_lora_variant(fam, "cpu", True, S.V_CONV_COMPILE, 1, 0, convert_=True, compile_mode="default")
    assert row["graphs"] >= 1 and row["graph_breaks"] == 0 and row["img_s"] > 0
    ref = dict(row, variant=S.V_COMPILE, converted=False, img_s=2 * row["img_s"])
    md = S.gpu_tables({"machine": "test", "vit_lora": {"shape": "s", "rows": [ref, row]}})
    assert "0.50×" in md and S.V_CONV_COMPILE in md


@pytest.mark.slow
def test_bench_all_renders(mem_data, tmp_path):
    pytest.importorskip("matplotlib")
    res, out = tmp_path / "res", tmp_path / "docs"
    res.mkdir()
    (res / "memory.json").write_text(json.dumps(mem_data))
    speed = {"kind": "speed", "machine": "test", "repeats": 1, "warmup": 0, "elapsed_s": 1.0,
             "steps": [{"family": "vit", "label": "ViT (tiny)", "mode": "bf16", "variant": v, "median_s": t,
                        "ratio": t / 0.2, "shape": "tiny", "runs_s": [t]}
                       for v, t in ((S.V_ORIG, 0.2), (S.V_CONV, 0.21), (S.V_CKPT, 0.3))],
             "convert": [{"hidden": 64, "intermediate": 172, "layers": 2, "vocab": 256, "params": 10 ** 6,
                          "plan_s": 0.1, "convert_s": 0.2, "verified": True}]}
    (res / "speed.json").write_text(json.dumps(speed))
    gpu = {"machine": "NVIDIA test GPU", "vit_lora": {"shape": "s", "rows": [
        {"variant": S.V_ORIG, "peak": 3 * 2 ** 30, "img_s": 100.0, "saved_bytes": 2 ** 30},
        {"variant": S.V_CONV, "peak": 2 * 2 ** 30, "img_s": 99.0, "saved_bytes": 2 ** 29}]},
        "kernels": {"table": "| op | x |\n|---|---|\n| a -- b | 1 |"}}
    (tmp_path / "gpu.json").write_text(json.dumps(gpu))
    host = {"kind": "host", "machine": "test CPU", "stub_mode": "native-launch", "arch": 90, "rounds": 3,
            "ops": [{"op": "MS-LayerNorm", "native": "F.layer_norm + affine", "dtype": "bfloat16", "ours_us": 40.0,
                     "native_us": 30.0, "extra_us": 10.0, "ratio": 1.33, "launches": 2, "within_budget": True}],
            "vit_proxy": {"shape": "tiny ViT", "original_ms": 10.0, "converted_ms": 11.0, "ratio": 1.1,
                          "extra_ms": 1.0, "lmbp_modules": 37, "launches_per_step": 73}}
    (res / "host.json").write_text(json.dumps(host))
    ops = {"kind": "ops", "machine": "test CPU", "threads": 1, "clock": "thread_time", "cpu_kernels": "native (test)",
           "runs": 3, "warmup": 1,
           "rows": [{"op": "ms_layer_norm", "ref": "F.layer_norm +affine", "dtype": "bf16", "shape": "2x8",
                     "op_fwd": 1e-3, "op_bwd": 1e-3, "ref_fwd": 1e-3, "ref_bwd": 1.5e-3, "op_saved": 1, "ref_saved": 1}]}
    (res / "ops.json").write_text(json.dumps(ops))
    qlora = {"kind": "qlora", "machine": "NVIDIA test GPU", "quantized": True, "batch": 4, "seq": 1024, "rank": 16,
             "steps": 8, "warmup": 2, "model": {"shape": "LLaMA 1.1 B"},
             "rows": [{"variant": "QLoRA", "tokens_s": 1000.0, "peak": 2 ** 30, "peak_over_static": 2 ** 29,
                       "block_bytes": 2 ** 27, "first_loss": 10.4, "load_s": 5.0},
                      {"variant": "lmbp-convert + QLoRA", "error": "RuntimeError: x"}]}
    (tmp_path / "qlora.json").write_text(json.dumps(qlora))
    argv = ["--render-only", "--results", str(res), "--out-dir", str(out)]
    assert A.main(argv + ["--gpu-json", str(tmp_path / "gpu.json"), "--qlora-json", str(tmp_path / "qlora.json")]) == 0
    md = (out / "benchmarks.md").read_text()
    for part in ("## Activation memory per block", "## How activation memory grows", "## Step time on CPU",
                 "## convert() time vs model size", "## GPU", "NVIDIA test GPU", "![bench_memory.png]",
                 "## Host time of the CUDA path", "| MS-LayerNorm | F.layer_norm + affine |", "**1.100×**",
                 "**QLoRA flow**", "failed: RuntimeError: x", "## Op time on CPU",
                 "| ms_layer_norm | F.layer_norm +affine | bf16 | 2x8 |", "**0.80×** | ≤ 1.05×: yes"):
        assert part in md, part
    for png in ("bench_memory.png", "bench_speed.png", "bench_convert_time.png", "bench_gpu.png"):
        assert (out / png).stat().st_size > 10_000, png
    # a later CPU-only render keeps the GPU figures (embedded in benchmarks.md), "--" and all
    (res / "gpu.json").unlink()
    assert A.main(argv) == 0
    assert A.embedded_gpu(str(out / "benchmarks.md"))["kernels"]["table"].endswith("| a -- b | 1 |")
    assert "NVIDIA test GPU" in (out / "benchmarks.md").read_text()


# ------------------------------------------------------------------------ host time, QLoRA, GPU runner
def _env_without_interpreter() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.slow
def test_host_bench_runs_the_triton_path(tmp_path):
    """benchmarks.host (own process: it installs a stub Triton driver) times each op on its Triton path, with
    real compiled kernels and no-op launches, next to the native op; and the ViT LoRA step proxy."""
    pytest.importorskip("triton")
    import subprocess

    out = tmp_path / "host.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.host", "--quick", "--json", str(out)],
                       cwd=ROOT, env=_env_without_interpreter(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["stub_mode"] in ("native-launch", "python-launch")
    ops = {r["op"]: r for r in data["ops"]}
    assert len(ops) == 7 and "MS-LayerNorm" in ops and "MSLayerNorm module" in ops
    for r in ops.values():  # every op took its Triton path (forward and backward each launch a kernel)
        assert r["launches"] >= 2 and r["ours_us"] > 0 and r["native_us"] > 0, r
    v = data["vit_proxy"]
    assert "error" not in v, v
    # 12 blocks x (2 norms + GELU) + the final norm; each launches in forward, and in backward where needed
    assert v["lmbp_modules"] >= 36 and v["launches_per_step"] >= v["lmbp_modules"], v
    assert v["original_ms"] > 0 and v["converted_ms"] > 0
    # the decoder: 8 blocks x (2 RMSNorms + the gated MLP) + the final norm, all on their Triton path, and the LM
    # head whose backward makes the memory-sharing loss's gradient by rows (MSLogitsHead)
    la = data["llama_proxy"]
    assert "error" not in la, la
    # (its hooks: the exact norms' shared-saves region, one pre/post pair on the root)
    assert la["lmbp_modules"] == 26 and la["launches_per_step"] >= 2 * 24 and la["lmbp_hooks"] == 2, la
    # post-LN BERT: with exact norms (the default) its residual branches read the norm's own output, so no re-apply
    # hooks (the fold needed 12 and more); only the shared-saves region's pair on the root
    be = data["bert_proxy"]
    assert "error" not in be, be
    assert be["lmbp_modules"] >= 36 and be["lmbp_hooks"] == 2 and be["launches_per_step"] >= be["lmbp_modules"], be
    md = H.host_tables(data)
    assert "ViT-B/16 LoRA r4 step proxy" in md and "F.layer_norm" in md
    assert "LLaMA decoder LoRA r8 step proxy" in md and "BERT-base (post-LN) LoRA r4 step proxy" in md
    assert H.host_tables({"skipped": "RuntimeError: no Triton"}) == "Not measured: RuntimeError: no Triton."


@pytest.mark.slow
def test_qlora_flow_tiny_on_cpu(tmp_path, monkeypatch):
    """The QLoRA flow end to end at tiny size without 4-bit loading: checkpoint → lmbp-convert → load →
    convert() → LoRA → steps; the fold is exact (same first loss) and a converted block saves less."""
    monkeypatch.setattr(Q, "CLI_IN_PROCESS", True)
    args = Q.parse_args(["--tiny", "--no-quant", "--device", "cpu", "--json", str(tmp_path / "q.json")])
    assert Q.problem(args) is None
    data = Q.run(args, log=lambda *a: None)
    rows = {r["variant"]: r for r in data["rows"]}
    base, ours = rows[Q.V_BASE], rows[Q.V_OURS]
    assert "error" not in base and "error" not in ours, data["rows"]
    assert ours["verified"] is True and "norms" in ours["convert_report"]
    assert ours["block_bytes"] < base["block_bytes"]
    assert abs(ours["first_loss"] - base["first_loss"]) < 1e-2
    assert ours["trainable_params"] == base["trainable_params"]  # LoRA found the same projections
    assert json.loads((tmp_path / "q.json").read_text())["rows"][1]["tokens_s"] > 0
    assert "lmbp-convert + QLoRA" in Q.table(data)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_qlora_refuses_without_cuda(capsys):
    assert Q.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_gpu_runner_commands_parse():
    """scripts/gpu_run.sh: every command it would run parses with its module's own argument parser (a typo there
    would cost a GPU lease), the CUDA tests run with compiled kernels, each part has a time cap, and the wheels it
    names are pinned."""
    import shlex
    import subprocess

    from benchmarks import kernels as K

    sh = os.path.join(ROOT, "scripts", "gpu_run.sh")
    p = subprocess.run(["bash", sh], env={**os.environ, "GPU_RUN_DRY": "1", "OUT": "/tmp/o"}, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = [shlex.split(line) for line in p.stdout.splitlines() if line.strip()]
    assert [w[0] for w in lines] == ["cuda_tests", "kernels", "bench_speed", "bench_qlora"]
    assert sum(int(w[1]) for w in lines) <= 8 * 60  # the caps fit the 8-minute plan
    cmd = {w[0]: w[2:] for w in lines}
    assert cmd["cuda_tests"][:2] == ["env", "TRITON_INTERPRET=0"] and "tests/ops/test_cuda.py" in cmd["cuda_tests"] \
        and "tests/ops/backends/test_cuda_host.py" in cmd["cuda_tests"]
    assert os.path.exists(os.path.join(ROOT, cmd["cuda_tests"][-1]))
    parsers = {"benchmarks.kernels": K.parse_args, "benchmarks.speed": S.parse_args, "benchmarks.qlora": Q.parse_args}
    for part in ("kernels", "bench_speed", "bench_qlora"):
        assert cmd[part][1] == "-m", cmd[part]
        parsers[cmd[part][2]](cmd[part][3:])
    assert S.parse_args(cmd["bench_speed"][3:]).gpu
    text = open(sh).read()
    assert "bitsandbytes==" in text and "liger-kernel==" in text


def test_host_block_key_groups_module_roles():
    assert H._block_key("base_model.model.blocks.7.mlp.fc1") == "blocks.*.mlp.fc1"
    assert H._block_key("base_model.model.norm") == "norm"
    assert H._block_key("") == "(model)"


@pytest.mark.slow
def test_host_bench_attribution_parts(tmp_path):
    """--parts context,breakdown: our op → Linear pairs against the native pairs, and the proxy step split into
    forward / backward / optimizer and per module role, for both models."""
    pytest.importorskip("triton")
    import subprocess

    out = tmp_path / "host.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.host", "--quick", "--parts", "context,breakdown",
                        "--breakdown", "vit,llama", "--json", str(out)], cwd=ROOT, env=_env_without_interpreter(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["op"] for r in data["context"]] == ["MSLayerNorm → Linear", "ApproxActivation(gelu) → Linear",
                                                  "MSRMSNorm → Linear", "MSGatedMLP (SiLU)"]
    assert all(r["ours_us"] > 0 and r["native_us"] > 0 for r in data["context"])
    bd = data["vit_breakdown"]
    assert [r["phase"] for r in bd["phases"]] == ["forward", "backward", "optimizer"]
    roles = {r["module"] for r in bd["forward_by_module"]}
    assert "blocks.*.norm1" in roles and all(r["original_us"] > 0 for r in bd["forward_by_module"])
    # the decoder's breakdown: a converted MLP is one role (nothing inside it hooked, so it keeps its fused path)
    roles = {r["module"] for r in data["llama_breakdown"]["forward_by_module"]}
    assert "model.layers.*.mlp" in roles and not any(r.startswith("model.layers.*.mlp.") for r in roles), roles
    md = H.host_tables(data)
    assert "MSLayerNorm → Linear" in md and "forward of blocks.*.norm1" in md


def test_the_gpu_section_says_when_it_was_measured_and_what_changed_since():
    """Issue 36 item 7: the GPU figures carry their date and machine, and the code's changes since them, in the
    results embedded in docs/benchmarks.md; benchmarks.all renders them under the section's heading (here: the
    committed file holds exactly what it would render), and a new GPU run records its date."""
    md_path = C.ROOT + "/docs/benchmarks.md"
    gpu = A.embedded_gpu(md_path)
    assert gpu["date"] == "2026-11-30" and len(gpu["since"]) >= 3
    text = open(md_path).read()
    cpu = next(line for line in text.splitlines() if line.startswith("CPU machine: "))[len("CPU machine: "):-1]
    assert "## GPU\n\n" + "\n".join(A.gpu_dated(gpu, cpu)) + "\n\n" in text
    assert "16 activations, 1 norms, 0 gated MLPs converted; 32 skipped" in gpu["since"][0]
    assert A.gpu_dated({"machine": "m", "date": "2030-01-01"}, "m") == ["**Measured 2030-01-01** on m."]
