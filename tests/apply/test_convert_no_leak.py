"""Nothing a converted model's training step makes outlives the step.

The rewrites keep their backward's tensors in saved-tensor hooks, recomputation records and notes; a reference
from one of them into an autograd graph that the graph itself holds is a cycle Python's garbage collector cannot
see through (autograd nodes are C++), so it would leak every step. Found that way: the fp32 exact norm's replay
kept its recomputed tensors with their autograd history, 13 MiB a step on the fidelity experiment's tiny LLaMA,
and the run was killed for memory after a few thousand steps. Counted here: the Python tensors alive after a
step (and their bytes), which must not grow from one step to the next.
"""
from __future__ import annotations

import copy
import gc

import pytest
import torch

from lmbp_convert import convert
from lmbp_convert.apply.verify import float_tensors
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.trace.tracer import call_model
from testsupport.families import lora_on_every_linear, registry

FAMILIES = registry()


def _live() -> tuple[int, int]:
    gc.collect()
    ts = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    return len(ts), sum(t.untyped_storage().nbytes() for t in ts if t.device.type != "meta")


def _steps(model, probe, n: int, autocast: bool) -> None:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(n):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = call_model(model, probe)
        loss = sum(t.float().pow(2).mean() for t in float_tensors(out))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        del out, loss


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
@pytest.mark.parametrize("family", ["llama", "bert", "vit", "gpt2", "mixtral", "lora_llama"])
def test_a_training_step_leaves_nothing_behind(family, autocast):
    if family.startswith("lora_"):
        pytest.importorskip("peft")
        model = lora_on_every_linear(FAMILIES[family[5:]]())
    else:
        model = FAMILIES[family]()
    probe = make_probe(copy.deepcopy(model))[0]
    model = convert(model.train(), measure=False)
    assert model.lmbp_report.plan.kinds(), str(model.lmbp_report)
    _steps(model, probe, 2, autocast)  # optimizer state, caches, lazily built kernels
    before = _live()
    _steps(model, probe, 3, autocast)
    assert _live() == before, (family, before, _live())
