from collections import namedtuple

import torch
from torch import nn

from lmbp_convert.apply.hooks import ReapplyInput, ReapplyOutput


class _Norm(nn.Module):
    def __init__(self, param="w"):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([2.0, 3.0]))
        self.bias = nn.Parameter(torch.tensor([1.0, -1.0]))
        self.reapply_param = param


def test_input_hook_positional_and_keyword():
    norm = _Norm()
    x = torch.ones(1, 2)
    args, kwargs = ReapplyInput(norm, 1, None)(None, (x, x), {})
    assert torch.equal(args[0], x) and torch.equal(args[1], torch.tensor([[3.0, 2.0]]))
    args, kwargs = ReapplyInput(norm, None, "h")(None, (), {"h": x})
    assert torch.equal(kwargs["h"], torch.tensor([[3.0, 2.0]]))
    assert ReapplyInput(norm, None, "missing")(None, (), {"h": x}) is None


def test_output_hook_dict_tuple_namedtuple_and_one_plus_w():
    norm = _Norm("1+w")
    x = torch.ones(1, 2)
    out = ReapplyOutput(norm, [["a"]])(None, (), {"a": x, "b": x})
    assert torch.equal(out["a"], torch.tensor([[4.0, 3.0]])) and torch.equal(out["b"], x)
    out = ReapplyOutput(norm, [[1]])(None, (), (x, x))
    assert isinstance(out, tuple) and torch.equal(out[1], torch.tensor([[4.0, 3.0]]))
    Pair = namedtuple("Pair", "p q")
    out = ReapplyOutput(norm, [[0]])(None, (), Pair(x, x))
    assert isinstance(out, Pair) and torch.equal(out.p, torch.tensor([[4.0, 3.0]]))
