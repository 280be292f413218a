"""MSAffineNorm's guard in training: after the first forward, a step (forward, backward, optimizer update of γ and β)
reads nothing back from the device — no ``nonzero``, no ``.item()`` — while the kept columns, the saved bytes and
the gradients stay those of a guard read at every update; a count that reaches the host late redoes the index set
on the next forward."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lmbp_convert.memory import SavedTensorLedger
from lmbp_convert.enums import WeightParam
from lmbp_convert.nn.affine_norms import HostCount, MSAffineNorm

D = 64
#: ops whose result the host must read (a device sync on a GPU) or whose output size depends on data
_SYNCING = {"nonzero", "_local_scalar_dense", "equal", "is_nonzero", "masked_select", "unique", "_unique2",
            "unique_consecutive", "item", "repeat_interleave"}


class SyncOps(TorchDispatchMode):
    """Records every dispatched op that reads a device value on the host."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _SYNCING:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def _norm(kind="layer"):
    gen = torch.Generator().manual_seed(0)
    w = nn.Parameter(1 + 0.3 * torch.randn(D, generator=gen))
    b = nn.Parameter(0.1 * torch.randn(D, generator=gen))
    with torch.no_grad():
        w[3], w[10] = 0.0, 1e-5  # two channels the guard keeps
    return MSAffineNorm(kind, D, 1e-5, w, b)


def _step(norm, opt, x, g):
    opt.zero_grad()
    with SavedTensorLedger(norm) as led:
        y = norm(x)
    kept = norm.kept_channels(x.device)  # what this forward used (cached: no recompute)
    y.backward(g)
    grads = (norm.weight.grad.clone(), norm.bias.grad.clone())
    opt.step()
    return y.detach(), grads, led.bytes, kept


