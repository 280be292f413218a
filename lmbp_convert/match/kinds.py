"""The rewrite kinds: one declaration per kind (`RewriteKind`) says everything the package needs to know about it —
its plan item class, the matcher that finds its items and the matcher's place, the function that builds its
reversible unit, and how a checkpoint on disk holds it (optional). `register_kind` / `unregister_kind` add and
remove one; every consumer (the planner, ``convert()``, the report, plan files, the checkpoint CLI) reads this
registry and never names a kind.

Matchers run in ascending ``rank`` (ties: registration order), and the order decides two things:

- **which kind wins a module**: an item's ``claims()`` hide those modules from every matcher after it (a fused
  gated MLP, rank 10, claims its activation, so the activation matcher, rank 70, leaves it alone);
- **what happens to a loser's skip**: a later matcher that yields an *item* for a module an earlier matcher
  *skipped* supersedes that skip — the skip leaves the plan (the affine-keeping norm, rank 60, after a refused fold,
  rank 40: its item records the refusal itself, ``NormKeep.fold_refused``). A later matcher's skip never replaces
  an earlier item.

The built-in kinds are declared in one table, `lmbp_convert.rewrites`, which imports every layer (its builders live
in ``apply``, its disk rules in ``checkpoint``); this registry loads it on first use, so ``match`` itself never
imports those layers.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

if TYPE_CHECKING:
    from ..apply.rewrite import Unit, UnitBuilder
    from .context import MatchContext
    from .plan import PlanItem, Skip

#: a matcher: the model's context → the plan items it finds and the skips (with their reasons) it makes
Matcher = Callable[["MatchContext"], Iterable["PlanItem | Skip"]]
#: a unit builder: (the builder of this conversion, one item) → the item's reversible unit
BuildFn = Callable[["UnitBuilder", Any], "Unit"]

#: the matcher rank a kind gets when it names none: after every built-in matcher
LAST = 1000


@dataclass(frozen=True)
class RewriteKind:
    """Everything about one rewrite kind. ``match``: None for a kind whose items another kind's matcher yields
    (`OutputActSwap` comes from the activation matcher) or a post-pass makes (`NormExact`). ``disk``: a
    ``checkpoint.diskplan.DiskRule`` for a kind that rewrites stored weights, else None (the CLI leaves it to
    ``convert()`` at load time)."""

    item: type["PlanItem"]
    build: BuildFn
    match: Matcher | None = None
    rank: int = LAST
    disk: Any = None


_KINDS: dict[type, RewriteKind] = {}  # item class → its declaration, in registration (= report) order
_builtins_loaded = False


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        importlib.import_module("lmbp_convert.rewrites")


def register_kind(kind: RewriteKind) -> RewriteKind:
    """Declare a rewrite kind (its tag must be new, and so must its matcher); returns it."""
    _load_builtins()
    cls = kind.item
    if not cls.tag:
        raise ValueError(f"{cls.__name__} needs a non-empty tag (its section in a serialised plan)")
    clash = next((k for k in _KINDS.values() if k.item.tag == cls.tag), None)
    if clash is not None:
        raise ValueError(f"plan item tag {cls.tag!r} is already used by {clash.item.__qualname__}")
    if kind.match is not None and any(k.match is kind.match for k in _KINDS.values()):
        raise ValueError(f"matcher {kind.match.__qualname__} is already registered for another kind")
    _KINDS[cls] = kind
    return kind


def unregister_kind(item: type["PlanItem"]) -> RewriteKind:
    """Forget the kind of ``item`` (matcher, builder and disk rule with it); returns its declaration."""
    _load_builtins()
    if item not in _KINDS:
        raise KeyError(f"{item.__qualname__} is not a registered rewrite kind")
    return _KINDS.pop(item)


@contextlib.contextmanager
def suspended(*items: type["PlanItem"]) -> Iterator[None]:
    """Without these kinds for a while (a benchmark's or a test's "what would the others do"), then back in their
    places."""
    _load_builtins()
    before = dict(_KINDS)
    for item in items:
        unregister_kind(item)
    try:
        yield
    finally:
        _KINDS.clear()
        _KINDS.update(before)


def rewrite_kinds() -> list[RewriteKind]:
    """Every registered kind, in registration order (the report's and the plan file's section order)."""
    _load_builtins()
    return list(_KINDS.values())


def item_classes() -> list[type["PlanItem"]]:
    return [k.item for k in rewrite_kinds()]


def by_tag(tag: str) -> type["PlanItem"] | None:
    """The item class serialised under ``tag`` (None: no registered kind)."""
    return next((k.item for k in rewrite_kinds() if k.item.tag == tag), None)


def matchers() -> list[Matcher]:
    """The registered matchers, in the order the planner runs them (ascending rank, then registration)."""
    ordered = sorted((k for k in rewrite_kinds() if k.match is not None), key=lambda k: k.rank)
    return [k.match for k in ordered if k.match is not None]


def declared(item: type["PlanItem"], *, exact: bool = False) -> RewriteKind | None:
    """The declaration of ``item``'s kind; unless ``exact``, of its nearest registered base class (a subclass
    reuses its base's builder)."""
    _load_builtins()
    for cls in (item,) if exact else item.__mro__:
        if cls in _KINDS:
            return _KINDS[cls]
    return None
