"""What a conversion did: the plan, plus what verification found. Printable and machine-readable."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .match.plan import Plan


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


@dataclass
class ConversionReport:
    plan: Plan
    verified: bool | None = None  # True: passed; False: failed; None: not run, or cannot verify (see below)
    #: "passed", "failed", "cannot verify" (the original outputs are non-finite everywhere) or "not run"
    verification: str = "not run"
    relative_error: float | None = None  # over the finite outputs; None when nothing finite was compared
    rtol: float | None = None
    rolled_back: list[tuple[str, float]] = field(default_factory=list)  # (unit label, error it caused)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    previous: "ConversionReport | None" = field(default=None, repr=False)  # an earlier convert() of this model

    @property
    def swapped(self) -> list[str]:
        return [a.name for a in self.plan.act_swaps] + [n.name for n in self.plan.norm_folds] + [
            g.name for g in self.plan.gated_mlps]

    @property
    def predicted_saved_bytes_per_unit(self) -> float:
        return self.plan.predicted_saved_bytes / max(1, self.plan.probe_tokens)

    def _verification_line(self) -> str:
        if self.verification == "not run":
            return "verification: not run" + (f" ({self.notes[0]})" if self.notes else "")
        if self.verification == "cannot verify":
            return "verification: CANNOT VERIFY (" + next((n for n in self.notes if "nothing to compare" in n),
                                                         "nothing finite to compare") + ")"
        err = "n/a" if self.relative_error is None else f"{self.relative_error:.2e}"
        line = (f"verification: {'passed' if self.verification == 'passed' else 'FAILED'}; relative output error "
                f"{err} (tolerance {self.rtol:.0e})")
        diff = next((n for n in self.notes if n.startswith("converted outputs differ")), None)
        return line + (f"; {diff}" if diff and self.verification != "passed" else "")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("previous", None)
        d["predicted_saved_bytes"] = self.plan.predicted_saved_bytes
        d["predicted_saved_bytes_per_" + self.plan.probe_unit] = self.predicted_saved_bytes_per_unit
        return d

    def __str__(self) -> str:
        p = self.plan
        lines = [f"lmbp-convert: {len(p.act_swaps)} activations, {len(p.norm_folds)} norms, "
                 f"{len(p.gated_mlps)} gated MLPs converted; {len(p.skips)} skipped"]
        if p.act_swaps:
            kinds: dict[str, int] = {}
            for a in p.act_swaps:
                kinds[f"{a.kind}/{a.bits}-bit"] = kinds.get(f"{a.kind}/{a.bits}-bit", 0) + 1
            lines.append("activations → approx-BP: " + ", ".join(f"{v}× {k}" for k, v in kinds.items()))
            for a in p.act_swaps:
                lines.append(f"  {a.name} ({a.cls.split(':')[-1]} → {a.kind}, {a.bits} bits)")
        if p.norm_folds:
            lines.append("norms → memory-sharing (affine folded into):")
            for n in p.norm_folds:
                into = ", ".join(t.name + (" (+bias)" if t.adds_bias else "") for t in n.targets)
                tag = " [weights already folded]" if n.prefolded else ""
                lines.append(f"  {n.name} [{n.kind}, {n.param}] → {into}{tag}")
                for r in n.reapply:
                    lines.append(f"      affine re-applied at {r.describe()}")
                for c in n.caveats:
                    lines.append(f"      note: {c}")
        if p.gated_mlps:
            lines.append("gated MLPs → memory-sharing fused op:")
            for g in p.gated_mlps:
                lay = g.gate_up if g.gate_up else f"{g.gate}, {g.up}"
                lines.append(f"  {g.name} ({g.act}; {lay} → {g.down})")
        if p.skips:
            lines.append("skipped:")
            for s in p.skips:
                lines.append(f"  {s.name} ({s.cls.split(':')[-1]}): {s.reason}")
        if p.already_converted:
            lines.append(f"already converted: {len(p.already_converted)} modules")
        for label, err in self.rolled_back:
            lines.append(f"rolled back: {label} (changed outputs, relative error {err:.2e})")
        lines.append(self._verification_line())
        lines.append(f"predicted activation memory saved: {fmt_bytes(self.plan.predicted_saved_bytes)} on the "
                     f"probe, {fmt_bytes(self.predicted_saved_bytes_per_unit)} per {p.probe_unit} "
                     "(analytic; exact counts: lmbp_convert.memory.SavedTensorLedger)")
        return "\n".join(lines)
