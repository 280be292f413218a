"""The demo the README's first command runs (`python -m lmbp_convert.demo`): its printed figures are measured, and
the figure docs/benchmarks.md quotes for it is the one it prints today (issue 22, item 8: the headline demo figure
was untested)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmbp_convert import demo

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


@pytest.mark.slow
def test_demo_prints_the_documented_saving(capsys):
    demo.main(["--seq", "256", "--batch", "4"])
    out = capsys.readouterr().out
    before = float(re.search(r"original :\s+([\d.]+) MiB", out).group(1))
    after, pct = (float(v) for v in re.search(r"converted:\s+([\d.]+) MiB\s+\(([\d.]+) % less\)", out).groups())
    assert 0 < after < before and pct == round(100 * (1 - after / before), 1)
    assert "one training step done, loss" in out
    quoted = re.search(r"on the demo model\n?\s*\(4-layer LLaMA shape, batch 4 × 256 tokens, fp32\): ([\d.]+) MiB → "
                       r"([\d.]+) MiB, \*\*([\d.]+) % less\*\*", DOC.read_text())
    assert quoted, "docs/benchmarks.md no longer quotes the demo's figure in the form this test reads"
    assert tuple(float(v) for v in quoted.groups()) == (round(before, 1), round(after, 1), pct)
