"""The one error type of the checkpoint converter: a bad input, told in one line (an ``LmbpError``)."""
from __future__ import annotations

from ..errors import LmbpError


class CheckpointError(LmbpError):
    """A bad input or an impossible request. The message is one line, meant for the user as is.

    Raised before anything is written, or while writing the temporary DST (which is then removed): SRC is never
    touched and no partial DST is left behind.
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))
