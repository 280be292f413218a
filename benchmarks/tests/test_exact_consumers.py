"""benchmarks.exact_consumers: its parser and one run (timm BEiT: F.linear on qkv.weight with a bias assembled
in forward), where the exact default keeps no more bytes than the fold in any mode and nothing is inexact."""
from __future__ import annotations

import pytest

from benchmarks import exact_consumers as B


def test_help_names_the_module(capsys):
    with pytest.raises(SystemExit) as exc:
        B.parse_args(["--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m benchmarks.exact_consumers")


def test_beit_exact_keeps_the_folds_bytes():
    pytest.importorskip("timm")
    (r,) = B.main(["--families", "timm_beit"])
    assert r["fold_verified"] and r["exact_verified"] and r["fold_inexact"] and not r["exact_inexact"]
    for mode in B.MODES:
        assert r["exact"][mode] <= r["fold"][mode] < r["original"][mode], (mode, r)
