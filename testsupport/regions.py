"""A shared-saves region opened around a block of test code, as the converted model's forward opens one."""
from __future__ import annotations

import contextlib
from typing import Iterator

from lmbp_convert.ops.shared_saves import SharedSaves


@contextlib.contextmanager
def open_region(enabled: bool = True) -> Iterator[SharedSaves]:
    """Yield a `SharedSaves` region, entered where ``enabled`` (asserting it could enter: no other region open and
    its hooks innermost), left on the way out. With ``enabled=False`` the block runs with no region, the same
    code path as a model whose region could not open."""
    region = SharedSaves()
    if enabled:
        assert region.enter()
    try:
        yield region
    finally:
        region.exit()
