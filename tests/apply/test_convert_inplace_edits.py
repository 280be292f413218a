"""An in-place edit between forward and backward: the converted model does what the original does.

Autograd raises ("modified by an inplace operation") when backward would read a tensor edited since it was saved;
a tensor saved through saved-tensor hooks loses that check, so every hook of this package checks what it keeps
itself (`lmbp_convert.ops.saved_hooks`). The invariant asserted here, per edit, fp32, bf16 and bf16 autocast over fp32 weights:

* where the original raises, the converted model raises autograd's error, or back-propagates exactly the
  gradients of the unedited forward (a rewrite that no longer reads the edited tensor: a memory-sharing norm keeps
  x̂, not its input);
* where the original does not raise, neither does the converted model, and its gradients are the original's
  (the memory-sharing loss keeps the logits' storage instead of a copy, so an edit of the logits raises there).

Edited: the model's input, the first parameter of each kind (owner class, name, LoRA or not): every rewritten
layer's weight, a norm's γ and β, embeddings, LoRA A and B, experts — and the logits.
"""
from __future__ import annotations

import copy

import pytest
import torch

from lmbp_convert import LogitsModifiedError, convert
from lmbp_convert.apply.verify import float_tensors
from lmbp_convert.match.loss import LossSwap
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.trace.tracer import call_model
from testsupport.families import hf, lora_on_every_linear, registry

FAMILIES = registry()
INPLACE = "modified by an inplace operation"
CAUSAL = {"llama", "lora_llama", "mixtral"}  # causal LMs: trained with labels through the memory-sharing loss


def _model(family: str, dtype: torch.dtype):
    model = lora_on_every_linear(FAMILIES[family[5:]]()) if family.startswith("lora_") else FAMILIES[family]()
    return model.to(dtype).train()


AUTOCAST = "autocast"  # fp32 weights, the forward under bf16 autocast


def _edits(model) -> dict[str, tuple]:
    """name → ("param", parameter name) for the first parameter of each kind, plus the input and the logits."""
    edits, seen = {}, set()
    owners = dict(model.named_modules())
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            continue
        owner, _, leaf = name.rpartition(".")
        key = (type(owners[owner]).__name__, leaf, "lora_" in name)
        if key not in seen:
            seen.add(key)
            edits[f"{key[0]}.{leaf}" + (" (LoRA)" if key[2] else "")] = ("param", name)
    edits["input"] = ("input", None)
    edits["output"] = ("output", None)
    return edits


def _edit(model, probe, out, what: tuple) -> None:
    kind, name = what
    with torch.no_grad():
        if kind == "param":
            t = dict(model.named_parameters())[name]
            t.mul_(2) if t.abs().sum() > 0 else t.add_(0.5)
        elif kind == "input":
            t = next(v for v in (probe.values() if isinstance(probe, dict) else probe) if isinstance(v, torch.Tensor))
            t.copy_(t.flip(-1)) if not t.is_floating_point() else t.mul_(2)
        else:  # the logits: the largest floating-point output (not the loss)
            max(float_tensors(out), key=torch.Tensor.numel).mul_(0.5)


def _step(model, probe, what, autocast: bool = False):
    """(error or None, gradients) of one forward, the edit, one backward."""
    probe = copy.deepcopy(probe)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same dropout draws in every run
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = call_model(model, probe)
    loss = getattr(out, "loss", None)
    if loss is None:
        loss = sum(t.float().pow(2).mean() for t in float_tensors(out))
    if what is not None:
        _edit(model, probe, out, what)
    try:
        loss.backward()
    except RuntimeError as e:
        return e, None
    return None, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(a: dict, b: dict, dtype) -> bool:
    """Equal up to the conversion's rounding, on the scale of the largest gradient (a gradient that is zero in exact
    arithmetic, a key bias's under softmax, is rounding noise in both)."""
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    scale = max(g.float().abs().max().item() for g in b.values())
    return a.keys() == b.keys() and all(torch.allclose(a[k].float(), b[k].float(), rtol=tol, atol=tol * scale)
                                        for k in a)


@pytest.mark.parametrize("mode", [torch.float32, torch.bfloat16, AUTOCAST], ids=["fp32", "bf16", "autocast"])
@pytest.mark.parametrize("family", ["llama", "lora_llama", "vit", "bert", "mixtral"])
def test_an_edit_between_forward_and_backward_behaves_as_on_the_original(family, mode):
    autocast = mode == AUTOCAST
    dtype = torch.bfloat16 if autocast else mode
    original = _model(family, torch.float32 if autocast else mode)
    probe = make_probe(copy.deepcopy(original))[0]
    causal = family in CAUSAL
    if causal:  # labels: the loss the memory-sharing loss replaces
        probe = dict(probe, labels=probe["input_ids"].clone())
    # activations=False: exact training, so "the same gradients" is a rounding bound, not the approximation's
    converted = convert(copy.deepcopy(original), probe=probe, activations=False, measure=False)
    plan = converted.lmbp_report.plan
    assert plan.items, str(converted.lmbp_report)
    keeps_logits = bool(plan.of(LossSwap))  # the memory-sharing loss keeps the logits, not a copy
    assert keeps_logits == causal, str(converted.lmbp_report)  # its edit case is exercised
    _, unedited = _step(copy.deepcopy(original), probe, None, autocast)
    problems = []
    for label, what in _edits(original).items():
        err, grads = _step(copy.deepcopy(original), probe, what, autocast)
        got_err, got = _step(copy.deepcopy(converted), probe, what, autocast)
        if got_err is not None and INPLACE not in str(got_err):
            problems.append(f"{label}: converted raised {got_err!r}")
        elif err is not None and got_err is None and not _close(got, unedited, dtype):
            problems.append(f"{label}: the original raises, the converted model used the edited values")
        elif err is None and got_err is None and not _close(got, grads, dtype):
            problems.append(f"{label}: gradients differ from the original's")
        elif err is None and got_err is not None and not (
                what[0] == "output" and keeps_logits and isinstance(got_err, LogitsModifiedError)):
            problems.append(f"{label}: converted raised where the original does not: {got_err}")
    assert not problems, "\n".join(problems)


def test_an_optimizer_step_between_forward_and_backward_raises():
    model = hf("llama").train()
    probe = make_probe(copy.deepcopy(model))[0]
    convert(model, measure=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = call_model(model, probe)
    loss = sum(t.float().pow(2).mean() for t in float_tensors(out))
    opt.step()  # no gradients yet: SGD skips them; make some first
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()
