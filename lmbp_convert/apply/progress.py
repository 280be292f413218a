"""convert()'s progress line: one tqdm bar on stderr naming the phase it is in (probe, plan, verify, measure).

A conversion of a tiny model takes a fraction of a second and prints nothing; a 7B one takes long enough to look
hung. The bar appears only once the call has run `DELAY` seconds (tqdm's ``delay``; with ``progress=True`` at
once, ``progress=False`` never) and is cleared when the call ends. tqdm shows a bar only at an update, so each
phase boundary (and each verification input) is one.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["DELAY", "Progress"]

#: seconds a call runs before its bar appears (``progress=None``, the default)
DELAY = 2.0


class Progress:
    """The bar of one convert() / plan_conversion() call over ``steps`` (phase names, in order; a phase may come
    back, e.g. verify around the measurement before the rewrites)."""

    def __init__(self, setting: bool | None, steps: Sequence[str], what: str = "convert()") -> None:
        from tqdm import tqdm

        self.steps = list(steps)
        self.done = 0
        self.current = ""
        # miniters and mininterval 0: each of the few updates shows (tqdm's defaults skip updates made within 0.1 s
        # of the last, or that add fewer steps than it has come to expect)
        self.bar = tqdm(total=len(self.steps), desc=f"lmbp-convert: {what}", delay=0 if setting else DELAY,
                        mininterval=0, miniters=0, disable=setting is False, leave=False,
                        bar_format="{desc}{postfix} [{n}/{total}, {elapsed}]")

    def phase(self, name: str) -> None:
        """The next step is ``name`` (shown at once where the bar is showing, or due to show)."""
        self.current = name
        self.bar.set_postfix_str(f"{name}…", refresh=False)
        self.bar.update(1 if self.done else 0)  # an update, not refresh(): it honours the delay
        self.done += 1

    def tick(self, what: str) -> None:
        """Within a phase: ``what`` is under way (a verification input)."""
        self.bar.set_postfix_str(f"{self.current}: {what}…" if self.current else f"{what}…", refresh=False)
        self.bar.update(0)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
