"""Conversion coverage: for every family of the matrix, a plain ``convert(model)`` (no probe) in fp32, bf16 and
bf16 autocast, with its verification and the exact saved-for-backward bytes it saves.

Families: ``testsupport.families.registry()``, the tiny models the tests convert; nothing is downloaded. Bytes: one
training forward on the probe ``make_probe`` builds, counted by ``SavedTensorLedger`` with parameters excluded,
before and after conversion. The "why < 20 %" column prints the documented causes of
``benchmarks.coverage_expected`` that the report bears out (benchmarks/tests/test_coverage.py asserts them).

    python -m benchmarks.coverage --out docs/coverage.md     # the whole table
    python -m benchmarks.coverage --families bart --modes fp32
    python -m benchmarks.coverage --suggest                  # EXPECTED rows for the code as it is now
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
from torch import nn

from benchmarks import common as C
from benchmarks import coverage_expected as E
from testsupport.families import GROUPS, group_of, registry

MODES = ("fp32", "bf16", "autocast")
INTRO = """Each family is a tiny random-init model (`testsupport/families.py`, nothing downloaded) converted with a plain
`convert(model)`: no probe, no options. Each mode's cell is the fraction of saved-for-backward bytes the conversion
saves on one training forward of the automatic probe (`SavedTensorLedger`; parameters and autocast weight copies
excluded; fp32 weights, bf16 weights, fp32 weights under bf16 autocast). "why < 20 %" gives, for a family under
20 % in some mode, the documented causes (`benchmarks/coverage_expected.py`) that `model.lmbp_report` bears out;
benchmarks/tests/test_coverage.py asserts every cell's floor and cause. Tiny widths weigh embeddings, heads and
attention more than full-size models do, so the fractions are not those of the released sizes. ReLU feed-forwards
(OPT, T5 v1.0) are left as they are; the report lists each such activation with why."""


def _call(model: nn.Module, probe):
    if isinstance(probe, dict):
        return model(**probe)
    if isinstance(probe, (tuple, list)):
        return model(*probe)
    return model(probe)


def measure(build: Callable[[], nn.Module], mode: str) -> dict:
    """One family in one mode: {'saved': fraction | None, 'error': str | None, 'verification', 'skips'}."""
    from lmbp_convert import convert
    from lmbp_convert.trace.probe import make_probe

    row: dict = {"saved": None, "error": None, "verification": "", "skips": []}
    try:
        model = build()
        if mode == "bf16":
            model = model.to(torch.bfloat16)
        model.train()
        probe, _, _ = make_probe(model)
        ac = mode == "autocast"

        def fwd(m):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
                return _call(m, probe)

        torch.manual_seed(0)
        before = C.ledger_bytes(lambda: fwd(model), model)
        convert(model)
        rep = model.lmbp_report
        row["verification"] = str(rep.verification.value if hasattr(rep.verification, "value") else rep.verification)
        row["skips"] = [f"{s.name}: {s.reason}" for s in rep.plan.skips]
        model.train()
        torch.manual_seed(0)
        after = C.ledger_bytes(lambda: fwd(model), model)
        row["saved"] = 1 - after / before if before else 0.0
    except Exception as e:  # a row per failure: the table shows it
        row["error"] = C.err(e)
    return row


def run(names: list[str], modes: list[str]) -> dict[str, dict[str, dict]]:
    reg = registry()
    unknown = [n for n in names if n not in reg]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {', '.join(reg)}")
    return {n: {m: measure(reg[n], m) for m in modes} for n in names}


def ordered() -> list[str]:
    """Every family, group by group (GROUPS' order), then any family no group names."""
    grouped = [n for names in GROUPS.values() for n in names]
    return grouped + [n for n in registry() if n not in grouped]


def _low(per: dict[str, dict]) -> list[str]:
    return [m for m, r in per.items() if not r["error"] and r["saved"] < E.TARGET]


def why(name: str, per: dict[str, dict]) -> str:
    """The documented causes of the modes under TARGET (benchmarks.coverage_expected) that the report bears out;
    a report that bears none out shows its first skips, marked undocumented."""
    low = _low(per)
    if not low:
        return ""
    exp = E.EXPECTED.get(name)
    held = [c.label for c in (exp.why if exp else ()) if all(c.holds(per[m]["skips"]) for m in low)]
    if held:
        return "; ".join(held)
    skips = per[low[0]]["skips"]
    return "undocumented: " + ("; ".join(s[:160] for s in skips[:2]) if skips else "no skip")


def table(results: dict[str, dict[str, dict]], modes: list[str]) -> str:
    rows = []
    for name, per in results.items():
        cells = []
        for m in modes:
            r = per[m]
            cells.append(f"error: {r['error'][:160]}" if r["error"] else f"{100 * r['saved']:.1f} %")
        ver = "; ".join(sorted({per[m]["verification"] for m in modes if per[m]["verification"]}))
        rows.append([name, group_of(name), *cells, ver, why(name, per)])
    rows = [[str(c).replace("|", "/") for c in row] for row in rows]
    return C.markdown_table(["family", "group", *modes, "verification", "why < 20 %"], rows)


def suggest(results: dict[str, dict[str, dict]]) -> str:
    """``EXPECTED`` rows (Python source) for the measured figures: floors MARGIN_POINTS below them, the causes of
    the modes under TARGET kept where the report still bears them out, else every known cause it bears out."""
    names = {id(c): n for n, c in E.CAUSES.items()}
    lines = []
    for name, per in results.items():
        errors = {m: r["error"] for m, r in per.items() if r["error"]}
        if errors:
            lines.append(f"    # {name}: convert() failed: {errors}")
            continue
        floors = ", ".join(str(E.floor_for(per[m]["saved"])) for m in MODES)
        low = _low(per)
        exp = E.EXPECTED.get(name)
        causes = [c for c in (exp.why if exp else ()) if all(c.holds(per[m]["skips"]) for m in low)] if low else []
        if low and not causes:
            causes = [c for c in E.CAUSES.values() if all(c.holds(per[m]["skips"]) for m in low)]
        why_src = ""
        if causes:
            why_src = f", why=({', '.join(names[id(c)] for c in causes)}{',' if len(causes) == 1 else ''})"
        note = ""
        if low and not causes:
            note = f"  # UNKNOWN cause ({', '.join(low)} < 20 %); skips: {per[low[0]]['skips']}"
        lines.append(f"    {name!r}: Expect({floors}{why_src}),{note}".replace("'", '"'))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="*", default=None)
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    p.add_argument("--out", default=None, help="write the markdown table here (e.g. docs/coverage.md)")
    p.add_argument("--suggest", action="store_true",
                   help="print rows of benchmarks/coverage_expected.EXPECTED for the figures measured now (all modes), "
                   "instead of the table (--out still writes the table)")
    a = p.parse_args(argv)
    names = a.families or ordered()
    modes = list(MODES) if a.suggest else a.modes
    t0 = time.time()
    res = run(names, modes)
    secs = time.time() - t0
    md = table(res, modes)
    counts = {m: sum(1 for r in res.values() if not r[m]["error"] and r[m]["saved"] >= E.TARGET) for m in modes}
    cmd = "python -m benchmarks.coverage" + (f" --families {' '.join(a.families)}" if a.families else "") + (
        f" --modes {' '.join(modes)}" if modes != list(MODES) else "") + (f" --out {a.out}" if a.out else "")
    head = (f"# Conversion coverage\n\n`{cmd}`\n\n{INTRO}\n\n{C.machine()}; {len(res)} families; saves >= 20 %: "
            + ", ".join(f"{m} {c}" for m, c in counts.items()) + f"; {secs:.0f} s\n\n")
    if a.out:
        with open(a.out, "w") as f:
            f.write(head + md + "\n")
    print(suggest(res) if a.suggest else head + md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
