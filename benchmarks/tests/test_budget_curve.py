"""The budget curve runs end to end on a tiny LLaMA: every fraction gets its number of checkpointed layers, and
checkpointing more lowers both the budget's prediction and the tracked activations of the step."""
from dataclasses import replace

from benchmarks import budget_curve as BC
from benchmarks import step_peak as SP


def test_curve_on_a_tiny_llama():
    cfg = replace(SP.TINY["a"], layers=2)
    data = BC.run(cfg, [0.0, 0.5, 1.0], repeats=1, convert_kwargs={}, log=lambda *_: None)
    pts = {(p["variant"], p["fraction"]): p for p in data["points"]}
    for v in ("original", "converted"):
        none, half, every = pts[v, 0.0], pts[v, 0.5], pts[v, 1.0]
        assert (none["checkpointed"], half["checkpointed"], every["checkpointed"]) == (0, 1, 2)
        assert none["predicted_peak"] > half["predicted_peak"] > every["predicted_peak"]
        assert none["activations"] > every["activations"] and every["ratio_vs_all_checkpointed"] == 1.0
        assert none["ledger_bytes"] <= none["predicted_bytes"]
    assert pts["converted", 0.0]["predicted_peak"] < pts["original", 0.0]["predicted_peak"]
    assert "layers checkpointed" in BC.table(data)
