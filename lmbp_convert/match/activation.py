"""Activation matcher: every GELU/SiLU-family module (by role) becomes an `ActSwap` to approximate backprop; a
module that computes an activation whose derivative is a function of its output (squared ReLU, found by
behaviour) becomes an `OutputActSwap`, whose backward keeps only that output; every other elementwise activation
module the forward runs (ReLU, Tanh, …) is listed with its reason, so nothing is left out of the report."""
from __future__ import annotations

import copy
from typing import Callable, Iterator

import torch
from torch import nn

from ..catalogue import class_key
from ..reasons import Reason, ReasonCode
from .context import MatchContext, code_bytes, tensor_bytes
from .plan import ActSwap, OutputActSwap, Skip
from .roles import ModuleRole, behaviour_key

#: where libraries keep their activation modules: a leaf module from here that acts elementwise is an activation
_ACTIVATION_MODULES = ("torch.nn.modules.activation", "transformers.activations", "timm.layers.activations")


def match_activations(ctx: MatchContext) -> Iterator[ActSwap | Skip]:
    if not ctx.opt.activations:
        return
    checked: dict = {}  # behaviour checks, by `behaviour_key` (one per class, not per layer)
    for name, role in ctx.roles.items():
        mod = ctx.modules.get(name)
        if mod is None or name in ctx.claimed or not ctx.opt.selected(name):
            continue
        if role.plays is ModuleRole.ACTIVATION:
            yield ActSwap(name, class_key(mod), role.act, ctx.opt.bits, predicted_act_bytes(ctx, name))
        elif role.plays is ModuleRole.OTHER and ctx.g.module_calls.get(name):
            kind = output_activation_kind(ctx, name, mod, checked)
            if kind is not None:
                changed = _modified_in_place(ctx, name)
                if changed:
                    yield Skip(name, class_key(mod), Reason(
                        ReasonCode.IN_PLACE, f"{kind}: its output is modified in place by {changed}, so a backward "
                        "computed from that output cannot keep it (left as it is)", changed))
                else:
                    yield OutputActSwap(name, class_key(mod), kind, predicted_output_act_bytes(ctx, name))
                continue
            why = unconverted_activation(mod)
            if why is not None:
                yield Skip(name, class_key(mod), Reason(ReasonCode.ACTIVATION, why))


#: activations whose derivative is a function of their output, by the kind the ops layer knows them as: the
#: exact forward a module must reproduce (bit for bit) to be swapped for the one whose backward keeps only y
OUTPUT_BEHAVIOURS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu2": lambda x: torch.square(torch.relu(x)),  # d/dx = 2·relu(x) = 2·√y
}
_SPECIALS = (float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-30, 1e20, -1e20)


def output_activation_kind(ctx: MatchContext, name: str, mod: nn.Module, checked: dict) -> str | None:
    """The `OUTPUT_BEHAVIOURS` kind ``mod`` computes, or None. Candidates: leaf modules without parameters or
    buffers that the trace ran on one tensor, returning one of the same shape. By behaviour, on a copy: the
    same values bit for bit as the kind's forward, in fp32 and bf16, on ordinary, special (NaN, ±inf, ±0) and
    extreme values, in eval and in train mode (code the trace does not run, such as a train-only branch)."""
    if (next(mod.children(), None) is not None or next(mod.parameters(), None) is not None
            or next(mod.buffers(), None) is not None or not _elementwise_calls(ctx, name)):
        return None
    key = behaviour_key(mod, None, None)
    if key is not None and key in checked:
        return checked[key]
    kind = next((k for k, ref in OUTPUT_BEHAVIOURS.items() if _computes(mod, ref)), None)
    if key is not None:
        checked[key] = kind
    return kind


#: the most traced ops a call may run to be a candidate (squared ReLU runs two)
_MAX_OPS = 8


def _elementwise_calls(ctx: MatchContext, name: str) -> bool:
    """Every traced call of ``name`` takes one tensor and returns one of its shape, running a few torch ops and
    no module: only such a module is run again for the behaviour check (nothing that may talk to other ranks or
    touch state)."""
    calls = [s for s in ctx.g.scopes if s.module == name]
    if not calls or not all(len(s.args) == 1 and len(s.outputs) == 1 and
                            ctx.g.tensors[s.outputs[0]].shape == ctx.g.tensors[next(iter(s.args))].shape
                            for s in calls):
        return False
    idx = {s.idx for s in calls}
    inner = [n for n in ctx.g.nodes if idx & set(n.scopes)]
    return 0 < len(inner) <= _MAX_OPS * len(calls) and all(
        n.callee == "op" and n.target.startswith("torch.") and ".distributed" not in n.target for n in inner)


