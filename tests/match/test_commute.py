"""``commute.step`` op by op: each op of the table, traced for real, moves the channel axis where it should,
blocks where a fold would be inexact, or is an ordinary consumer (None)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmbp_convert.match.commute import RULES, Block, Pass, op_short, step
from lmbp_convert.trace.tracer import trace

D = 8  # channels
OTHER = torch.zeros(2, 3, D)  # the second operand of expand_as / view_as / reshape_as / type_as


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def run_step(fn, op: str, shape=(2, 3, D), axis=-1):
    """Trace ``fn(x)`` and ask ``step`` about the first ``op`` call that reads x, channels on ``axis``."""
    g, _ = trace(_Fn(fn), torch.randn(*shape), lambda m: False)
    x = next(iter(g.scopes[0].args))
    node = next((n for n in g.nodes if x in n.inputs and op_short(n) == op), None)
    assert node is not None, [(n.target, n.inputs) for n in g.nodes]
    return step(node, g.tensors, x, axis % len(shape), shape[axis])


#: op → (fn, input shape, channel axis, expected): Pass(axis) where the channels go, or None (ordinary consumer)
PASSES = {
    "dropout": (lambda x: F.dropout(x, p=0.0), (2, 3, D), -1, Pass(2)),
    "to": (lambda x: x.to(torch.float64), (2, 3, D), -1, Pass(2)),
    "float": (lambda x: x.float(), (2, 3, D), -1, Pass(2)),
    "half": (lambda x: x.half(), (2, 3, D), -1, Pass(2)),
    "bfloat16": (lambda x: x.bfloat16(), (2, 3, D), -1, Pass(2)),
    "double": (lambda x: x.double(), (2, 3, D), -1, Pass(2)),
    "type": (lambda x: x.type(torch.float64), (2, 3, D), -1, Pass(2)),
    "type_as": (lambda x: x.type_as(OTHER.double()), (2, 3, D), -1, Pass(2)),
    "contiguous": (lambda x: x.contiguous(), (2, 3, D), -1, Pass(2)),
    "clone": (lambda x: x.clone(), (D, 3), 0, Pass(0)),  # casts keep any axis
    "cpu": (lambda x: x.cpu(), (2, 3, D), -1, Pass(2)),
    "t": (lambda x: x.t(), (3, D), -1, Pass(0)),
    "permute": (lambda x: x.permute(2, 0, 1), (2, 3, D), -1, Pass(0)),
    "transpose": (lambda x: x.transpose(1, 2), (2, 3, D), -1, Pass(1)),
    "swapaxes": (lambda x: x.swapaxes(2, 0), (2, 3, D), -1, Pass(0)),
    "swapdims": (lambda x: x.swapdims(1, 2), (2, 3, D), -1, Pass(1)),
    "movedim": (lambda x: x.movedim(-1, 1), (2, 3, D), -1, Pass(1)),
    "moveaxis": (lambda x: torch.moveaxis(x, (0, 2), (2, 0)), (2, 3, D), -1, Pass(0)),
    "mean": (lambda x: x.mean(1), (2, 3, D), -1, Pass(1)),
    "nanmean": (lambda x: x.nanmean(1, keepdim=True), (2, 3, D), -1, Pass(2)),
    "view": (lambda x: x.view(6, D), (2, 3, D), -1, Pass(-1)),
    "reshape": (lambda x: x.reshape(-1, D), (2, 3, D), -1, Pass(-1)),
    "flatten": (lambda x: x.flatten(0, 1), (2, 3, D), -1, Pass(-1)),
    "unflatten": (lambda x: x.unflatten(1, (3, 1)), (2, 3, D), -1, Pass(-1)),
    "expand": (lambda x: x.expand(2, 3, D), (2, 1, D), -1, Pass(-1)),
    "expand_as": (lambda x: x.expand_as(OTHER), (2, 1, D), -1, Pass(-1)),
    "squeeze": (lambda x: x.squeeze(1), (2, 1, D), -1, Pass(-1)),
    "unsqueeze": (lambda x: x.unsqueeze(0), (2, 3, D), -1, Pass(-1)),
    "view_as": (lambda x: x.view_as(OTHER), (6, D), -1, Pass(-1)),
    "reshape_as": (lambda x: x.reshape_as(OTHER), (6, D), -1, Pass(-1)),
    "repeat": (lambda x: x.repeat(2, 1, 1), (2, 3, D), -1, Pass(-1)),
    "__getitem__": (lambda x: x[:, 1:], (2, 3, D), -1, Pass(-1)),
    "narrow": (lambda x: x.narrow(1, 0, 2), (2, 3, D), -1, Pass(-1)),
    "select": (lambda x: x.select(1, 0), (2, 3, D), -1, Pass(-1)),
    "split": (lambda x: x.split(1, dim=1), (2, 3, D), -1, Pass(-1)),
    "chunk": (lambda x: x.chunk(3, 1), (2, 3, D), -1, Pass(-1)),
    "unbind": (lambda x: x.unbind(1), (2, 3, D), -1, Pass(-1)),
    "roll": (lambda x: x.roll(1, 1), (2, 3, D), -1, Pass(-1)),
    "index_select": (lambda x: x.index_select(1, torch.tensor([2, 0])), (2, 3, D), -1, Pass(-1)),
    "split_with_sizes": (lambda x: x.split_with_sizes([1, 2], 1), (2, 3, D), -1, Pass(-1)),
    "tensor_split": (lambda x: x.tensor_split(2, dim=1), (2, 3, D), -1, Pass(-1)),
    "repeat_interleave": (lambda x: x.repeat_interleave(2, dim=1), (2, 3, D), -1, Pass(-1)),
    "pad": (lambda x: F.pad(x, (0, 0, 1, 0), mode="replicate"), (2, 3, D), -1, Pass(2)),
}

#: the same op blocking the fold: op → (fn, input shape, channel axis, words of the reason)
BLOCKS = {
    "dropout": (lambda x: F.dropout(x, p=0.1), "dropout (p=0.1)"),
    "pad": (lambda x: F.pad(x, (1, 0)), "padding of channels"),
    "view": (lambda x: x.view(2, 3, 2, 4), "view reshapes the channel dim"),
    "reshape": (lambda x: x.reshape(2, -1), "reshape reshapes the channel dim"),
    "flatten": (lambda x: x.flatten(), "flatten reshapes the channel dim"),
    "unflatten": (lambda x: x.unflatten(-1, (2, 4)), "unflatten reshapes the channel dim"),
    "repeat": (lambda x: x.repeat(1, 1, 2), "repeat reshapes the channel dim"),
    "__getitem__": (lambda x: x[..., :4], "channel slicing"),
    "narrow": (lambda x: x.narrow(-1, 0, 4), "narrow over the channel dim"),
    "select": (lambda x: x.select(2, 0), "select over the channel dim"),
    "split": (lambda x: x.split(4, dim=-1), "split over the channel dim"),
    "chunk": (lambda x: x.chunk(2, -1), "chunk over the channel dim"),
    "unbind": (lambda x: x.unbind(-1), "unbind over the channel dim"),
    "roll": (lambda x: x.roll(1, -1), "roll over the channel dim"),
    "index_select": (lambda x: x.index_select(2, torch.tensor([1, 0])), "index_select over the channel dim"),
    "split_with_sizes": (lambda x: x.split_with_sizes([3, 5], 2), "split_with_sizes over the channel dim"),
    "tensor_split": (lambda x: x.tensor_split(2, dim=-1), "tensor_split over the channel dim"),
    "repeat_interleave": (lambda x: x.repeat_interleave(2, dim=2), "repeat_interleave over the channel dim"),
}


def test_unsqueeze_after_the_channels_moves_them_left_of_the_new_dim():
    """``x.unsqueeze(-1)``: the column vectors of a batched matmul (MoE experts through bmm)."""
    got = run_step(lambda x: x.unsqueeze(-1), "unsqueeze")
    assert isinstance(got, Pass) and got.axis == 2, got
    assert run_step(lambda x: x.unsqueeze(1), "unsqueeze").axis == -1


@pytest.mark.parametrize("op", sorted(PASSES))
def test_commuting_op_moves_the_channels(op):
    fn, shape, axis, expected = PASSES[op]
    got = run_step(fn, op, shape, axis)
    assert isinstance(got, Pass) and got.axis == expected.axis, got
    if expected.caveat:
        assert expected.caveat in (got.caveat or ""), got
    else:
        assert got.caveat is None, got


@pytest.mark.parametrize("op", sorted(BLOCKS))
def test_op_that_breaks_the_fold_blocks_it(op):
    fn, words = BLOCKS[op]
    got = run_step(fn, op)
    assert isinstance(got, Block) and words in got.reason.text, got


def test_cuda_is_a_cast_like_cpu():
    """The same node as .cpu(), named .cuda(): runs without a GPU."""
    g, _ = trace(_Fn(lambda x: x.cpu()), torch.randn(2, 3, D), lambda m: False)
    x = next(iter(g.scopes[0].args))
    node = next(n for n in g.nodes if op_short(n) == "cpu")
    node.target = "torch.Tensor.cuda"
    assert step(node, g.tensors, x, 2, D) == Pass(2)


def test_every_op_of_the_table_is_tested():
    """A new RULES entry comes with a case in PASSES (and in BLOCKS where it can block)."""
    assert set(RULES) - set(PASSES) == {"cuda"}


@pytest.mark.parametrize("fn, op, shape, axis", [
    (lambda x: x + 1, "add", (2, 3, D), -1),  # ordinary consumers
    (lambda x: x @ torch.ones(D, 4), "matmul", (2, 3, D), -1),
    (lambda x: torch.cat([x, x], 1), "cat", (2, 3, D), -1),
    (lambda x: x.add_(1), "add_", (2, 3, D), -1),  # in place
    (lambda x: x.detach_(), "detach_", (2, 3, D), -1),
    (lambda x: x.mean(-1), "mean", (2, 3, D), -1),  # averages the channels
    (lambda x: x.view(2, 3 * D), "view", (2, D, 3), 1),  # reshapes follow channels only when they are last
    (lambda x: x[:, :2], "__getitem__", (2, D, 3), 1),
    (lambda x: x.narrow(2, 0, 1), "narrow", (2, D, 3), 1),
    (lambda x: x.roll(1), "roll", (2, 3, D), -1),  # no dims: rolls the flattened tensor across channels
])
def test_ordinary_consumers_are_not_followed(fn, op, shape, axis):
    got = run_step(fn, op, shape, axis)
    assert got is None, got


@pytest.mark.parametrize("mode", ["replicate", "reflect", "circular"])
def test_pad_that_copies_within_channels_commutes(mode):
    got = run_step(lambda x: F.pad(x, (0, 0, 1, 1), mode=mode), "pad")
    assert got == Pass(2), got


@pytest.mark.parametrize("pads, words", [((0, 0, 0, 0), "no-op at the probe's shape"), ((0, 0, 1, 0), "zero-padding")])
def test_zero_pad_commutes_only_without_beta_at_every_shape(pads, words):
    """A zero pad is exact for γ alone (γ·0 = 0); with β the padded positions would get W·β. A pad that is a no-op
    at the probe's shape (Swin's window padding) pads other shapes: judged the same, not passed with a note."""
    got = run_step(lambda x: F.pad(x, pads), "pad")
    assert isinstance(got, Pass) and got.axis == 2 and got.caveat is None, got
    assert words in got.unless_beta and "W·β" in got.unless_beta


def test_pad_with_another_value_or_of_channels_blocks():
    got = run_step(lambda x: F.pad(x, (0, 0, 1, 0), value=1.0), "pad")
    assert isinstance(got, Block) and "constant-padding with 1.0" in got.reason.text
    assert isinstance(run_step(lambda x: F.pad(x, (0, 0, 1, 0)), "pad", (2, D, 3), 1), Block)  # channels not last


def test_a_module_call_is_not_an_op():
    g, _ = trace(_Fn(nn.Linear(D, D)), torch.randn(2, D), lambda m: isinstance(m, nn.Linear))
    x = next(iter(g.scopes[0].args))
    lin = next(n for n in g.nodes if x in n.inputs)
    assert lin.callee == "module" and step(lin, g.tensors, x, 1, D) is None


@pytest.mark.parametrize("fn, shape, axis, expected", [
    (lambda x: x.reshape(2, D, 2, 3), (2, D, 6), 1, Pass(1)),  # tokens → H, W after channel-first channels
    (lambda x: x.view(2, D, 6), (2, D, 2, 3), 1, Pass(1)),  # H, W → tokens
    (lambda x: x.flatten(2), (2, D, 2, 3), 1, Pass(1)),
    (lambda x: x.unflatten(2, (2, 3)), (2, D, 6), 1, Pass(1)),
    (lambda x: x.reshape(6, D), (2, 3, D, 1), 2, None),  # channels not whole in a dim kept
    (lambda x: x.reshape(2, 2, D * 3 // 2), (2, D, 3), 1, None),  # channels merged with tokens
])
def test_reshape_with_channels_first_keeps_them_when_only_other_dims_change(fn, shape, axis, expected):
    name = next(n for n in ("reshape", "view", "flatten", "unflatten") if n in fn.__code__.co_names)
    assert run_step(fn, name, shape, axis) == expected
