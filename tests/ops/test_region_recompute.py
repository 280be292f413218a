"""`Region`: inside one call, what autograd saves of act(g), of act(g)·u, of rows gathered from the input and of an
autocast cast of one expert's weight slice is recomputed in backward — bitwise, with fewer bytes kept."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmbp_convert import SavedTensorLedger
from lmbp_convert.ops.region_recompute import Region


class _Experts(nn.Module):
    """Per-expert loop over a [E, 2I, H] gate_up and an [E, H, I] down parameter (the transformers 5 eager path)."""

    def __init__(self, h=8, i=12, e=3):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate_up = nn.Parameter(torch.randn(e, 2 * i, h, generator=g) / h ** 0.5)
        self.down = nn.Parameter(torch.randn(e, h, i, generator=g) / i ** 0.5)
        self.act = nn.SiLU()

    def forward(self, y, region=None):
        chosen = torch.arange(y.shape[0]) % self.gate_up.shape[0]
        out = torch.zeros_like(y)
        for e in range(self.gate_up.shape[0]):
            rows = torch.where(chosen == e)[0]
            gate, up = F.linear(y[rows], self.gate_up[e]).chunk(2, dim=-1)
            a = self.act(gate)
            if region is not None:
                region.note_act(self.act.forward, gate, a)
            out = out.index_add(0, rows, F.linear(a * up, self.down[e]).to(out.dtype))
        return out


def _run(model, y, use_region, autocast):
    y = y.clone().requires_grad_(True)
    x = y * 1.0  # the block's input has a node of its own (it comes from earlier layers)
    region = Region()
    with SavedTensorLedger(model) as ledger, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if use_region:
            assert region.enter(x)
        try:
            out = model(x, region if use_region else None)
        finally:
            region.exit()
    out.float().pow(2).sum().backward()
    grads = [y.grad, model.gate_up.grad, model.down.grad]
    model.zero_grad(set_to_none=True)
    return ledger.bytes, grads, region.recomputed


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
def test_region_keeps_fewer_bytes_and_gradients_are_bitwise_the_same(autocast):
    model = _Experts()
    y = torch.randn(10, 8, generator=torch.Generator().manual_seed(1))
    before, g0, _ = _run(model, y, False, autocast)
    after, g1, made = _run(model, y, True, autocast)
    assert made >= 3 * 3  # per expert: the activation, the product, the gathered rows (+ the cast weights)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert after < before
    if autocast:  # the bf16 copies of each expert's weight slices are not kept either
        assert after < 0.5 * before, (before, after)


def test_region_stays_closed_without_grad_and_when_hooks_are_disabled():
    region = Region()
    with torch.no_grad():
        assert not region.enter(torch.randn(2, 3))
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
        assert not region.enter(torch.randn(2, 3, requires_grad=True) * 1.0)
    assert not region.active
