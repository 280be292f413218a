"""The exact norm in full precision (ops/replay_norm.py): the replaced module's own ops, its input kept, its other
saves recomputed. Gradients are bitwise the original module's (torch.equal, not a tolerance), for the norm
implementations models use; the ledger sees x kept and nothing else of the norm's; misuse raises as autograd does."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from lmbp_convert import SavedTensorLedger, convert
from lmbp_convert.nn.exact_norms import MSExactNorm
from lmbp_convert.ops.replay_norm import OriginalForward, replay_norm
from testsupport.regions import open_region

D, ROWS = 24, 10


def _hf_norm(module: str, cls: str):
    mod = pytest.importorskip(f"transformers.models.{module}.modeling_{module}")
    return getattr(mod, cls)


def _norms():
    """name → a norm with random γ (and β): the implementations a graph walker meets."""
    def ln(bias=True):
        return nn.LayerNorm(D, bias=bias)
    made = {"layer_norm": ln(), "layer_norm_no_bias": ln(False), "rms_norm": nn.RMSNorm(D, eps=1e-6),
            "llama": _hf_norm("llama", "LlamaRMSNorm")(D), "gemma_one_plus_w": _hf_norm("gemma", "GemmaRMSNorm")(D),
            "t5": _hf_norm("t5", "T5LayerNorm")(D)}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in made.values():
            for p in m.parameters():
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5 if p.dim() else p)
    return made


NORMS = sorted(_norms())


def _block(norm: nn.Module, fn, x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    """x read three times (a scale, the norm, the residual): the order in which x's gradient is summed counts."""
    h = x * 1.5
    return (lin(fn(h)) + h).pow(2).sum()


def _run(norm: nn.Module, dtype: torch.dtype, replay: bool):
    torch.manual_seed(1)
    norm = copy.deepcopy(norm).to(dtype)
    lin = nn.Linear(D, D).to(dtype)
    x = torch.randn(2, ROWS // 2, D, dtype=dtype, requires_grad=True)
    w, b = norm.weight, getattr(norm, "bias", None)
    if replay:
        fn = OriginalForward.of(norm, w, b)
        assert fn is not None
        with SavedTensorLedger([*lin.parameters(), *norm.parameters()]) as led, open_region():
            loss = _block(norm, lambda h: replay_norm(fn, h, w, b), x, lin)
    else:
        with SavedTensorLedger([*lin.parameters(), *norm.parameters()]) as led:
            loss = _block(norm, norm, x, lin)
    loss.backward()
    grads = [x.grad, *(p.grad for p in (*norm.parameters(), *lin.parameters()))]
    return loss.detach(), grads, led.bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", NORMS)
def test_gradients_are_bitwise_the_original_modules(name, dtype):
    norm = _norms()[name]
    ref_loss, ref, _ = _run(norm, dtype, replay=False)
    loss, got, nbytes = _run(norm, dtype, replay=True)
    assert torch.equal(loss, ref_loss)
    assert len(got) == len(ref) and all(torch.equal(g, r) for g, r in zip(got, ref)), name
    # kept: the norm's input h, and what the rest of the block keeps (pow's input); the Linear's copy of the norm's
    # output is rebuilt from h, and none of the norm's own saves (rstd, x̂, x·rsqrt, ...) is kept
    assert nbytes == 2 * ROWS * D * dtype.itemsize, name


def _counting_norm():
    class Flaky(nn.Module):
        """A forward that saves one more tensor on its second call: not replayable."""

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(D))
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            if self.calls > 1:
                y = y.sin()
            return y * self.weight
    return Flaky()


def test_a_forward_that_saves_differently_on_replay_raises():
    norm = _counting_norm()
    fn = OriginalForward.of(norm, norm.weight, None)
    x = torch.randn(ROWS, D, requires_grad=True)
    with open_region():
        y = replay_norm(fn, x * 1, norm.weight, None)
    with pytest.raises(RuntimeError, match="is not deterministic"):
        y.sum().backward()


