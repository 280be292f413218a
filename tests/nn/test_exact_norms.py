"""MSExactNorm: the original norm's output and gradients with its own γ, β, and the bytes of a fold when a Linear
keeps its output inside a shared-saves region."""
import copy

import pytest
import torch
from torch import nn

from lmbp_convert import SavedTensorLedger
from lmbp_convert.enums import NormType, WeightParam
from lmbp_convert.nn.exact_norms import MSExactNorm
from testsupport.regions import open_region


def _pair(kind, dtype, bias):
    torch.manual_seed(0)
    d = 48
    ref = nn.LayerNorm(d, eps=1e-5, bias=bias) if kind is NormType.LAYER else nn.RMSNorm(d, eps=1e-6)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        if getattr(ref, "bias", None) is not None:
            ref.bias.normal_()
    ref = ref.to(dtype)
    new = MSExactNorm(kind, (d,), ref.eps, nn.Parameter(ref.weight.detach().clone()),
                      nn.Parameter(ref.bias.detach().clone()) if getattr(ref, "bias", None) is not None else None)
    return ref, new


@pytest.mark.parametrize("kind,bias", [(NormType.LAYER, True), (NormType.LAYER, False), (NormType.RMS, False)])
def test_output_and_every_gradient_match_the_original_fp32(kind, bias):
    ref, new = _pair(kind, torch.float32, bias)
    lin = nn.Linear(48, 32)
    x = torch.randn(3, 11, 48, requires_grad=True)
    outs = []
    for norm in (ref, new):
        x.grad = None
        norm.zero_grad()
        lin.zero_grad()
        y = norm(x)
        lin(y).pow(2).sum().backward()
        outs.append((y.detach(), x.grad.clone(), norm.weight.grad.clone(), lin.weight.grad.clone(),
                     None if getattr(norm, "bias", None) is None else norm.bias.grad.clone()))
    for a, b in zip(*outs):
        if a is not None:
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert set(dict(ref.named_parameters())) == set(dict(new.named_parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keeps_the_bytes_of_a_fold_inside_a_region(dtype):
    ref, new = _pair(NormType.LAYER, dtype, True)
    lins = [nn.Linear(48, 48).to(dtype) for _ in range(3)]
    x = torch.randn(4, 16, 48, dtype=dtype, requires_grad=True)

    def saved(norm, region):
        with SavedTensorLedger([p for m in [norm, *lins] for p in m.parameters()]) as led:
            with open_region(region):
                y = norm(x * 1)
                out = sum(lin(y).sum() for lin in lins)
        out.backward()
        return led.bytes

    rows, size = 4 * 16, torch.empty((), dtype=dtype).element_size()
    x_bytes = rows * 48 * size
    # exact: x̂ and rstd only (the Linears' copies of y are rebuilt)
    assert saved(new, True) == x_bytes + rows * 4
    # nn.LayerNorm keeps its input (and mean, rstd); the Linears keep its output
    assert saved(ref, False) - saved(new, True) >= x_bytes
    # where no note can take (no region; activation checkpointing), a LayerNorm saves what nn.LayerNorm saves: its
    # input, mean and rstd, and the Linears keep y
    # (mean, rstd per row: ATen's CPU kernel keeps them in the input's dtype for bf16)
    stats = rows * 2 * (4 if dtype == torch.float32 else size)
    assert saved(new, False) == saved(ref, False) == 2 * x_bytes + stats


def test_one_plus_w_parameterisation():
    torch.manual_seed(2)
    w = nn.Parameter(torch.randn(16) * 0.1)
    norm = MSExactNorm(NormType.RMS, (16,), 1e-6, w, None, WeightParam.ONE_PLUS_W)
    x = torch.randn(5, 16)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    assert torch.allclose(norm(x), ref, atol=1e-6)


@pytest.mark.parametrize("bias", (True, False))
def test_inside_checkpointing_a_layer_norm_saves_its_input(bias):
    """Inside activation checkpointing no note takes: the LayerNorm saves what nn.LayerNorm saves (its input,
    kept there anyway), not an x̂ beside the Linear's copy of y; gradients stay the original's."""
    from torch.utils.checkpoint import checkpoint

    ref, new = _pair(NormType.LAYER, torch.float32, bias)
    lin = nn.Linear(48, 32)
    x0 = torch.randn(3, 11, 48)

    def packed(norm):
        seen = []
        with open_region():  # other hooks innermost, as checkpointing's are
            with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
                x = x0.clone().requires_grad_()
                lin(norm(x)).sum()
        return x, seen

    x, seen = packed(new)
    assert any(t.data_ptr() == x.data_ptr() for t in seen)  # its input itself
    assert sum(t.nbytes for t in seen) == sum(t.nbytes for t in packed(ref)[1])

    grads = []
    for norm in (ref, new):
        x = x0.clone().requires_grad_()
        with open_region():
            out = checkpoint(lambda t: lin(norm(t)), x, use_reentrant=False).pow(2).sum()
        out.backward()
        grads.append((x.grad, norm.weight.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channel_first_norm_is_the_original_and_shares_with_a_conv(dtype):
    """Over dim 1 of NCHW (timm LayerNorm2d): the original's output and gradients with its own γ, β, and inside a
    region a 1×1 conv's saved input (a channel-first view of the channels-last output) is rebuilt: x̂ and rstd
    are all the pair keeps."""
    from timm.layers import LayerNorm2d

    torch.manual_seed(0)
    ref = LayerNorm2d(16)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.normal_()
    ref = ref.to(dtype)
    new = MSExactNorm(NormType.LAYER, (16,), ref.eps, nn.Parameter(ref.weight.detach().clone()),
                      nn.Parameter(ref.bias.detach().clone()), channel_dim=1)
    conv = nn.Conv2d(16, 8, 1).to(dtype)
    x0 = torch.randn(2, 16, 5, 5, dtype=dtype)

    def run(norm, region):
        x = x0.clone().requires_grad_()
        for p in [*norm.parameters(), *conv.parameters()]:
            p.grad = None
        with SavedTensorLedger([*norm.parameters(), *conv.parameters()]) as led:
            with open_region(region):
                y = norm(x * 1)
                out = conv(y).float().sum()
        out.backward()
        return led.bytes, y.detach(), x.grad, norm.weight.grad, norm.bias.grad, conv.weight.grad

    want, got = run(ref, False), run(new, True)
    if dtype == torch.float32:
        for a, b in zip(want[1:], got[1:]):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    else:  # bf16: no farther from the fp32 result than the original's own bf16 run (its rounding), or bf16's eps
        ref32, conv32, x32 = copy.deepcopy(ref).float(), copy.deepcopy(conv).float(), x0.float().requires_grad_()
        for p in [*ref32.parameters(), *conv32.parameters()]:
            p.grad = None  # (deepcopy copies the last run's gradients)
        y32 = ref32(x32)
        conv32(y32).sum().backward()
        exact = (y32.detach(), x32.grad, ref32.weight.grad, ref32.bias.grad, conv32.weight.grad)

        def err(t, e):
            return float((t.float() - e).norm() / e.norm())

        for w, g, e in zip(want[1:], got[1:], exact):
            assert err(g, e) <= max(2 * err(w, e), 2 ** -7), (err(g, e), err(w, e))
    size = torch.empty((), dtype=dtype).element_size()
    rows = 2 * 5 * 5
    assert got[0] == rows * 16 * size + rows * 4  # x̂ and rstd: the fold's bytes
    assert want[0] - got[0] >= rows * 16 * size  # LayerNorm2d keeps its input beside the conv's copy of y


@pytest.mark.parametrize("autocast", (False, True))
def test_trailing_dims_norm_rebuilds_y_for_a_reshaping_consumer(autocast):
    """normalized_shape over two dims: the consumer reads a reshape of y (a cast one under autocast); the pair
    keeps x̂ and rstd only, and every gradient is nn.LayerNorm's."""
    torch.manual_seed(4)
    ref = nn.LayerNorm((6, 8), eps=1e-5)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.normal_()
    new = MSExactNorm(NormType.LAYER, (6, 8), 1e-5, nn.Parameter(ref.weight.detach().clone()),
                      nn.Parameter(ref.bias.detach().clone()))
    lin = nn.Linear(48, 5)
    x0 = torch.randn(3, 7, 6, 8)
    results = []
    for norm in (ref, new):
        x = x0.clone().requires_grad_()
        with SavedTensorLedger([*norm.parameters(), *lin.parameters()]) as led, \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with open_region():
                out = lin(norm(x * 1).reshape(3, 7, 48))
        grads = torch.autograd.grad(out.float().square().sum(), [x, norm.weight, norm.bias, lin.weight])
        results.append((out.detach().float(), grads, led.bytes))
    (o_ref, g_ref, _), (o_new, g_new, b_new) = results
    xhat_bytes = 3 * 7 * 48 * (2 if autocast else 4)
    assert b_new == xhat_bytes + 3 * 7 * 4  # x̂ and rstd: the Linear's copy of y is rebuilt
    if autocast:  # bf16 x̂ (the dtype the Linear computes in) rounds y: relative to each tensor's norm
        for a, b in zip((o_new, *g_new), (o_ref, *g_ref)):
            assert (a.float() - b.float()).norm() / b.float().norm() < 2e-2
    else:
        for a, b in zip((o_new, *g_new), (o_ref, *g_ref)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # torch.compile of a small block
def test_compiled_under_autocast_linear_readers_share_x_hat():
    """Under torch.compile no shared-saves hook runs: a Linear's autocast cast of y is a node its backward reads,
    which the partitioner saves beside x̂. With ``autocast_readers`` (every reader a Linear reading y as it is) the
    norm emits y in the autocast dtype, the values those casts make: the compiled block keeps x̂ (bf16) and rstd
    only, and its outputs and input gradient are bitwise those of the block without the flag."""
    torch.manual_seed(0)
    norm = nn.LayerNorm(64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_(0, 0.2)
    lins = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
    x0 = torch.randn(4, 16, 64)

    def run(flag: bool):
        new = MSExactNorm(NormType.LAYER, (64,), norm.eps, nn.Parameter(norm.weight.detach().clone()),
                          nn.Parameter(norm.bias.detach().clone()), WeightParam.W, autocast_readers=flag)
        mods = nn.ModuleList([new, copy.deepcopy(lins)])

        def block(x):
            y = mods[0](x)
            return sum(lin(y).float().square().sum() for lin in mods[1])

        torch._dynamo.reset()
        fn = torch.compile(block)
        x = x0.clone().requires_grad_(True)
        with torch.autocast("cpu", torch.bfloat16):
            fn(x)  # compile outside the ledger
        with SavedTensorLedger(list(mods.parameters())) as led:
            with torch.autocast("cpu", torch.bfloat16):
                out = fn(x)
        out.backward()
        return led.bytes, out.detach(), x.grad.clone()

    (on_bytes, on_out, on_dx), (off_bytes, off_out, off_dx) = run(True), run(False)
    rows = 4 * 16
    # x̂ in bf16 and the fp32 rstd per row; the square keeps each Linear's bf16 output
    assert on_bytes == rows * 64 * 2 + rows * 4 + 2 * rows * 64 * 2
    assert off_bytes == on_bytes + rows * 64 * 2  # without the flag: one more bf16 copy of y
    assert torch.equal(on_out, off_out) and torch.equal(on_dx, off_dx)