def test_training_steps_read_nothing_back_and_match_a_guard_read_at_every_update():
    fast = _norm()
    exact = copy.deepcopy(fast)
    exact.deferred_guard = False  # reads the count at every update: the reference
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (fast, exact)]
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        x, g = torch.randn(8, D, generator=gen), torch.randn(8, D, generator=gen)
        with SyncOps() as mode:
            got = _step(fast, opts[0], x, g)
        if step:  # the first forward reads the count once
            assert mode.seen == [], mode.seen
        want = _step(exact, opts[1], x, g)
        assert torch.equal(got[0], want[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
        assert got[2] == want[2]  # the same columns kept: y, rstd, mean and the two guarded columns
        assert torch.equal(got[3], want[3]) and got[3].tolist() == [3, 10]


class _Late(HostCount):
    """A copy that has not arrived until the test says so (a GPU still busy with earlier work)."""

    arrived = False

    def ready(self) -> bool:
        return self.arrived and super().ready()


def test_a_count_that_arrives_late_redoes_the_index_set_on_the_next_forward():
    norm = _norm()
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(2), requires_grad=True)
    norm(x)  # the first forward: the count read once
    norm._count = late = _Late(x.device)
    with torch.no_grad():
        norm.weight[20] = 0.0  # a third channel the guard must keep
    y = norm(x)  # the count is on its way: the index set still holds two channels, channel 20 gives x̂ = 0
    assert norm.kept_channels(x.device).tolist() == [3, 10]
    grads = torch.autograd.grad(y, (x, norm.weight), torch.ones_like(y))
    assert all(torch.isfinite(t).all() for t in grads)
    late.arrived = True
    assert norm.kept_channels(x.device).tolist() == [3, 10, 20]  # arrived: redone without another update
    ref = nn.LayerNorm(D)
    with torch.no_grad():
        ref.weight.copy_(norm.weight)
        ref.bias.copy_(norm.bias)
    y, yr = norm(x), ref(x)
    g = torch.randn(8, D, generator=torch.Generator().manual_seed(3))
    for a, b in zip(torch.autograd.grad(y, (x, norm.weight, norm.bias), g),
                    torch.autograd.grad(yr, (x, ref.weight, ref.bias), g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_training_steps_do_not_synchronize(dtype):
    """On a GPU (the Triton path where rows fit): CUDA's own sync detector raises on any synchronizing call (a
    ``nonzero``, an ``.item()``, a blocking copy) in the steps after the first; the count still arrives and the
    result is that of a guard read at every update."""
    fast = _norm().cuda()
    exact = copy.deepcopy(fast)
    exact.deferred_guard = False
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (fast, exact)]
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(64, D, generator=gen).to("cuda", dtype)
        g = torch.randn(64, D, generator=gen).to("cuda", dtype)
        torch.cuda.set_sync_debug_mode("error" if step else "default")
        try:
            got = _step(fast, opts[0], x, g)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = _step(exact, opts[1], x, g)
        assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
        assert got[3].tolist() == [3, 10]


# ------------------------------------------------------------------------------ weights written through ``.data``
def test_data_writes_move_the_guard_without_a_sync():
    """``p.data.copy_(t)`` and ``p.data = t`` bump no version counter of ``p`` and may keep its data pointer: the
    guard must follow them anyway, still reading nothing back from the device after the first forward."""
    fast = _norm()
    exact = copy.deepcopy(fast)
    exact.deferred_guard = False
    x, g = torch.randn(8, D, generator=torch.Generator().manual_seed(4)), torch.randn(8, D)
    for m in (fast, exact):
        m(x)
    for write in ("copy", "assign"):
        for m in (fast, exact):
            w = m.weight.detach().clone()
            w[20 if write == "copy" else 30] = 0.0  # a third, then a fourth channel the guard must keep
            if write == "copy":
                m.weight.data.copy_(w)
            else:
                m.weight.data = w
        for step in range(2):  # the count reaches the host one forward late; the second forward is the reference's
            with SyncOps() as mode:
                got = _step(fast, torch.optim.SGD(fast.parameters(), lr=0.0), x, g)
            assert mode.seen == [], mode.seen
            want = _step(exact, torch.optim.SGD(exact.parameters(), lr=0.0), x, g)
            if step:
                assert torch.equal(got[3], want[3]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
        assert want[3].tolist() == ([3, 10, 20] if write == "copy" else [3, 10, 20, 30])


def _kept_norms(model: nn.Module) -> dict[str, MSAffineNorm]:
    return {n: m for n, m in model.named_modules() if isinstance(m, MSAffineNorm)}


def _write_through_data(models: tuple[nn.Module, ...], name: str, w: torch.Tensor, how: str) -> None:
    """Set the raw weight of norm ``name`` in every model the way master-weight copy-back or EMA writes it."""
    for m in models:
        p = m.get_submodule(name).weight
        if how == "copy":
            p.data.copy_(w)
        else:
            p.data = w.clone()


#: every family of testsupport.families where fold_norms=True leaves a kept-affine norm (measured by converting the
#: whole registry; the test asserts one is there)
KEPT_AFFINE_FAMILIES = ["bart", "bart_classifier", "bert2bert", "bloom", "distilbert", "falcon", "gemma", "gemma2",
                        "gemma3", "gpt2", "hubert", "marian", "mbart", "modernbert", "opt", "pegasus",
                        "speech_to_text", "starcoder2", "vit_gpt2", "wav2vec2", "wavlm", "whisper"]


@pytest.mark.parametrize("family", KEPT_AFFINE_FAMILIES)
def test_kept_affine_gradients_follow_data_writes(family):
    """After γ is written through ``.data`` (a channel zeroed: copy_ grows the guarded set, assignment moves it),
    the converted model's gradients of every kept γ, β are the original's with the same write — from the first
    forward when the set's size is unchanged, from the second when it grew (the count reaches the host one forward
    late, by design). A guard keyed on version counters and data pointers kept its old set for good."""
    from testsupport.families import registry
    from lmbp_convert import convert
    from lmbp_convert.apply.verify import float_tensors
    from lmbp_convert.trace.probe import make_probe
    from lmbp_convert.trace.tracer import call_model

    ref = registry()[family]().eval()
    model = copy.deepcopy(ref)
    probe = make_probe(ref)[0]
    convert(model, fold_norms=True, activations=False, measure=False)
    kept = _kept_norms(model)
    assert kept, family
    names = [f"{n}.{p}" for n, m in kept.items() for p in ("weight", "bias") if getattr(m, p) is not None]

    def grads(m: nn.Module) -> dict[str, torch.Tensor]:
        m.zero_grad()
        sum(t.double().pow(2).mean() for t in float_tensors(call_model(m, probe))).backward()
        params = dict(m.named_parameters())
        return {n: params[n].grad.double().clone() for n in names}

    def check(got: dict, want: dict) -> None:
        for n in names:
            err = float((got[n] - want[n]).norm())
            assert err <= 1e-4 * float(want[n].norm()) + 1e-9, (family, n, err, float(want[n].norm()))

    grads(model)  # the first forward: the count read once
    zeroed = {}
    for name, norm in kept.items():  # zero the first channel the guard does not keep yet (γ = 0: w = 0, or −1)
        keep = set(norm.kept_channels(norm.weight.device).tolist())
        free = [j for j in range(norm.normalized_shape[0]) if j not in keep]
        w = norm.weight.detach().clone()
        w[free[0]] = -1.0 if norm.param is WeightParam.ONE_PLUS_W else 0.0
        _write_through_data((ref, model), name, w, "copy")
        zeroed[name] = (free[0], free[1])
    grads(model)  # the count is on its way
    check(grads(model), grads(ref))
    for name, norm in kept.items():  # the zero moves to another channel: same count, so the first forward is exact
        (a, b), w = zeroed[name], norm.weight.detach().clone()
        w[[a, b]] = w[[b, a]]
        _write_through_data((ref, model), name, w, "assign")
    check(grads(model), grads(ref))