def _computes(mod: nn.Module, ref: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    x = torch.cat([torch.linspace(-6.0, 6.0, 57), torch.tensor(_SPECIALS)]).reshape(1, 5, 13)
    try:
        probe = copy.deepcopy(mod)
    except Exception:  # noqa: BLE001 - a module that cannot be copied is not checked, so not swapped
        return False
    for dtype in (torch.float32, torch.bfloat16):
        xt = x.to(dtype)
        want = ref(xt)
        for train in (False, True):
            probe.train(train)
            try:
                with torch.no_grad(), torch.random.fork_rng(devices=[]):
                    got = probe(xt.clone())
            except Exception:  # noqa: BLE001 - not a tensor-in tensor-out activation
                return False
            if not (isinstance(got, torch.Tensor) and got.dtype == dtype and got.shape == xt.shape
                    and torch.equal(torch.isnan(got), torch.isnan(want))
                    and torch.equal(torch.nan_to_num(got, 0.0), torch.nan_to_num(want, 0.0))):
                return False
    return True


def _modified_in_place(ctx: MatchContext, name: str) -> str | None:
    """What changes the module's output in place (an ``x.mul_``, a ``Dropout(inplace=True)``), if anything: the
    swapped activation keeps that output for its backward, and autograd refuses a modified saved tensor."""
    for s in (s for s in ctx.g.scopes if s.module == name):
        for c in ctx.g.consumers(s.outputs[0]):
            if c.info.get("inplace") or (c.callee == "module" and getattr(ctx.modules.get(c.target), "inplace", False)):
                return c.target
    return None


def predicted_output_act_bytes(ctx: MatchContext, name: str) -> int:
    """Unfused, squared ReLU keeps relu(x) (its relu and square both save it) besides the output the next
    Linear keeps; swapped, it keeps only that output. Where no Linear reads the output directly, the swap keeps
    the output instead of relu(x): as many bytes."""
    saved = 0
    for s in (s for s in ctx.g.scopes if s.module == name):
        out = s.outputs[0]
        if any(c.callee == "module" and ctx.roles.get(c.target) is not None
               and ctx.roles[c.target].plays is ModuleRole.LINEAR for c in ctx.g.consumers(out)):
            saved += tensor_bytes(ctx.g, out)[1]
    return saved


def unconverted_activation(mod: nn.Module) -> str | None:
    """Why an activation module without an approximate-backprop kind stays as it is; None when ``mod`` is not an
    elementwise activation (a container, a module with parameters, softmax, attention)."""
    if (not type(mod).__module__.startswith(_ACTIVATION_MODULES) or next(mod.children(), None) is not None
            or next(mod.parameters(), None) is not None):
        return None
    x = torch.linspace(-4.0, 4.0, 16).reshape(2, 8).requires_grad_()
    saved: list[torch.Tensor] = []
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = mod(x)
        with torch.no_grad():
            elementwise = isinstance(y, torch.Tensor) and y.shape == x.shape and torch.allclose(
                mod(x[:1, :4].detach()), y[:1, :4].detach(), atol=1e-4)
    except Exception:  # noqa: BLE001 - not a plain tensor-in tensor-out activation
        return None
    if not elementwise:
        return None
    if saved and all(t.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for t in saved):
        return ("no approximate-backprop kind (those are GELU/SiLU-family); its backward reads only its output, "
                "which a following Linear usually keeps anyway: nothing of its own to shrink")
    return "no approximate-backprop kind for this activation (those are GELU/SiLU-family): its input stays kept"


def predicted_act_bytes(ctx: MatchContext, name: str) -> int:
    """Each call's input is kept as a ``bits``-bit code instead of in full."""
    saved = 0
    for node in ctx.g.module_nodes(name):
        if node.inputs:
            n, nbytes = tensor_bytes(ctx.g, node.inputs[0])
            saved += nbytes - code_bytes(n, ctx.opt.bits)
    return saved
