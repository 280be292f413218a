"""ApproxActivation: the nn.Module face of approx_act."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from lmbp_convert.memory import SavedTensorLedger
from lmbp_convert.nn.activations import ACT_KINDS, ApproxActivation
from lmbp_convert.ops import approx_act as ops


def test_act_kinds():
    assert ACT_KINDS == ("gelu", "gelu_tanh", "silu", "quick_gelu")
    assert ACT_KINDS is ops.ACT_KINDS


@pytest.mark.parametrize("kind", ACT_KINDS)
@pytest.mark.parametrize("bits", (1, 2, 3, 4))
def test_module_is_the_functional_op(kind, bits):
    mod = ApproxActivation(kind, bits)
    x = (torch.randn(3, 17) * 4).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(3, 17)
    y = mod(x)
    y.backward(g)
    ops.approx_act(x2, kind, bits).backward(g)
    assert torch.equal(y.detach(), ops.approx_act(x.detach(), kind, bits))
    assert torch.equal(x.grad, x2.grad)


def test_default_bits_and_saved_bytes():
    mod = ApproxActivation("silu")
    assert mod.bits == 2
    x = torch.randn(10, 10, requires_grad=True)
    with SavedTensorLedger(mod) as ledger:
        mod(x)
    assert ledger.count == 1 and ledger.bytes == 25


def test_repr_and_state():
    mod = ApproxActivation("gelu_tanh", 3)
    assert mod.extra_repr() == "kind='gelu_tanh', bits=3"
    assert repr(mod) == "ApproxActivation(kind='gelu_tanh', bits=3)"
    assert list(mod.parameters()) == [] and mod.state_dict() == {}
    seq = nn.Sequential(nn.Linear(4, 8), mod)
    assert "ApproxActivation(kind='gelu_tanh', bits=3)" in repr(seq)


def test_copy_and_pickle():
    mod = ApproxActivation("quick_gelu", 4)
    buf = io.BytesIO()
    torch.save(mod, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(5)
    for m in (copy.deepcopy(mod), loaded):
        assert (m.kind, m.bits) == ("quick_gelu", 4)
        assert torch.equal(m(x), mod(x))


@pytest.mark.parametrize("kind", ("relu", "GELU", "", None))
def test_bad_kind(kind):
    with pytest.raises(ValueError, match="activation kind"):
        ApproxActivation(kind)


@pytest.mark.parametrize("bits", (0, 5, 2.0, True, "2"))
def test_bad_bits(bits):
    with pytest.raises(ValueError, match="bits"):
        ApproxActivation("gelu", bits)


def test_bad_dtype():
    with pytest.raises(TypeError, match="int32"):
        ApproxActivation("gelu")(torch.ones(3, dtype=torch.int32))


def test_ms_relu_squared_is_the_functional_op_and_transformers_module():
    from transformers.activations import ReLUSquaredActivation

    from lmbp_convert.enums import ConvertedModule
    from lmbp_convert.nn.activations import OUTPUT_KINDS, MSReLUSquared

    mod = OUTPUT_KINDS["relu2"]()
    assert isinstance(mod, MSReLUSquared) and isinstance(mod, ConvertedModule) and not mod.state_dict()
    x = (torch.randn(3, 17) * 4).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(3, 17)
    y = mod(x)
    y.backward(g)
    ReLUSquaredActivation()(x2).backward(g)
    assert torch.equal(y.detach(), ReLUSquaredActivation()(x.detach())) and torch.equal(x.grad, x2.grad)
    buf = io.BytesIO()
    torch.save(mod, buf)
    buf.seek(0)
    assert isinstance(torch.load(buf, weights_only=False), MSReLUSquared)
