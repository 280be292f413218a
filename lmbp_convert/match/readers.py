"""One walk over the readers of a tensor, for the checks that ask "what reads this, past the ops that only hand it
on?" (an MoE product that must reach weight ops only, a norm output some trained Linear keeps, a folded parameter
that must serve one norm alone). The checks differ in what they pass through and in what they accept where the
walk ends; the frontier, the seen set and skipping metadata reads (``.shape``, ``.dtype``) are this walk's.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

from ..trace.graph import Graph, Node
from .commute import is_metadata

#: a tensor id and where the channels of interest are in it (None: the check does not follow an axis)
At = tuple[int, "int | None"]
#: what the walk does at reader ``node`` of ``at``: the tensors it continues into (an empty list: passes over the
#: reader), or None: the walk ends there and yields the reader
Through = Callable[[Node, At], "Iterable[At] | None"]


def end_readers(g: Graph, start: At, through: Through) -> Iterator[tuple[Node, At]]:
    """Every reader where the walk from ``start`` ends (``through`` gave None), with what it reads; each tensor is
    visited once. A generator: a check can stop at the first reader it refuses."""
    frontier, seen = [start], set()
    while frontier:
        at = frontier.pop()
        if at[0] in seen:
            continue
        seen.add(at[0])
        for c in g.consumers(at[0]):
            if is_metadata(c):
                continue
            nxt = through(c, at)
            if nxt is None:
                yield c, at
            else:
                frontier.extend(nxt)
