"""Projection-like modules are found by behaviour (a linear map of the last dim, row by row), not by class."""
from __future__ import annotations

import torch
from torch import nn

from testsupport.quant_standin import Packed4bitLinear
from lmbp_convert.match.projection import projection_problem


def test_packed_linear_is_a_projection():
    torch.manual_seed(0)
    assert projection_problem(Packed4bitLinear(nn.Linear(16, 8))) is None
    assert projection_problem(Packed4bitLinear(nn.Linear(16, 8, bias=False))) is None


class _Gelu(nn.Linear):
    def forward(self, x):
        return torch.nn.functional.gelu(super().forward(x))


class _RowMix(nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        return y + y.mean(dim=0, keepdim=True)


def test_nonlinear_or_row_mixing_modules_are_not():
    torch.manual_seed(0)
    assert projection_problem(_Gelu(16, 8)) == "is not a linear map of its input"
    assert projection_problem(_RowMix(16, 8)) == "mixes rows"
    with torch.device("meta"):
        lin = nn.Linear(16, 8)
    assert "meta" in projection_problem(lin)
    assert "width" in projection_problem(nn.ReLU())
