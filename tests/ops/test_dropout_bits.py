"""Bit-mask dropout: the same draws and values as F.dropout, bitwise, with a 1-bit mask kept for backward."""
import pytest
import torch
import torch.nn.functional as F

from lmbp_convert import SavedTensorLedger
from lmbp_convert.ops.dropout_bits import dropout_bits, pack_bits, unpack_bits


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 37), (2, 5, 64)])
def test_bits_round_trip(shape):
    torch.manual_seed(0)
    mask = torch.rand(shape) > 0.5
    bits = pack_bits(mask)
    assert bits.dtype == torch.uint8 and bits.numel() == (mask.numel() + 7) // 8
    assert torch.equal(unpack_bits(bits, mask.shape), mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("p", [0.05, 0.5, 0.9])
def test_matches_f_dropout_bitwise(dtype, p):
    x = torch.randn(4, 33, 65, dtype=dtype, requires_grad=True)
    g = torch.randn(4, 33, 65, dtype=dtype)
    torch.manual_seed(3)
    ref = F.dropout(x, p, True)
    (gref,) = torch.autograd.grad(ref, x, g)
    torch.manual_seed(3)
    out = dropout_bits(x, p)
    (gout,) = torch.autograd.grad(out, x, g)
    assert torch.equal(out, ref) and torch.equal(gout, gref)
    torch.manual_seed(3)  # the generator is left in the same state
    F.dropout(x, p, True)
    a = torch.rand(5)
    torch.manual_seed(3)
    dropout_bits(x, p)
    assert torch.equal(torch.rand(5), a)


def test_keeps_one_bit_per_element():
    x = torch.randn(8, 64, requires_grad=True)
    with SavedTensorLedger() as led:
        y = dropout_bits(x * 1.0, 0.1)
    assert led.bytes == 8 * 64 // 8
    with SavedTensorLedger() as led:
        y = F.dropout(x * 1.0, 0.1, True)
    assert led.bytes == 8 * 64 * 4  # the CPU noise tensor
    del y


def test_falls_back_where_nothing_is_kept():
    x = torch.randn(4, 4)
    torch.manual_seed(1)
    a = dropout_bits(x, 0.3)
    torch.manual_seed(1)
    assert torch.equal(a, F.dropout(x, 0.3, True))
    xg = torch.randn(4, 4, requires_grad=True)
    assert torch.equal(dropout_bits(xg, 1.0), F.dropout(xg, 1.0, True))
