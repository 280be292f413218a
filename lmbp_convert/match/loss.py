"""LM-head losses found by behaviour: a `LossSwap` item where the model computes cross-entropy on its head's
logits through ``loss_function``, the one hook transformers (≥ 4.46) lets an instance set.

HF's loss functions upcast the logits to fp32 before ``F.cross_entropy``, so a bf16 model keeps an fp32 copy of
every logit (``log_softmax``'s output) for backward and makes fp32 and bf16 gradients. The matcher runs the probe
once more with ``labels`` (no grad, eval mode), with a recorder in place of each settable ``loss_function``, and
plans a swap where the forward called it on a per-token head's logits (≥ 3-D: a batch of sequences of class
scores). What the original computes is then checked numerically, not read from its name: replayed the way the
forward called it, on random fp32 logits of the probe's shape with some targets ignored, with and without
``num_items_in_batch``, another ``ignore_index`` and ``shift_labels``, it must equal the fp32 cross-entropy of
either HF's causal form (labels shifted left by one) or the flat form (masked LM, token classification). The unit
builder (`lmbp_convert.apply.rewrite`) then checks the memory-sharing loss against the original on the same
calls before anything changes. Anything else — no hook (transformers 4.45), a loss the forward computes in its
own code (BART, T5: ``nn.CrossEntropyLoss`` inside ``forward``), a per-sequence head, another loss, a
``loss_function`` set on the instance (the user's: only the class's own default is replaced, whatever a check
call would say of the user's) — is a skip with the reason; the model's own loss is then left as it is. A head
whose ``forward`` is set on the instance keeps the plain path (a skip of the head; the loss is still swapped).
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..catalogue import class_key
from ..reasons import Reason, ReasonCode
from ..enums import ConvertedCallable
from ..trace.containers import children
from ..trace.device import training_mode
from .context import MatchContext
from .plan import PlanItem, Skip

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
#: the placeholders a recorded call keeps in place of the tensors and the config it was given
LOGITS, LABELS, CONFIG = "@logits", "@labels", "@config"
_RTOL = 1e-5  # fp32 against fp32: only the order of the sums differs


@dataclass
class LossSwap(PlanItem):
    """A module whose forward computes cross-entropy on its head's logits through ``loss_function``: that instance
    attribute is set to the memory-sharing loss (`lmbp_convert.nn.loss.MSCrossEntropyLoss`), undone by restoring
    the attribute; no module, parameter or state-dict key changes."""

    tag = "loss_swaps"
    noun = "losses"
    noun_one = "loss"
    heading = "cross-entropy on the head's logits → memory-sharing loss (no fp32 copy of the logits)"
    #: it runs when the forward calls ``loss_function``; a trainer computing its own loss never does (TRL's)
    called_as = "loss_function"

    shift: bool = False  # HF's causal form (labels shifted left by one), else the flat one
    classes: int = 0  # the logits' last dim
    logits_dtype: str = "float32"
    #: how the forward called loss_function: positional and keyword arguments, tensors and the config as
    #: placeholders (`LOGITS`, `LABELS`, `CONFIG`), plain values as they were
    call: dict = field(default_factory=dict)
    predicted_saved_bytes: int = 0
    #: the plain ``nn.Linear`` whose output is those logits (it becomes `lmbp_convert.nn.loss.MSLogitsHead`, whose
    #: backward makes the loss's gradient by rows); "" when the logits are not a Linear's output as they are
    head: str = ""

    def claims(self) -> set[str]:
        return set()  # sets an attribute; takes no module from other rewrites

    def describe(self) -> list[str]:
        form = "causal (labels shifted)" if self.shift else "flat"
        head = f"; its gradient made by rows in {self.head}'s backward" if self.head else ""
        return [f"  {self.name or '<model>'} ({self.cls.split(':')[-1]}): {form} cross-entropy over {self.classes} "
                f"classes on {self.logits_dtype} logits{head}"]


def _settable_hook(mod: nn.Module) -> bool:
    prop = inspect.getattr_static(type(mod), "loss_function", None)
    return isinstance(prop, property) and prop.fset is not None


def users_loss(mod: nn.Module) -> Any:
    """The ``loss_function`` a user set on this instance, or None where it is the class's own default.

    transformers' property returns the instance's ``_loss_function`` where there is one (its setter stores it;
    transformers never sets it itself), else the default for the model's loss type. Only that default is the loss
    the class installs: anything set on the instance (a function of the user's, a wrapper of the default that
    masks a pad id, which no check call need draw) is the user's and stays. The default object itself set back on
    the instance is the default."""
    if "_loss_function" not in vars(mod):
        return None
    own = vars(mod).pop("_loss_function")
    try:
        default = mod.loss_function
    except Exception:  # noqa: BLE001 - no default without it: what is set is the user's
        default = None
    finally:
        vars(mod)["_loss_function"] = own
    return None if own is default else own


def _takes_labels(mod: nn.Module) -> bool | None:
    """True: its forward names ``labels``; None: it takes ``**kwargs`` (a wrapper may pass them on); False."""
    try:
        params = inspect.signature(mod.forward).parameters
    except (TypeError, ValueError):
        return False
    if "labels" in params:
        return True
    return None if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) else False


@contextmanager
def _recorders(mods: dict[str, nn.Module]) -> Iterator[dict[str, "_Recorder"]]:
    """Each module's ``loss_function`` replaced by a recorder calling the original; attributes and the configs
    (HF's sequence-classification loss writes ``config.problem_type``) are put back exactly afterwards.

    The original is looked up when the forward calls it, not before: transformers' ``loss_function`` property
    warns (``loss_type=None ... is unrecognized``) when read on a module without a loss type, such as the base
    model inside a causal LM, whose forward never calls it; a plain forward never reads it there either."""
    saved = {n: ("_loss_function" in m.__dict__, m.__dict__.get("_loss_function")) for n, m in mods.items()}
    configs = {id(c): (c, dict(vars(c))) for m in mods.values() if hasattr(c := getattr(m, "config", None),
                                                                           "__dict__")}
    recs = {}
    try:
        for n, m in mods.items():
            had, own = saved[n]
            recs[n] = _Recorder((lambda own=own: own) if had else (lambda m=m: _class_default(m)))
            m.loss_function = recs[n]
        yield recs
    finally:
        for n, m in mods.items():
            had, old = saved[n]
            m.__dict__.pop("_loss_function", None)
            if had:
                m.__dict__["_loss_function"] = old
        for cfg, state in configs.values():
            now = vars(cfg)
            for k in [k for k in now if k not in state]:
                del now[k]
            now.update(state)


def _class_default(mod: nn.Module) -> Callable:
    """The ``loss_function`` the class's property gives ``mod`` without an instance attribute (the recorder set there
    is taken off while the property is read, then put back)."""
    mine = vars(mod).pop("_loss_function", None)
    try:
        return mod.loss_function
    finally:
        if mine is not None:
            vars(mod)["_loss_function"] = mine


class _Recorder:
    """Calls the original ``loss_function`` (``lookup()`` gives it, at the first call) and records each call."""

    def __init__(self, lookup: Callable[[], Callable]) -> None:
        self.lookup = lookup
        self.fn: Callable | None = None
        self.calls: list[tuple[tuple, dict, Any]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fn is None:
            self.fn = self.lookup()
        out = self.fn(*args, **kwargs)
        self.calls.append((args, kwargs, out))
        return out


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    else:
        for _, v in children(obj):
            yield from _tensors(v)


def _run_with_labels(model: nn.Module, probe: Any, labels: torch.Tensor) -> Any:
    with torch.no_grad(), training_mode(model, False):
        if isinstance(probe, dict):  # a probe with its own labels: the check's labels stand in for them
            return model(**{**probe, "labels": labels})
        if isinstance(probe, (list, tuple)):
            return model(*probe, labels=labels)
        return model(probe, labels=labels)


def _logits_candidates(ctx: MatchContext) -> list[tuple[list[int], str]]:
    """(shape, dtype) of the model's floating-point outputs with a class dim and ≥ 2 leading dims, in output
    order: the labels of a per-token head have the logits' leading shape."""
    out = []
    for tid in ctx.g.root_outputs:
        info = ctx.g.tensors[tid]
        if info.dtype in _ITEMSIZE and len(info.shape) >= 3 and (list(info.shape), info.dtype) not in out:
            out.append((list(info.shape), info.dtype))
    return out


