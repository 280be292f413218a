import torch
from torch import nn

from lmbp_convert.memory import SavedTensorLedger


def test_counts_unique_storages_and_skips_parameters():
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    with SavedTensorLedger(lin) as led:
        y = lin(x)
        z = y * y  # saves y twice: one storage
    assert led.bytes == 4 * 16 * 4 + 4 * 16 * 4  # x (for weight grad) + y
    assert led.count == 2
    z.sum().backward()


def test_autocast_weight_copies_are_not_activations():
    lin = nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    with SavedTensorLedger(lin) as led:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lin(x)
    assert led.skipped_weight_copies == 1
    assert led.bytes == 4 * 16 * 2  # the bf16 input copy only
    lin.requires_grad_(False)
    with SavedTensorLedger(lin) as led:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lin(x)
    assert led.skipped_weight_copies == 1 and led.bytes == 0


def test_autocast_copies_of_weight_views_are_not_activations():
    """``x @ self.weight.T`` (Falcon's Linear) under autocast casts the transposed view: a weight copy too."""
    lin = nn.Linear(16, 8, bias=False)
    x = torch.randn(4, 16, requires_grad=True)
    with SavedTensorLedger(lin) as led:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = x @ lin.weight.T
    assert led.skipped_weight_copies == 1
    assert led.bytes == 4 * 16 * 2  # the bf16 input copy only
    y.float().sum().backward()


def test_measured_graphs_are_freed():
    """The ledger must not keep what it measured alive (a pack hook returning an op's own output would)."""
    import gc
    import weakref

    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    with SavedTensorLedger(lin) as led:
        y = torch.tanh(lin(x))  # tanh saves its own output
    ref = weakref.ref(y)
    del y  # measured, never backpropagated (as benchmarks do)
    gc.collect()
    assert ref() is None and led.bytes > 0
