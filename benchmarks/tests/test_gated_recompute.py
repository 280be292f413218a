"""benchmarks.gated_recompute at tiny sizes: its parser, the byte rows (exact, `SavedTensorLedger`) and one
timed round of the eager speed table."""
from __future__ import annotations

import pytest
import torch

from benchmarks import gated_recompute as G

TINY = ["--tokens", "8", "--hidden", "32", "--inter", "48", "--rank", "2", "--rounds", "1"]


def test_help_names_the_module(capsys):
    with pytest.raises(SystemExit) as exc:
        G.parse_args(["--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m benchmarks.gated_recompute")


def test_byte_rows_at_tiny_sizes():
    """Recomputing h for an unchanged nn.Linear down projection saves what the fused op saves, less than the
    original MLP; a LoRA down projection keeps its T×r input on top (fp32: 8 tokens × r 2 × 4 bytes)."""
    rows = G.bytes_rows(G.parse_args([*TINY, "--downs", "linear", "lora", "--precisions", "fp32"]))
    by = {r["down"]: r for r in rows}
    assert by["linear"]["recompute"] == by["linear"]["fused"] < by["linear"]["original"]
    assert by["lora"]["recompute"] - by["lora"]["fused"] == 8 * 2 * 4


def test_one_tiny_run_prints_both_tables(capsys):
    threads = torch.get_num_threads()
    try:
        assert G.main([*TINY, "--downs", "linear", "--precisions", "fp32", "bf16-autocast"]) == 0
    finally:
        torch.set_num_threads(threads)  # main times on one thread; the rest of the session keeps its own
    out = capsys.readouterr().out
    assert "saved-for-backward bytes (one forward)" in out and "CPU fwd+bwd, 1 thread" in out
    assert "bf16-autocast" in out and "eager" in out