def test_modifying_the_input_in_place_before_backward_raises():
    norm = _norms()["llama"]
    fn = OriginalForward.of(norm, norm.weight, None)
    x = torch.randn(ROWS, D, requires_grad=True)
    with open_region():
        h = x * 1
        y = replay_norm(fn, h, norm.weight, None)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_a_module_with_state_a_shell_would_not_see_is_not_replayed():
    class WithBuffer(nn.LayerNorm):
        def __init__(self):
            super().__init__(D)
            self.register_buffer("scale", torch.ones(()))

    class WithChild(nn.LayerNorm):
        def __init__(self):
            super().__init__(D)
            self.inner = nn.Identity()

    for m in (WithBuffer(), WithChild()):
        assert OriginalForward.of(m, m.weight, m.bias) is None
    ln = nn.LayerNorm(D)
    assert OriginalForward.of(ln, nn.Parameter(ln.weight.detach().clone()), ln.bias) is None  # not its γ
    assert OriginalForward.of(ln, ln.weight, ln.bias) is not None


class _Net(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(D, D), norm, nn.Linear(D, D)

    def forward(self, x):
        h = self.inp(x)
        return self.out(self.norm(h)) + h


def _grads(model: nn.Module, x: torch.Tensor):
    model.zero_grad(set_to_none=True)
    model(x).pow(2).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["layer_norm", "llama"])
def test_converted_model_copies_moves_and_pickles_with_bitwise_gradients(name):
    torch.manual_seed(0)
    ref = _Net(_norms()[name])
    x = torch.randn(2, 5, D)
    model = copy.deepcopy(ref)
    convert(model, probe=x, activations=False)
    assert isinstance(model.norm, MSExactNorm) and "replays original" in repr(model.norm)
    assert list(model.state_dict()) == list(ref.state_dict())
    want = _grads(ref, x)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for m in (model, copy.deepcopy(model), torch.load(buf, weights_only=False)):
        got = _grads(m, x)
        assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    wide, ref64 = copy.deepcopy(model).double(), copy.deepcopy(ref).double()  # the shell reads γ per call
    with torch.no_grad():
        ref64.norm.weight.mul_(1.25)
        wide.norm.weight.mul_(1.25)
    want, got = _grads(ref64, x.double()), _grads(wide, x.double())
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_autocast_keeps_the_smaller_normalised_output():
    """Under autocast x is fp32 where x̂ is bf16: the x̂ path (not the replay) runs, with its one fused node."""
    torch.manual_seed(0)
    model = _Net(_norms()["layer_norm"])
    x = torch.randn(2, 5, D)
    convert(model, probe=x, activations=False)
    names = []
    model.norm.register_forward_hook(lambda m, i, o: names.append(type(o.grad_fn).__name__))
    model(x).sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().sum().backward()
    assert names[0] == "NativeLayerNormBackward0" and names[1] != names[0], names


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_affine_free_norm_swap_replays_too(dtype):
    """A norm with no affine at all becomes a memory-sharing norm (nothing to fold); in full precision it replays
    the replaced module as the exact norm does: bitwise gradients, the same state dict (none)."""
    from lmbp_convert.nn.norms import MSLayerNorm

    torch.manual_seed(0)
    ref = _Net(nn.LayerNorm(D, elementwise_affine=False)).to(dtype)
    x = torch.randn(2, 5, D, dtype=dtype)
    model = copy.deepcopy(ref)
    convert(model, probe=x, activations=False)
    assert isinstance(model.norm, MSLayerNorm) and "replays original" in repr(model.norm)
    assert list(model.state_dict()) == list(ref.state_dict())
    want, got = _grads(ref, x), _grads(model, x)
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_no_replay_where_the_input_views_a_larger_tensor_or_precision_is_low():
    """Keeping a pooled token ``h[:, 0]`` would keep all of h (x̂ is the token's size); bf16 and autocast keep the
    memory-sharing path; no region, no replay (nothing would rebuild the consumers' copies)."""
    from lmbp_convert.ops.replay_norm import replays

    w = nn.Parameter(torch.ones(D))
    h = torch.randn(4, 6, D, requires_grad=True) * 1
    assert not replays(h, w)
    with open_region():
        assert replays(h, w) and replays(h[:, 0].contiguous(), w)
        assert not replays(h[:, 0], w) and not replays(h.bfloat16(), w.bfloat16()) and not replays(h, w.double())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not replays(h, w)
        with torch.no_grad():
            assert not replays(h, w)