def _device(probe: Any, model: nn.Module) -> torch.device:
    t = next(_tensors(probe), None)
    if t is not None:
        return t.device
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _placeholder(v: Any, logits: torch.Tensor, labels: torch.Tensor, config: Any) -> Any:
    """A recorded argument as plain data; raises ValueError for one a replay cannot rebuild."""
    if v is logits:
        return LOGITS
    if isinstance(v, torch.Tensor) and v.shape == labels.shape and not v.is_floating_point() and \
            bool(torch.equal(v.cpu(), labels.cpu())):
        return LABELS  # the labels given (moved to the logits' device by the forward)
    if config is not None and v is config:
        return CONFIG
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise ValueError(f"passes a {type(v).__name__} the check cannot rebuild")


def example(shape: list[int], classes: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random fp32 logits of ``shape`` (wide enough that a wrong target or shift shows) and int64 labels of its
    leading shape, about a quarter of them -100."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(shape, generator=gen) * 3
    labels = torch.randint(0, classes, shape[:-1], generator=gen)
    labels[torch.rand(shape[:-1], generator=gen) < 0.25] = -100
    return logits, labels


def variants(shape: list[int], classes: int, labels: torch.Tensor) -> list[tuple[torch.Tensor, dict]]:
    """(labels, extra keyword arguments) of each check call: as given; with ``num_items_in_batch`` (a tensor, as
    HF's Trainer passes it, that is not the count of kept targets); with ``ignore_index=0`` on labels whose -100
    became 0; with ``shift_labels``."""
    gen = torch.Generator().manual_seed(1)
    shifted = torch.randint(0, classes, shape[:-1], generator=gen)
    shifted[..., -1] = -100
    kept = int((labels != -100).sum())
    return [(labels, {}), (labels, {"num_items_in_batch": torch.tensor(kept + 3)}),
            (labels.clamp(min=0), {"ignore_index": 0}), (labels, {"shift_labels": shifted})]


def replay(fn: Callable, call: dict, logits: torch.Tensor, labels: torch.Tensor, config: Any, extra: dict) -> Any:
    """``fn`` called the way the forward called ``loss_function``, with these logits and labels and ``extra``
    keyword arguments."""
    def real(v):
        return logits if v == LOGITS else labels if v == LABELS else config if v == CONFIG else v

    kwargs = {k: real(v) for k, v in call.get("kwargs", {}).items()}
    kwargs.update(extra)
    return fn(*[real(v) for v in call.get("args", [])], **kwargs)


def reference(shift: bool, logits: torch.Tensor, labels: torch.Tensor, classes: int,
              num_items_in_batch: Any = None, ignore_index: int = -100, shift_labels: Any = None,
              **_: Any) -> torch.Tensor:
    """The fp32 cross-entropy the two forms compute (the oracle the original is compared with)."""
    if shift and shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = (shift_labels if shift else labels).reshape(-1)
    x = logits.float().reshape(-1, classes)
    if num_items_in_batch is None:
        return F.cross_entropy(x, targets, ignore_index=ignore_index)
    return F.cross_entropy(x, targets, ignore_index=ignore_index, reduction="sum") / num_items_in_batch


def close(a: Any, b: torch.Tensor, rtol: float = _RTOL) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and bool(
        torch.isclose(a.detach().double(), b.detach().double(), rtol=rtol, atol=rtol).all())


def semantics(fn: Callable, call: dict, shape: list[int], classes: int, config: Any) -> bool | None:
    """True (causal form) / False (flat form) when ``fn`` replayed as recorded equals that form's fp32
    cross-entropy on every check call, None when neither."""
    logits, labels = example(shape, classes)
    with torch.no_grad():
        try:
            got = [replay(fn, call, logits, lab, config, ex) for lab, ex in variants(shape, classes, labels)]
        except Exception:  # noqa: BLE001 - it does not take HF's arguments: not a loss this reproduces
            return None
        for shift in (True, False):
            refs = [reference(shift, logits, lab, classes, **ex) for lab, ex in variants(shape, classes, labels)]
            if all(close(g, r) for g, r in zip(got, refs)):
                return shift
    return None


def _loss_reason(text: str) -> Reason:
    return Reason(ReasonCode.LOSS, text)


def match_losses(ctx: MatchContext) -> Iterator[LossSwap | Skip]:
    """The matcher (declared in `lmbp_convert.rewrites`): at most one item per module whose forward called its
    ``loss_function`` on the labelled probe."""
    model = ctx.model
    takes = _takes_labels(model)
    if not ctx.opt.loss or ctx.probe is None or takes is False or not ctx.opt.selected(""):
        return
    root = class_key(model)
    hooks = {n: m for n, m in ctx.modules.items() if _settable_hook(m) and ctx.opt.selected(n)}
    if not hooks:
        if takes:  # only said of a forward that names labels: a plain **kwargs is no sign of a loss
            yield Skip("", root, _loss_reason("computes its own loss from labels, but has no loss_function an "
                                              "instance can set (transformers < 4.46): the loss is left as it is"))
        return
    if not takes and not any(_takes_labels(m) for m in hooks.values()):
        return  # a wrapper's **kwargs over models that take no labels (a base model): no loss anywhere
    if any(isinstance(m.__dict__.get("_loss_function"), ConvertedCallable) for m in hooks.values()):
        return  # already converted
    if any(p.device.type == "meta" for p in model.parameters()):
        yield Skip("", root, _loss_reason("meta device: the loss cannot be checked without weights, so it is left "
                                          "as it is"))
        return
    found = _labelled_call(ctx, hooks)
    if isinstance(found, str):
        yield Skip("", root, _loss_reason(found))
        return
    name, call, logits, config, head = found
    mod = hooks[name]
    own = users_loss(mod)
    if own is not None:
        yield Skip(name, class_key(mod), Reason(ReasonCode.USERS_OWN, f"its loss_function ({_label(own)}) was set "
                                                "on the instance, not the class's default: the user's loss is kept "
                                                "as it is"))
        return
    if head and "forward" in vars(ctx.modules[head]):
        yield Skip(head, class_key(ctx.modules[head]), Reason(
            ReasonCode.USERS_OWN, "its forward is set on the instance (the user's, or a wrapper such as accelerate's "
                                  "hooks), which the memory-sharing head would not run: the head is left as it is and "
                                  "the loss writes its whole gradient"))
        head = ""
    shape, classes = list(logits.shape), int(logits.shape[-1])
    shift = semantics(mod.loss_function, call, shape, classes, config)
    if shift is None:
        yield Skip(name, class_key(mod), _loss_reason(f"its loss_function ({_label(mod.loss_function)}) is not "
                                                      "HF's causal or flat cross-entropy on a check call: left as it "
                                                      "is"))
        return
    dtype = str(logits.dtype).replace("torch.", "")
    rows = logits.numel() // classes
    isz = _ITEMSIZE.get(dtype, 4)
    # HF keeps log_softmax's fp32 (rows, V); this keeps the logits themselves and an fp32 lse per row
    saved = rows * classes * (4 - isz) - 4 * rows
    yield LossSwap(name, class_key(mod), shift, classes, dtype, call, saved, head)


def _labelled_call(ctx: MatchContext, hooks: dict[str, nn.Module]):
    """(module name, recorded call, its logits, its config) of the one loss_function the labelled probe
    forward calls on a per-token head's logits, or the reason there is none."""
    candidates = _logits_candidates(ctx)
    if not candidates:
        return "no output with a class dim over a batch of sequences (a per-token head): nothing V-sized to share"
    dev = _device(ctx.probe, ctx.model)
    own = "its forward computes the loss in its own code, not through loss_function (nothing an instance can " \
          "set): left as it is"
    why = own
    for shape, _ in candidates:
        gen = torch.Generator().manual_seed(0)
        labels = torch.randint(0, shape[-1], shape[:-1], generator=gen).to(dev)
        with _recorders(hooks) as recs, _head_outputs(ctx) as heads:
            try:
                _run_with_labels(ctx.model, ctx.probe, labels)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 - these labels do not fit this model: try the next output
                why = f"the probe forward with labels failed ({type(exc).__name__}: {exc}): the loss is left as it is"
                continue
        called = [(n, r.calls[0]) for n, r in recs.items() if r.calls]
        if not called:  # the labels fitted (no error) and still no call: other shapes would not change that
            return own
        name, (args, kwargs, _) = called[-1]  # the innermost model's: wrappers call through
        logits = kwargs.get("logits", args[0] if args else None)
        if not isinstance(logits, torch.Tensor) or logits.dim() < 3 or not logits.is_floating_point():
            return "loss_function is not called on a per-token head's logits: left as it is"
        config = getattr(hooks[name], "config", None)
        try:
            call = {"args": [_placeholder(a, logits, labels, config) for a in args],
                    "kwargs": {k: _placeholder(v, logits, labels, config) for k, v in kwargs.items()}}
        except ValueError as exc:
            return f"its forward calls loss_function with an argument the check cannot rebuild ({exc}): left as it is"
        if LOGITS not in call["args"] + list(call["kwargs"].values()) or \
                LABELS not in call["args"] + list(call["kwargs"].values()):
            return "its forward does not pass loss_function the logits and the labels: left as it is"
        head = next((n for n, out in heads if out is logits), "")
        return name, call, logits, config, head
    return why


@contextmanager
def _head_outputs(ctx: MatchContext) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """(name, output) of every call of a selected plain ``nn.Linear`` (not a subclass: its forward is known to be
    ``F.linear``) with real weights, recorded while the block runs."""
    seen: list[tuple[str, torch.Tensor]] = []
    handles = [m.register_forward_hook(lambda _m, _a, out, n=n: seen.append((n, out)))
               for n, m in ctx.modules.items()
               if type(m) is nn.Linear and ctx.opt.selected(n) and m.weight.device.type != "meta"]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _label(fn: Any) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)
