"""benchmarks.qlora_bytes: the QLoRA flow on CPU with the 4-bit stand-in, end to end (CLI, load, convert, LoRA)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # save_pretrained, the CLI and two loads


def test_qlora_bytes_stand_in_fp32():
    pytest.importorskip("peft")
    from benchmarks.qlora_bytes import measure

    row = measure("fp32", "standin", log=lambda *_: None)
    assert row["report"] == "converted: 5 norms (folded), 2 gated MLPs, 1 loss; 0 skipped", row["report"]
    assert row["ours"] < 0.7 * row["qlora"], row
