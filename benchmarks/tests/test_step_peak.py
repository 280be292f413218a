"""The whole-step peak harness: its live-tensor tracker is exact (a hand-computed case, and MemTracker's total on
a model MemTracker can hook), and on tiny configurations the variants keep their relations (checkpointing lowers
the activations at the peak, conversion never raises the peak; converted + checkpointing against checkpointing
alone: the last test here)."""
import pytest
import torch
from torch import nn

from benchmarks import step_peak as SP
from benchmarks.live_tensors import LiveTensorTracker


def test_tracker_is_exact_on_a_hand_computed_step():
    n = 1000  # fp32: 4000 bytes a tensor
    x, w = torch.randn(n), nn.Parameter(torch.randn(n))
    with LiveTensorTracker() as tr:
        tr.register([w], "params")
        tr.register([x], "activations")
        tr.watch_grads([w])
        tr.phase("forward")
        y = (w * x).sum()  # w * x (4000) is alive while the sum (4) is made, then freed
        tr.phase("backward")
        y.backward()  # seed 4, grad of w 4000 (AccumulateGrad keeps MulBackward's output)
        del y
    pk = tr.peak([w, w.grad])
    assert pk.phase_peaks["forward"] == 3 * 4 * n + 4
    assert pk.bytes == 3 * 4 * n + 8 and pk.phase == "backward"
    assert pk.split == {"params": 4 * n, "grads": 4 * n, "optimizer": 0, "activations": 4 * n + 8}
    assert pk.untracked == 0 and tr.live_bytes == 3 * 4 * n  # x, w, w.grad


def test_tracker_frees_and_resizes():
    with LiveTensorTracker() as tr:
        a = torch.empty(1000)  # 4000
        b = a * 2  # 8000 live
        del a
        c = torch.empty(3000)  # 4000 + 12000 = 16000: the peak
        del b, c
        d = torch.empty(10)
        d.resize_(5000)  # resized in place: 20000 bytes, a new peak
    assert tr.peak().bytes == 20000 and tr.live_bytes == 20000


def test_tracker_matches_memtracker_total():
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32), nn.LayerNorm(32), nn.Linear(32, 10))
    opt = torch.optim.AdamW(m.parameters())
    x = torch.randn(16, 32)

    def step():
        m(x).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with LiveTensorTracker() as tr:
        tr.register(m.parameters(), "params")
        tr.register([t for s in opt.state.values() for t in s.values()], "optimizer")
        tr.register([x], "activations")
        tr.watch_grads(m.parameters())
        step()
    mt = mem_tracker.MemTracker()
    mt.track_external(m, opt, x)
    with mt:
        step()
    assert tr.peak().bytes == mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.fixture(scope="module")
def tiny_rows():
    cfgs = [SP.TINY["a"], SP.TINY["c"]]
    data = SP.run(cfgs, ["original", "converted", "ckpt", "ckpt-reentrant"], log=lambda *_: None)
    return {(r["config"], r["variant"]): r for r in data["rows"]}, data


def test_variants_keep_their_relations(tiny_rows):
    rows, data = tiny_rows
    assert not [r for r in data["rows"] if "error" in r], data["rows"]
    for cfg in ("a", "c"):
        orig, conv, ckpt = rows[cfg, "original"], rows[cfg, "converted"], rows[cfg, "ckpt"]
        assert conv["verified"] and conv["peak"] <= orig["peak"]
        assert ckpt["activations"] < orig["activations"]
        for r in (orig, conv, ckpt):
            assert r["untracked"] == 0 and r["params"] > 0 and r["optimizer"] > 0
            assert r["peak"] == r["params"] + r["grads"] + r["optimizer"] + r["activations"]
    assert rows["a", "ckpt-reentrant"]["activations"] < rows["a", "original"]["activations"]
    assert ("c", "ckpt-reentrant") not in rows  # timm: no reentrant switch
    md = SP.table(data)
    assert "(a) LLaMA d 64" in md and "2 layers, T 32, batch 2" in md


def test_convert_kwargs_reach_convert():
    cfg = SP.TINY["a"]
    full = SP.measure_variant(cfg, "converted")
    no_norms = SP.measure_variant(cfg, "converted", convert_kwargs={"norms": False})
    assert no_norms["items"] < full["items"]


def test_command_line_scales_and_checks():
    a = SP.parse_args(["--tiny", "--configs", "a,b", "--layers", "3", "--seq", "16", "--batch", "1",
                       "--convert-kwargs", '{"norms": false}'])
    cfgs = SP.configs_of(a)
    assert [(c.key, c.layers, c.seq, c.batch) for c in cfgs] == [("a", 3, 16, 1), ("b", 3, 16, 1)]
    assert cfgs[1].lora_dropout == 0.05 and a.convert_kwargs == {"norms": False}
    with pytest.raises(SystemExit):
        SP.parse_args(["--variants", "nope"])


