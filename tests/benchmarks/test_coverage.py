"""benchmarks.coverage: every registry family converts with a plain convert(model) and verifies."""
import pytest

from benchmarks import coverage

#: family → substring of the error (or "verification: <status>") it shows today; empty while all pass.
EXPECTED_FAILURES: dict[str, str] = {}


def _check(name: str, row: dict) -> None:
    if name in EXPECTED_FAILURES:
        got = row["error"] or f"verification: {row['verification']}"
        assert EXPECTED_FAILURES[name] in got, (name, got)
        return
    assert row["error"] is None, (name, row["error"])
    assert row["verification"] == "passed", (name, row["verification"])
    assert row["saved"] > 0, (name, row["saved"])


def test_smoke_two_families_fp32():
    res = coverage.run(["llama", "bert"], ["fp32"])
    for name, per in res.items():
        _check(name, per["fp32"])
    md = coverage.table(res, ["fp32"])
    assert "| llama | decoder |" in md and "| bert | encoder |" in md


def test_registry_meets_issue_counts():
    names = set(coverage.registry())
    groups = {g: [n for n in names if coverage.group_of(n) == g] for g in coverage.GROUPS}
    assert "other" not in {coverage.group_of(n) for n in names}
    assert len(names) >= 50 and len(groups["MoE"]) >= 4 and len(groups["enc-dec"]) >= 4
    assert len(groups["speech"]) >= 2


@pytest.mark.slow
def test_every_family_converts_and_verifies_fp32():
    res = coverage.run(list(coverage.registry()), ["fp32"])
    for name, per in res.items():
        _check(name, per["fp32"])
