"""Why a module was not rewritten, as data: one `Reason` (a `ReasonCode`, the module or op it names, the sentence
a person reads) flows from the matchers' walks to the plan's skips, the report and the JSON plan.

Code decides on ``code`` (and ``parts``), never on ``text``: rewording a sentence cannot change behaviour. A
reason made of others (a refusal that names several blocked consumers, "the real cause first") keeps them as
``parts``; its code is its first part's. A leaf: every layer may import it.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterable, Iterator

from .enums import StrChoice


class ReasonCode(StrChoice):
    """What kind of obstacle a reason names (stable strings: the JSON plan's ``code``)."""

    NOT_CALLED = "not_called"  # the probe forward never called it
    SHARED_CALL = "shared_call"  # called more than once per forward
    HOOKED = "hooked"  # a user's hook would see what the rewrite changes
    USERS_OWN = "users_own"  # a callable the rewrite would replace or bypass was set on the instance (the user's)
    SIGNATURE = "signature"  # takes or returns something the rewrite does not (several tensors, another shape)
    IN_PLACE = "in_place"  # a tensor the rewrite shares is modified in place
    NO_CONSUMER = "no_consumer"  # no Linear (or other consumer the rewrite needs) reads its output
    BLOCKING_OP = "blocking_op"  # an op between it and a consumer breaks exactness (dropout, padding, a reshape)
    QUANTIZED_LINEAR = "quantized_linear"  # the consumer's weight is quantized: it cannot be folded
    TIED_WEIGHT = "tied_weight"  # the weight is tied to another (untie=True folds into an untied copy)
    EXCLUDED = "excluded"  # the options exclude it
    LORA_STATE = "lora_state"  # a PEFT adapter's state forbids the fold (DoRA, merged, dropout, trained)
    OWN_WEIGHT = "own_weight"  # a module applies its own weights in a way the fold cannot follow
    FUNCTIONAL_CONSUMER = "functional_consumer"  # an op applying a parameter cannot take the fold
    WEIGHTS = "weights"  # weights that cannot be rewritten (dtype, shape, a secondary argument)
    SHIFT = "shift"  # the norm's β has nowhere to go
    NO_REAPPLY_SITE = "no_reapply_site"  # no module boundary to put the affine back for another reader
    UNSEEN_CONSUMER = "unseen_consumer"  # a consumer only other data would reach cannot take the fold
    PREFOLDED = "prefolded"  # the config's on-disk fold record disagrees with the weights
    BEHAVIOUR = "behaviour"  # it does not behave as the rewrite requires (found by running it)
    BEYOND_PROBE = "beyond_probe"  # acts as a norm on the behaviour probe only (train mode, extreme rows differ)
    SCRIPTED = "scripted"  # TorchScript: its code cannot be traced or hooked
    NO_GAIN = "no_gain"  # the rewrite would save nothing
    ACTIVATION = "activation"  # an activation the approximate swap cannot take
    GATED_MLP = "gated_mlp"  # a gated MLP the fused op cannot take
    LOSS = "loss"  # a loss the memory-sharing one cannot replace
    ON_DISK = "on_disk"  # the checkpoint on disk cannot hold this fold
    DOOR = "door"  # a module a user may call on its own would see a fold's affine-less output (kept exact)
    NO_EXACT_FORM = "no_exact_form"  # the exact default has no form for this fold yet (fold_norms=True folds it)
    ROLLED_BACK = "rolled_back"  # verification rolled the rewrite back (a part, if any, says why beyond outputs)
    BACKWARD_FAILED = "backward_failed"  # training's backward through the rewrite raised (a saved tensor modified)
    GRADIENTS_CHANGED = "gradients_changed"  # a rewrite that claims exact training changed the gradients
    RECORDED = "recorded"  # read from a plan written before reasons had codes


@dataclass(frozen=True)
class Reason:
    """One reason a module was left as it is. ``subject``: the module or op it names ("": the module itself)."""

    code: ReasonCode
    text: str
    subject: str = ""
    parts: tuple["Reason", ...] = ()

    def __str__(self) -> str:
        return self.text

    def codes(self) -> Iterator[ReasonCode]:
        """This reason's code and those of every part, depth first."""
        yield self.code
        for p in self.parts:
            yield from p.codes()

    def to_dict(self) -> dict:
        """``code`` and ``subject`` (the sentence is the caller's ``reason`` key), and ``parts`` where there are."""
        out: dict = {"code": str(self.code), "subject": self.subject}
        if self.parts:
            out["parts"] = [{"reason": p.text, **p.to_dict()} for p in self.parts]
        return out

    @classmethod
    def from_dict(cls, text: str, data: dict) -> "Reason":
        """The inverse of `to_dict` (a plan written before reasons had codes reads back as ``RECORDED``)."""
        parts = tuple(cls.from_dict(p["reason"], p) for p in data.get("parts", ()))
        return cls(ReasonCode(data.get("code", ReasonCode.RECORDED)), text, data.get("subject", ""), parts)


def joined(reasons: Iterable[Reason], sep: str = "; ") -> Reason:
    """Distinct ``reasons`` in order as one (the first one's code and subject)."""
    parts = tuple(dict.fromkeys(reasons))
    if len(parts) == 1:
        return parts[0]
    return Reason(parts[0].code, sep.join(p.text for p in parts), parts[0].subject, parts)


def then(first: Reason, text: str, *rest: Reason) -> Reason:
    """``first`` as the cause, ``text`` the whole sentence that also names ``rest`` (their codes kept as parts)."""
    return Reason(first.code, text, first.subject, (first, *rest))


# -- how options are spelled in a reason: convert()'s keywords, or the CLI's flags ----------------------------
_CLI_SPELLING: ContextVar[bool] = ContextVar("lmbp_cli_spelling", default=False)


def option(name: str) -> str:
    """The on-switch of boolean option ``name`` as the caller spells it: ``untie=True``, or ``--untie`` in the CLI."""
    return f"--{name.replace('_', '-')}" if _CLI_SPELLING.get() else f"{name}=True"


@contextlib.contextmanager
def cli_spelling() -> Iterator[None]:
    """Reasons made inside name options as the CLI's flags (the checkpoint CLI plans through ``convert()``'s
    matchers)."""
    token = _CLI_SPELLING.set(True)
    try:
        yield
    finally:
        _CLI_SPELLING.reset(token)
