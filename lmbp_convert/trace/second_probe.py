"""A second verification input, other than the one traced.

Verification on the traced input cannot see a consumer the trace missed: a branch taken only for other data (an
MoE expert the probe routed no token to) is neither traced nor checked. A second input of the same shapes
exercises other branches, so a fold that misses such a consumer shows up as an output error there.

Where the second input comes from:
- the user passes several inputs, ``probe=Probes(first, second, ...)``: the first is traced, all are verified;
- the automatic probe: the same builder with another seed (``make_probe(model, seed=1)``);
- a single user input: derived from it (`derived_inputs`), trying these rules in order and keeping the first the
  model accepts:
  1. *re-sampled*: integer tensors holding more than two distinct values (token ids, positions) are drawn again,
     uniformly within the range they span (so ids stay inside the vocabulary the user's input lives in); float
     tensors holding more than two distinct values (pixels, audio, embeddings) are drawn again with the same mean
     and standard deviation;
  2. *shuffled*: the same tensors have their values permuted along the last dimension within each row (every row
     keeps its own values: special tokens and their counts, label sets), for models that reject values outside
     the patterns of rule 1.
  Tensors with at most two distinct values (attention masks, token types, boolean and additive masks) and
  everything that is not a tensor are kept as they are: they encode structure, not data. When neither rule gives
  an input the model accepts, or nothing could change, verification runs on the traced input only and the report
  says so.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

#: a tensor with at most this many distinct values is structure (a mask, token types): never changed
STRUCTURE_VALUES = 2


class Probes(tuple):
    """Several probe inputs: ``convert(model, probe=Probes(first, second))`` traces ``first`` and verifies the
    conversion on every one (each a tensor, a tuple of positional args or a dict of keyword args)."""

    def __new__(cls, *inputs: Any) -> "Probes":
        if not inputs:
            raise ValueError("Probes() needs at least one input")
        if any(isinstance(p, Probes) for p in inputs):
            raise TypeError("Probes cannot be nested")
        return super().__new__(cls, inputs)

    def __repr__(self) -> str:
        return f"Probes({len(self)} inputs)"


def _is_data(t: torch.Tensor) -> bool:
    if t.dtype is torch.bool or t.numel() < 2 or t.device.type == "meta" or t.is_complex():
        return False
    return int(torch.unique(t.detach()).numel()) > STRUCTURE_VALUES


def _resampled(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    src = t.detach()
    if src.is_floating_point():
        x = src.float()
        fresh = torch.randn(src.shape, generator=gen) * x.std().cpu() + x.mean().cpu()
        return fresh.to(src.device, src.dtype)
    lo, hi = int(src.min()), int(src.max())
    return torch.randint(lo, hi + 1, src.shape, generator=gen, dtype=src.dtype).to(src.device)


def _shuffled(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    src = t.detach()
    if src.dim() == 0:
        return src.clone()
    keys = torch.rand(src.shape, generator=gen).to(src.device)
    return torch.gather(src, -1, keys.argsort(dim=-1))


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj) if _is_data(obj) else obj
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_map(v, fn) for v in obj)
    return obj


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return not (a is b or (a.shape == b.shape and bool(torch.equal(a, b))))
    if isinstance(a, dict):
        return any(_differs(v, b[k]) for k, v in a.items())
    if isinstance(a, (list, tuple)):
        return any(_differs(x, y) for x, y in zip(a, b))
    return False


def derived_inputs(probe: Any, seed: int = 1) -> Iterator[tuple[Any, str]]:
    """Inputs of the same shapes as ``probe`` but other values, with how each was made, in the order to try
    (see the module doc); none when no tensor of ``probe`` carries data."""
    for rule, how in ((_resampled, "re-sampled from the traced input's value ranges"),
                      (_shuffled, "the traced input's values shuffled within each row")):
        gen = torch.Generator().manual_seed(seed)
        new = _map(probe, lambda t, r=rule, g=gen: r(t, g))
        if _differs(new, probe):
            yield new, how
