"""The conversion matrix (benchmarks.coverage) against its expectations (benchmarks.coverage_expected): every family
converts with a plain convert(model) in fp32, bf16 and bf16 autocast and verifies; a family saving >= 20 % keeps
its floor; a family under 20 % in a mode shows the documented causes in model.lmbp_report.

A failure names the family and mode and says what changed. To update the expectations after an intended change:
``python -m benchmarks.coverage --suggest --families <names>`` (see benchmarks/coverage_expected.py)."""
import pytest

from benchmarks import coverage
from benchmarks import coverage_expected as E
from testsupport.families import GROUPS, FamilyUnavailable, group_of, registry

#: (family, mode) cells run in the fast loop: each cause and each kind of model at least once (seconds each);
#: the other cells are `slow` (the whole matrix takes minutes on 2 cores)
FAST = {("llama", "bf16"), ("bert", "autocast"), ("bart_classifier", "bf16"), ("mixtral", "autocast"), ("gpt_oss", "fp32"), ("opt", "fp32"),
        ("timm_mixer_160", "fp32"), ("timm_beit", "bf16"), ("timm_hiera_160", "bf16"), ("whisper", "autocast")}
CELLS = [pytest.param(f, m, marks=() if (f, m) in FAST else pytest.mark.slow, id=f"{f}-{m}")
         for f in coverage.ordered() for m in coverage.MODES]


@pytest.mark.parametrize("family, mode", CELLS)
def test_family_converts_verifies_and_saves_or_says_why(family, mode):
    row = coverage.measure(registry()[family], mode)
    if (row["error"] or "").startswith(FamilyUnavailable.__name__):  # an older transformers than the matrix's
        pytest.skip(row["error"])
    problems = E.problems(family, mode, row)
    assert not problems, "\n".join(problems)


def test_fast_cells_cover_every_cause_the_matrix_cites():
    causes = {c for f, m in FAST for c in E.EXPECTED[f].why if E.EXPECTED[f].floor(m) < 100 * E.TARGET}
    cited = {c for exp in E.EXPECTED.values() for c in exp.why}
    assert causes == cited, [c.label for c in cited - causes]
    assert cited <= set(E.CAUSES.values())


def test_expectations_name_every_family_and_a_cause_for_every_mode_under_target():
    assert set(E.EXPECTED) == set(registry()), set(E.EXPECTED) ^ set(registry())
    for name, exp in E.EXPECTED.items():
        floors = [exp.floor(m) for m in coverage.MODES]
        assert all(0 <= f <= 100 for f in floors), (name, floors)
        assert bool(exp.why) == (min(floors) < 100 * E.TARGET), (name, floors, exp.why)


def test_matrix_meets_the_issue_counts():
    names = set(registry())
    assert {group_of(n) for n in names} <= set(GROUPS)
    size = {g: len(members) for g, members in GROUPS.items()}
    assert len(names) >= 50 and size["MoE"] >= 4 and size["enc-dec"] >= 4 and size["speech"] >= 2, size


# ------------------------------------------------------------------ the checks themselves, on synthetic rows
def _row(saved, skips=(), error=None, verification="passed"):
    return {"saved": saved, "skips": list(skips), "error": error, "verification": verification}


_POST_LN_SKIP = ("enc.layers.0.norm: output also feeds add in enc.layers.0, and there is no module boundary where "
                 "the affine could be re-applied for it")
_DROPOUT_SKIP = "model.encoder.layers.0.self_attn_layer_norm: blocked: dropout (p=0.1) between the norm and its Linear"
_TABLE = {"dense": E.Expect(40, 40, 40), "postln": E.Expect(10, 25, 10, why=(E.POST_LN,)),
          "mixed": E.Expect(12, 12, 12, why=(E.POST_LN, E.TIED_HEAD))}


def test_a_cell_as_expected_has_no_problem():
    assert E.problems("dense", "fp32", _row(0.41), _TABLE) == []
    assert E.problems("postln", "fp32", _row(0.11, [_POST_LN_SKIP]), _TABLE) == []
    assert E.problems("postln", "bf16", _row(0.26), _TABLE) == []


@pytest.mark.parametrize("name, mode, row, says, updatable", [
    ("dense", "fp32", _row(0.35), "saves 35.0 %, below its floor 40 %", True),
    ("dense", "fp32", _row(None, error="TraceError: boom"), "plain convert(model) failed: TraceError: boom", False),
    ("dense", "fp32", _row(0.41, verification="failed"), "verification 'failed'", False),
    ("postln", "fp32", _row(0.31, [_POST_LN_SKIP]), "now saves 31.0 % (>= 20 %)", True),
    ("postln", "fp32", _row(0.11, ["x: no Linear consumer reachable"]), "no longer shows in-layer post-LN", True),
    ("mixed", "fp32", _row(0.13, [_POST_LN_SKIP]), "no longer shows the final norm feeds a head tied", True),
    ("unknown", "fp32", _row(0.5), "no row in EXPECTED", True),
])
def test_a_changed_cell_says_what_changed_and_how_to_update(name, mode, row, says, updatable):
    got = "\n".join(E.problems(name, mode, row, _TABLE))
    assert says in got, got
    assert ("--suggest --families " + name in got) == updatable, got


def test_nothing_skipped_holds_only_for_an_empty_report():
    assert E.NOTHING_SKIPPED.holds([]) and not E.NOTHING_SKIPPED.holds(["a: b"])


def test_suggest_writes_rows_that_read_back_as_the_measured_expectations():
    res = {"bart": {"fp32": _row(0.114, [_POST_LN_SKIP]), "bf16": _row(0.257, [_POST_LN_SKIP]),
                    "autocast": _row(0.2005, [])},
           "odd": {m: _row(0.05, ["x: something new"]) for m in coverage.MODES}}
    src = coverage.suggest(res)
    rows = eval("{\n" + src + "\n}", dict(vars(E)))  # the source --suggest prints, read back
    assert rows["bart"] == E.Expect(10, 24, 20, why=(E.POST_LN,))
    assert rows["odd"] == E.Expect(4, 4, 4) and "UNKNOWN cause" in src


def test_table_prints_the_documented_cause_the_report_bears_out():
    res = {"bart_classifier": {"fp32": _row(0.114, [_DROPOUT_SKIP])}, "llama": {"fp32": _row(0.48)},
           "t5": {"fp32": _row(0.15, ["x: something new"])}}
    md = coverage.table(res, ["fp32"])
    assert f"| bart_classifier | enc-dec | 11.4 % | passed | {E.DROPOUT.label} |" in md
    assert "| llama | decoder | 48.0 % | passed |  |" in md
    assert "undocumented: x: something new" in md
