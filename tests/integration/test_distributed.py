"""Distributed training of converted models: DDP and FSDP2 (``fully_shard``) with gloo, 2 processes, one machine.

Each worker builds the same tiny model, converts it *before* wrapping (folded norms' parameters become buffers,
so the wrapper must see the converted module tree), trains a few SGD steps on its half of every global batch and
saves the full parameters. The test then checks that both ranks hold identical parameters, that they match a
single-process run on the whole batch (both wrappers average gradients over ranks, and each rank's loss is a mean
over equally many items, so the averaged gradient is the gradient of the full-batch loss), that training moved
them, and that the wrapped model saves for backward what the unwrapped converted model saves. The workers are this
file run as a script with a torchrun-like environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): pytest imports
test files under names that ``torch.multiprocessing.spawn`` could not re-import.
"""
from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import traceback

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.slow  # spawns DDP/FSDP worker processes

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
ROOT = os.path.dirname(TESTS)
for _p in (TESTS, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

MODELS = ("llama", "timm_vit")
MODES = ("ddp", "fsdp2")
# fsdp2_linear: every Linear is its own FSDP unit too. The fused gated MLP reads down_proj.weight without calling
# down_proj, which would see a shard there; MSGatedMLP must notice the FSDP hooks and call the module instead
# (with h recomputed for its backward, so nothing more is saved).
CASES = [(m, w) for m in MODELS for w in MODES] + [("llama", "fsdp2_linear")]
WORLD = 2
STEPS = 3
GLOBAL_BATCH = 4
SEQ = 16
LR = 0.5  # large enough that three steps move every parameter well beyond the comparison tolerance
RTOL, ATOL = 2e-5, 2e-6
WORKER_TIMEOUT_S = 240


# ------------------------------------------------------------------------------------------ shared by all runs
def build(name: str) -> torch.nn.Module:
    """The tiny model, converted with defaults (no dropout anywhere: LLaMA has none, timm's ViT defaults to 0)."""
    from testsupport import families
    from lmbp_convert import convert

    model = families.FAMILIES[name]()
    convert(model)
    return model.train()


def global_batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch, the same in every process (its own generator, independent of model init)."""
    gen = torch.Generator().manual_seed(1000 + step)
    if name == "llama":
        ids = torch.randint(0, 128, (GLOBAL_BATCH, SEQ), generator=gen)
        return ids, ids
    return torch.randn(GLOBAL_BATCH, 3, 32, 32, generator=gen), torch.randint(0, 10, (GLOBAL_BATCH,), generator=gen)


def loss_of(model: torch.nn.Module, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "llama":
        return model(input_ids=x, labels=y).loss  # mean over the (equally many) shifted tokens of each row
    return F.cross_entropy(model(x), y)


def _ledger(model: torch.nn.Module):
    """The exact saved-bytes ledger; it handles FSDP2's DTensor shards and the weights it gathers itself."""
    from lmbp_convert import SavedTensorLedger

    return SavedTensorLedger(model)


def train(model: torch.nn.Module, name: str, rank: int = 0, world: int = 1) -> tuple[list[float], int]:
    """SGD on this rank's share of each global batch; returns the losses and the bytes the first step's forward
    saved for backward (exact, `SavedTensorLedger`)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    per_rank = GLOBAL_BATCH // world
    losses, saved = [], 0
    for step in range(STEPS):
        x, y = global_batch(name, step)
        sl = slice(rank * per_rank, (rank + 1) * per_rank)
        with _ledger(model) as ledger:
            loss = loss_of(model, name, x[sl], y[sl])
        saved = saved or ledger.bytes
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, saved


def saved_bytes_local(model: torch.nn.Module, name: str) -> int:
    """Saved-for-backward bytes of one unwrapped forward on one rank's share of the first batch."""
    x, y = global_batch(name, 0)
    n = GLOBAL_BATCH // WORLD
    with _ledger(model) as ledger:
        loss_of(model, name, x[:n], y[:n])
    return ledger.bytes


def n_converted(model: torch.nn.Module) -> int:
    from lmbp_convert.enums import ConvertedModule

    return sum(isinstance(m, ConvertedModule) for m in model.modules())


# ------------------------------------------------------------------------------------------ worker (a script)
def _shard_fsdp2(model: torch.nn.Module, name: str, per_linear: bool = False) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    if per_linear:
        for mod in list(model.modules()):
            if isinstance(mod, torch.nn.Linear):
                fully_shard(mod, mesh=mesh)
    blocks = model.model.layers if name == "llama" else model.blocks
    for block in blocks:  # the usual granularity: one FSDP unit per transformer block, then the root
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters and buffers (FSDP2 parameters are DTensors: all-gathered here)."""
    out = {}
    for key, t in list(model.named_parameters()) + list(model.named_buffers()):
        t = t.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[key.removeprefix("module.")] = t.clone()
    return out


def _local_numel(model: torch.nn.Module) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())


def worker(outdir: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)  # two processes share the machine's cores
    rank = int(os.environ["RANK"])
    # a short collective timeout: a case that fails on one rank only must not leave the other waiting for 30 min
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=60))
    for name, mode in CASES:
        path = os.path.join(outdir, f"{name}_{mode}_rank{rank}.pt")
        try:
            model = build(name)  # convert BEFORE wrapping
            full_numel = sum(p.numel() for p in model.parameters())
            if mode == "ddp":
                model = DDP(model)
            else:
                _shard_fsdp2(model, name, per_linear=mode == "fsdp2_linear")
            losses, saved = train(model, name, rank, WORLD)
            result = {"state": _full_state(model), "losses": losses, "saved": saved, "converted": n_converted(model),
                      "local_numel": _local_numel(model), "full_numel": full_numel}
        except Exception:
            result = {"error": traceback.format_exc()}
        torch.save(result, path)
        dist.barrier()  # keep the ranks in step even when one case failed on one rank only
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ the tests
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Launch the two workers once for all cases; return {(model, mode, rank): result}."""
    outdir = str(tmp_path_factory.mktemp("dist"))
    path = os.pathsep.join(filter(None, [TESTS, ROOT, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(WORLD),
               OMP_NUM_THREADS="1", PYTHONPATH=path)
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", outdir], cwd=ROOT,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    logs: list[str] = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=WORKER_TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs[len(logs):]:
            p.kill()
            logs.append(p.communicate()[0])
        pytest.fail(f"workers still running after {WORKER_TIMEOUT_S} s:\n" + "\n".join(
            f"--- rank {r}:\n{log[-3000:]}" for r, log in enumerate(logs)))
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{log[-4000:]}"
    return {(m, w, r): torch.load(os.path.join(outdir, f"{m}_{w}_rank{r}.pt"), weights_only=False)
            for m, w in CASES for r in range(WORLD)}


@pytest.fixture(scope="module")
def reference():
    """Single process, same converted model, whole global batch each step."""
    from testsupport import families

    out = {}
    for name in MODELS:
        saved_original = saved_bytes_local(families.FAMILIES[name](), name)
        model = build(name)
        saved_converted = saved_bytes_local(model, name)
        init = {k: v.detach().clone() for k, v in model.state_dict().items()}
        losses, _ = train(model, name)
        out[name] = {"init": init, "losses": losses, "converted": n_converted(model),
                     "saved_original": saved_original, "saved_converted": saved_converted,
                     "trainable": [k for k, p in model.named_parameters() if p.requires_grad],
                     "state": {k: v.detach().clone() for k, v in
                               list(model.named_parameters()) + list(model.named_buffers())}}
    return out


@pytest.mark.parametrize("name,mode", CASES)
def test_distributed_matches_single_process(runs, reference, name, mode):
    res = [runs[(name, mode, r)] for r in range(WORLD)]
    for r, x in enumerate(res):
        assert "error" not in x, f"rank {r}:\n{x['error']}"
    ref = reference[name]
    assert ref["converted"] > 0
    assert all(x["converted"] == ref["converted"] for x in res), "wrapping lost converted modules"

    # identical across ranks, bit for bit (the same averaged gradients and the same SGD update everywhere)
    a, b = res[0]["state"], res[1]["state"]
    assert a.keys() == b.keys() == ref["state"].keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs between ranks"

    if mode.startswith("fsdp2"):  # really sharded: each rank holds about half of the parameters
        assert all(x["local_numel"] <= 0.6 * x["full_numel"] for x in res)

    # the same trajectory as one process on the combined batch
    for key, want in ref["state"].items():
        torch.testing.assert_close(a[key], want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")
    mean_rank_loss = [sum(x["losses"][s] for x in res) / WORLD for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(mean_rank_loss), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)

    # the wrapped model keeps the converted model's activation savings: it saves exactly what the unwrapped
    # converted model saves, also with per-Linear units, where the gated MLP calls the hooked down_proj (h is
    # recomputed for its backward; it used to keep h, one more T×f tensor)
    saved = [x["saved"] for x in res]
    assert saved[0] == saved[1]
    assert ref["saved_converted"] < ref["saved_original"]
    assert saved[0] == ref["saved_converted"], (saved[0], ref["saved_converted"], ref["saved_original"])

    # ...and that trajectory is not the starting point: every trained parameter moved far beyond the tolerance
    assert ref["trainable"]
    for key in ref["trainable"]:
        moved = (ref["state"][key] - ref["init"][key]).abs().max().item()
        assert moved > 10 * ATOL, f"{key} moved only {moved:.2e}: the comparison above would not see an error"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        sys.exit("usage: test_distributed.py --worker OUTDIR (pytest runs this file as a test)")
