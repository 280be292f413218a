"""benchmarks.gated_identity on T5 v1.1 (gated-gelu behind Dropout): its parser and one run at a short probe."""
from __future__ import annotations

import pytest

from benchmarks import gated_identity as G


def test_help_names_the_module(capsys):
    with pytest.raises(SystemExit) as exc:
        G.parse_args(["--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m benchmarks.gated_identity")


@pytest.mark.slow
def test_t5_rows_show_the_gated_swap_saving_bytes():
    """Every row fuses both gated MLPs, and the fused conversion keeps fewer bytes than convert() without the gated
    swap, which keeps fewer than the original (exact ledger bytes)."""
    rows = G.main(["--models", "t5", "--seq", "8"])
    assert [(r["p"], r["dtype"]) for r in rows] == [(0.0, "float32"), (0.0, "bfloat16"), (0.1, "float32"),
                                                    (0.1, "bfloat16")]
    for r in rows:
        assert r["gated_mlps"] == 2
        assert r["full"] < r["no_gated"] < r["original"]
