"""A hand-built mixture-of-experts model whose router sends no token of a chosen input to one expert.

Experts are a ``ModuleList`` called in a loop over the experts the router picked (the layout of transformers 4.x
and of many codebases), so the trace of such an input never sees the unrouted expert consume the norm's output.
"""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.5 * torch.randn(d))
        self.eps = 1e-6

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Expert(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down_proj, self.act_fn = nn.Linear(f, d, bias=False), nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Top-k routing over a ModuleList of experts (``Expert`` MLPs, or plain Linears with ``linear=True``)."""

    def __init__(self, d: int, n: int = 4, f: int = 16, top_k: int = 1, linear: bool = False):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d) if linear else Expert(d, f) for _ in range(n))

    def forward(self, hidden):
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        probs = torch.softmax(self.gate(x), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(len(self.experts)):
            token, slot = torch.where(chosen == e)
            if token.numel() == 0:  # data-dependent: no token routed here
                continue
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out = out.index_add(0, token, y)
        return out.reshape(shape)


class TinyMoE(nn.Module):
    """x → norm → MoE → + x → final norm → head. ``silent_expert``'s router row reads only channel 0, so an input
    whose channel 0 is strongly negative routes no token to it."""

    def __init__(self, d: int = 16, n: int = 4, silent_expert: int = 3, top_k: int = 1, linear: bool = False):
        super().__init__()
        self.norm = RMSNorm(d)
        self.moe = SparseMoE(d, n, top_k=top_k, linear=linear)
        self.final_norm = RMSNorm(d)
        self.head = nn.Linear(d, 8)
        with torch.no_grad():
            self.norm.weight[0] = 1.0
            self.moe.gate.weight[silent_expert] = 0
            self.moe.gate.weight[silent_expert, 0] = 6.0

    def forward(self, x):
        x = x + self.moe(self.norm(x))
        return self.head(self.final_norm(x))


def silent_probe(d: int = 16, batch: int = 2, seq: int = 6, seed: int = 0) -> torch.Tensor:
    """An input on which ``TinyMoE`` routes no token to its silent expert."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, d, generator=g)
    x[..., 0] = -4.0
    return x


def routing(model: TinyMoE, x: torch.Tensor) -> torch.Tensor:
    """The experts each token of ``x`` is routed to (top-k indices)."""
    with torch.no_grad():
        h = model.norm(x).reshape(-1, x.shape[-1])
        return torch.topk(torch.softmax(model.moe.gate(h), -1), model.moe.top_k, dim=-1).indices
