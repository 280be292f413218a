"""benchmarks.consumers: its parser and one run on the pre-LN nn.TransformerEncoder (MHA in_proj)."""
from __future__ import annotations

import pytest

from benchmarks import consumers as B


def test_help_names_the_module(capsys):
    with pytest.raises(SystemExit) as exc:
        B.parse_args(["--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m benchmarks.consumers")


def test_transformer_encoder_row_saves_more_with_consumer_folds():
    (r,) = B.main(["--models", "transformer_encoder"])
    assert r["consumer_folds"] == 2 and r["after_verified"] and r["before_verified"] and r["exact_verified"]
    for mode in B.MODES:
        assert r["after"][mode] < r["before"][mode] < r["original"][mode]
        assert r["exact"][mode] <= r["after"][mode]  # the exact default keeps no more than the fold
