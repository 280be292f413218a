"""benchmarks.relu_squared: its parser and one small run (exact bytes: relu(x) no longer kept)."""
from __future__ import annotations

import pytest
import torch

from benchmarks import relu_squared as B


def test_help_names_the_module(capsys):
    with pytest.raises(SystemExit) as exc:
        B.parse_args(["--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m benchmarks.relu_squared")


def test_small_run_saves_exactly_relu_of_x():
    threads = torch.get_num_threads()
    try:
        rows = B.main(["--tokens", "16", "--hidden", "8", "--intermediate", "32", "--repeats", "1", "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)
    assert [r["dtype"] for r in rows] == ["float32", "bfloat16"]
    for r, size in zip(rows, (4, 2)):
        assert r["original_bytes"] - r["converted_bytes"] == 16 * 32 * size  # relu(x)
        assert r["converted_bytes"] == (16 * 8 + 16 * 32) * size  # up's input, down's input (= the act's output)