def test_native_cpu_kernels_run_under_the_tracker_only():
    """The tracker observes allocations only, so the package's C++ CPU kernels (what a CPU run takes) run under it
    and their outputs are tracked; any other dispatch mode still sees the PyTorch path's every op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lmbp_convert.ops.backends import cpu_native
    from lmbp_convert.ops.approx_act import _CONSTANTS

    if cpu_native.build_info().get("error") or cpu_native.LIBRARY.state != "ready":
        pytest.skip("the native CPU kernels are not built here")
    x = torch.randn(4096)
    thr = _CONSTANTS[("gelu", 2)].c_f32
    with LiveTensorTracker() as tr:
        out = cpu_native.act_fwd(x, "gelu", 2, thr)
        assert out is not None
        y, codes = out
        assert tr.live_bytes == y.nbytes + codes.nbytes
    with TorchDispatchMode():
        assert cpu_native.act_fwd(x, "gelu", 2, thr) is None


def test_step_time_runs_interleaved_rounds_on_a_tiny_config():
    from benchmarks import step_time

    row = step_time.run(SP.TINY["a"], ["original", "converted"], rounds=2, convert_kwargs={}, log=lambda *_: None)
    assert row["ratio"]["original"] == 1.0 and row["ratio"]["converted"] > 0
    assert all(len(ts) == 2 for ts in row["times_s"].values())


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("config,ckpt", [("a", "ckpt"), ("a", "ckpt-reentrant"), ("c", "ckpt")])
def test_converted_checkpointed_step_peaks_below_checkpointing_alone(config, ckpt):
    """The whole training step's peak (live tensors: parameters, gradients, AdamW state, activations and
    temporaries; benchmarks.step_peak) on a PEFT LoRA model: tiny LLaMA in bf16 with HF's loss under HF's
    non-reentrant and reentrant checkpointing, tiny timm ViT under autocast with set_grad_checkpointing."""
    cfg = SP.TINY[config]
    alone = SP.measure_variant(cfg, ckpt)
    both = SP.measure_variant(cfg, "converted+" + ckpt)
    assert both["verified"] and both["untracked"] == alone["untracked"] == 0
    assert both["params"] == alone["params"] and both["optimizer"] == alone["optimizer"]
    assert both["peak"] < alone["peak"], (both, alone)
    assert both["activations"] < alone["activations"], (both, alone)


@pytest.mark.slow
def test_step_time_compiled_runs_the_variants_through_torch_compile():
    """``--compile``: every variant's step runs as compiled graphs (inductor), warmed up before the rounds."""
    from benchmarks import step_time

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    row = step_time.run(SP.TINY["c"], ["original", "converted"], rounds=1, convert_kwargs={}, log=lambda *_: None,
                        compiled=True)
    assert row["compiled"] and row["ratio"]["converted"] > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # one per model at least
    torch._dynamo.reset()


def test_chart_is_drawn_from_a_run(tiny_rows, tmp_path):
    """Issue 36 item 7: the benchmark writes the README's chart; here from the tiny run's rows (the variants it lacks,
    converted + ckpt here, are left out of their group)."""
    _, data = tiny_rows
    path = tmp_path / "step_peak.png"
    SP.chart(data, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    groups = dict(SP.chart_groups(data))
    assert list(groups) == ["(a)", "(c)"] and set(groups["(a)"]) == {"original", "converted", "ckpt"}


def test_chart_from_the_readme_table(tmp_path):
    """The README's chart is drawn from the figures its table records (`--from-table`): every row and variant, the
    peaks and activations as the table gives them."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    data = SP.rows_from_table(readme)
    groups = dict(SP.chart_groups(data))
    assert len(groups) == 5 and all(set(g) == set(SP.CHART_VARIANTS) for g in groups.values()), groups
    first = groups["(a) LLaMA LoRA"]
    assert first["original"]["peak"] == round(3010.1 * 2**20) and first["original"]["activations"] == round(2710.8 * 2**20)
    assert first["converted+ckpt"]["peak"] == round(453.1 * 2**20)
    assert "Intel Xeon" in data["machine"]
    out = tmp_path / "chart.png"
    assert SP.main(["--from-table", str(Path(__file__).resolve().parents[2] / "README.md"), "--chart", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):
        SP.parse_args(["--from-table", "README.md"])  # a chart needs --chart
