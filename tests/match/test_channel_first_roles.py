"""Channel-first norms are found by behaviour (match/roles.py): a norm over dim 1 of an NCHW tensor, whatever
its class, with w or no affine, LayerNorm or RMSNorm; norms over other dims (GroupNorm, InstanceNorm-like) and
ordinary last-dim norms are not taken for one."""
import pytest
import torch
from torch import nn

from lmbp_convert.enums import NormType, WeightParam
from lmbp_convert.match.roles import NormRole, identify_norm
from lmbp_convert.reasons import Reason

C = 16


class ChannelRMS(nn.Module):
    """An RMSNorm over dim 1, written out (no class name to go by)."""

    def __init__(self, c):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.eps = 1e-6

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + self.eps)
        return y * self.weight.view(1, -1, *([1] * (x.dim() - 2)))


def _timm_ln2d():
    from timm.layers import LayerNorm2d

    return LayerNorm2d(C)


@pytest.mark.parametrize("make, kind", [(_timm_ln2d, NormType.LAYER), (lambda: ChannelRMS(C), NormType.RMS)])
def test_channel_first_norms_are_found(make, kind):
    role = identify_norm(make(), None, None)
    assert isinstance(role, NormRole), role
    assert (role.norm_type, role.param, role.channel_dim, role.shape) == (kind, WeightParam.W, 1, (C,))


def test_last_dim_norms_stay_last_dim():
    role = identify_norm(nn.LayerNorm(C), None, None)
    assert isinstance(role, NormRole) and role.channel_dim == -1


@pytest.mark.parametrize("make", [lambda: nn.GroupNorm(4, C), lambda: nn.GroupNorm(C, C), lambda: nn.GroupNorm(1, C)])
def test_norms_over_other_dims_are_not_channel_first_norms(make):
    assert isinstance(identify_norm(make(), None, None), Reason)
