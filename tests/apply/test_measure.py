"""The report's measured bytes: what one training forward on the probe keeps, original vs converted, by the exact
ledger, in the mode convert() ran in — and the measurement leaves the model as it was."""
import copy
import warnings

import pytest
import torch

from lmbp_convert import SavedTensorLedger, convert
from lmbp_convert.apply.measure import measure_saved
from lmbp_convert.report import fmt_bytes
from lmbp_convert.trace.probe import make_probe
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
    assert "train mode" in report.measured_mode
    head = str(report).splitlines()[0]  # the report leads with this figure, the probe and the mode
    assert head == (f"lmbp-convert: {(before - after) / before:.1%} less activation memory: {fmt_bytes(before)} → "
                    f"{fmt_bytes(after)} kept for backward ({fmt_bytes(before - after)} less per sample), measured "
                    f"on one training forward of the probe input_ids (1, 8) int64 ({report.measured_mode})"), head
    assert report.measurement.checkpointing == "" and "checkpointing" not in str(report)


def _checkpointed_llama():
    model = FAMILIES["llama"]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renamed it activation_checkpointing_enable
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _timm_checkpointed():
    model = FAMILIES["timm_vit"]()
    model.set_grad_checkpointing(True)
    return model


@pytest.mark.parametrize("build, how", [(_checkpointed_llama, "HF gradient checkpointing on 2 modules"),
                                        (_timm_checkpointed, "timm grad_checkpointing on 1 module")])
def test_activation_checkpointing_is_said_and_measured_without_it_too(build, how):
    """Issue 36 item 4: with checkpointing on, one training forward keeps only the checkpointed layers' inputs, so
    the headline barely moves; the report says checkpointing is on and gives the same forward with it off (what a
    layer keeps while recomputed), which is the ledger's count of the model with its checkpointing off."""
    model = build()
    ref = copy.deepcopy(model)
    rep = convert(model).lmbp_report
    m = rep.measurement
    assert m.checkpointing == how and how in m.mode
    probe = make_probe(model)[0]
    assert (m.before, m.after) == (measure_saved(ref, probe).bytes, measure_saved(model, probe).bytes)
    for net in (ref, model):  # the model's own switches off: what `without_checkpointing` claims to be
        for mod in net.modules():
            for flag in ("gradient_checkpointing", "grad_checkpointing"):
                if getattr(mod, flag, None) is True:
                    setattr(mod, flag, False)
    assert m.without_checkpointing == (measure_saved(ref, probe).bytes, measure_saved(model, probe).bytes)
    b, a = m.without_checkpointing
    assert a < b and m.before - m.after < b - a
    line = next(x for x in str(rep).splitlines() if x.startswith("activation checkpointing is on"))
    assert line == (f"activation checkpointing is on ({how}): in a training forward a checkpointed layer keeps only "
                    "its inputs, so the figure above is mostly what is saved outside those layers; the rewrites inside "
                    "them act while each is recomputed in backward, one layer at a time: the same forward with "
                    f"checkpointing off keeps {fmt_bytes(b)} → {fmt_bytes(a)} ({(b - a) / b:.1%} less)")


def test_checkpoint_for_budget_layers_count_as_checkpointed():
    from lmbp_convert.apply.measure import checkpointing, checkpointing_off
    from lmbp_convert.budget import _checkpoint_layer  # how checkpoint_for_budget checkpoints a layer

    model = FAMILIES["llama"]().train()
    undo = [_checkpoint_layer(layer, use_reentrant=False) for layer in model.model.layers]
    try:
        assert [c.describe() for c in checkpointing(model)] == ["checkpoint_for_budget on 2 modules"]
        with checkpointing_off(model):
            assert checkpointing(model) == []
        assert [c.describe() for c in checkpointing(model)] == ["checkpoint_for_budget on 2 modules"]
    finally:
        for u in undo:
            u()
    assert checkpointing(model) == []


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
