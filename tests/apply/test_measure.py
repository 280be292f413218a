"""The report's measured bytes: what one training forward on the probe keeps, original vs converted, by the exact
ledger, in the mode convert() ran in — and the measurement leaves the model as it was."""
import copy

import pytest
import torch

from lmbp_convert import SavedTensorLedger, convert
from lmbp_convert.apply.measure import measure_saved
from testsupport.families import FAMILIES


def _ledger(model, probe, autocast=False):
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with SavedTensorLedger(model) as led:
            out = model(**probe)
    del out
    return led.bytes


@pytest.mark.parametrize("autocast", [False, True])
def test_measured_bytes_are_the_ledger_s_in_the_callers_mode(autocast):
    model = FAMILIES["llama"]().eval()
    ref = copy.deepcopy(model)
    probe = {"input_ids": torch.tensor([[3, 17, 42, 9, 5, 77, 1, 2]])}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        report = convert(model, probe=probe).lmbp_report
    before, after = report.measured_bytes
    assert before == _ledger(ref, probe, autocast) and after == _ledger(model, probe, autocast)
    assert report.measured_saved_bytes == before - after > 0
    assert ("autocast bfloat16" in report.measured_mode) == autocast
    assert "train mode" in report.measured_mode and "measured on the probe" in str(report)


def test_measuring_leaves_batchnorm_statistics_rng_and_modes_alone():
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5),
                              torch.nn.Linear(8, 2)).eval()
    net[0].train()  # a mixed state comes back as it was
    stats = [b.clone() for b in net.buffers()]
    x = torch.randn(4, 8)
    torch.manual_seed(5)
    expect = torch.rand(3)
    torch.manual_seed(5)
    m = measure_saved(net, x)
    assert torch.equal(torch.rand(3), expect)
    assert all(torch.equal(a, b) for a, b in zip(stats, net.buffers()))
    assert [x.training for x in net] == [True, False, False, False]
    assert m.bytes > 0 and "1 dropout module(s) active" in m.mode
