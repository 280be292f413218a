"""Converted models whose shared tensors reach their readers through views and multi-output nodes: the gradients are
the unconverted model's (bitwise in fp32; LoRA inputs bitwise in bf16 too, being the same ops on the same values)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmbp_convert import convert
from testsupport.families import hf

SPLITS = {
    "chunk": lambda h: h.chunk(2, -1),
    "split": lambda h: h.split(16, -1),
    "split_with_sizes": lambda h: torch.split(h, [16, 16], -1),
    "unbind": lambda h: h.view(*h.shape[:-1], 2, 16).unbind(-2),
}


class TwoAdapters(nn.Module):
    """A norm's output split in two along the channels, each half read by its own (LoRA-wrapped) Linear."""

    def __init__(self, split: str) -> None:
        super().__init__()
        self.split = split
        self.inp, self.norm = nn.Linear(16, 32), nn.LayerNorm(32)
        self.a, self.b, self.out = nn.Linear(16, 8), nn.Linear(16, 8), nn.Linear(16, 4)

    def forward(self, x):
        p, q = SPLITS[self.split](self.norm(self.inp(x)))
        return self.out(torch.cat([self.a(p), self.b(q)], -1))


def _grads(model, x):
    x = x.clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    model(x).float().square().sum().backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("split", SPLITS)
def test_lora_layers_fed_by_outputs_of_one_node_share_each_its_own_input(split, dtype):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = TwoAdapters(split).to(dtype)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["a", "b"], init_lora_weights=False))
    for n, p in model.named_parameters():  # PEFT's usual mix: a half-precision base, fp32 adapters
        if "lora_" in n:
            p.data = p.data.float()
    x = torch.randn(3, 5, 16, dtype=dtype)
    original = copy.deepcopy(model)
    convert(model, probe=(x.clone().requires_grad_(True),), measure=False)
    assert len(model.lmbp_report.plan.items) >= 2, str(model.lmbp_report)  # both layers share their input
    want, got = _grads(original, x), _grads(model, x)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


#: views of a norm's output along the tokens, each made contiguous (a copy whose chain ends at the norm)
TOKEN_VIEWS = {
    "slice_negative_end": lambda h: h[:, :-1],
    "slice_negative_start": lambda h: h[:, -3:],
    "slice_stepped": lambda h: h[:, ::2],
    "select_negative": lambda h: h.select(1, -1),
    "narrow": lambda h: h.narrow(1, 1, 3),
    "transpose": lambda h: h.transpose(0, 1),
    "chunk": lambda h: h.chunk(2, 1)[1],
    "unbind": lambda h: h.unbind(1)[-2],
}


class TokenView(nn.Module):
    def __init__(self, view: str) -> None:
        super().__init__()
        self.view = view
        self.inp, self.norm, self.head = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4)

    def forward(self, x):
        h = self.norm(self.inp(x))
        return self.head(TOKEN_VIEWS[self.view](h).contiguous()) + self.head(h).mean()


@pytest.mark.parametrize("view", TOKEN_VIEWS)
def test_an_exact_norms_output_read_through_a_view_rebuilds_bitwise(view):
    torch.manual_seed(0)
    model = TokenView(view)
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.normal_()
    x = torch.randn(4, 6, 16)
    original = copy.deepcopy(model)
    convert(model, probe=(x.clone().requires_grad_(True),), activations=False, measure=False)
    assert model.lmbp_report.plan.items, str(model.lmbp_report)
    want, got = _grads(original, x), _grads(model, x)
    for k in want:
        assert torch.equal(got[k], want[k]), k


class FusedHead(nn.Module):
    """TRL's fused LM head: the backbone's last hidden state shifted by ``[:, :-1]``, projected, cross-entropy."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        hidden = self.lm.model(input_ids=input_ids).last_hidden_state
        logits = self.lm.lm_head(hidden[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), input_ids[:, 1:].flatten())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_trl_style_fused_head_trains(dtype):
    model = FusedHead(hf("llama").to(dtype)).train()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    original = copy.deepcopy(model)
    convert(model, probe=(ids,), measure=False)
    # the final norm, whose output the shifted head reads, stays converted (its backward used to fail: rolled back)
    assert "lm.model.norm" in {it.name for it in model.lmbp_report.plan.items}, str(model.lmbp_report)
    grads = []
    for m in (original, model):
        m(ids).backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    want, got = grads
    assert want.keys() == got.keys()
    for k in want:
        if dtype == torch.float32:
            assert torch.equal(got[k], want[k]), k
        else:
            scale = max(g.float().abs().max().item() for g in want.values())
            assert torch.allclose(got[k].float(), want[k].float(), rtol=2e-2, atol=2e-2 * scale), k
