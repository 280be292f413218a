"""benchmarks.loss at smoke size: runs, and its exact figures are the closed forms (HF keeps an fp32 (N, V)
log-softmax, the memory-sharing loss the logits themselves and an fp32 lse per row)."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers.loss.loss_utils", reason="transformers < 4.46 has no loss functions")


def test_tiny_run_has_the_closed_form_bytes(tmp_path):
    from benchmarks import loss as L

    data = L.run(tokens=32, vocab=50, hidden=8, repeats=1, json_path=str(tmp_path / "loss.json"))
    rows = {(r["dtype"], r["setup"]): r for r in data["rows"]}
    assert set(rows) == {(d, s) for d in L.DTYPES for s in L.SETUPS}
    n, v = 32, 50
    labels = (n + 1) * 8 + 4  # the shifted labels (a view of the padded storage) and the mean's divisor
    for dtype, isz in (("bf16", 2), ("fp32", 4)):
        r = rows[(dtype, "loss")]
        assert r["saved_hf"] == n * v * 4 + labels
        assert r["saved_ms"] == n * v * isz + n * 4 + labels
        assert r["peak_ms"] < r["peak_hf"]
        assert r["loss_rel_err"] < 1e-6 and r["grad_err_eps"] <= 3
    assert "| bf16 | loss |" in L.table(data)


def test_tiny_checkpointed_model_row():
    """The whole checkpointed LLaMA step, HF's loss against the converted one: same loss, a lower peak."""
    import torch

    from benchmarks import loss as L

    torch.set_num_threads(1)
    row = L.model_rows(tokens=128, vocab=2000, hidden=32, layers=1, repeats=1)  # the loss holds the peak
    assert row["loss_rel_err"] < 1e-5
    assert row["peak_ms"] < row["peak_hf"]
    assert "llama 1L + ckpt" in L.model_table(row)
