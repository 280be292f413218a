"""What a conversion did: the plan, plus what verification found. Printable and machine-readable."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from .enums import Verification
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
    #: passed, failed, cannot verify (the original outputs are non-finite everywhere) or not run
    verification: Verification = Verification.NOT_RUN
    relative_error: float | None = None  # over the finite outputs; None when nothing finite was compared
    rtol: float | None = None
    #: the inputs verification compared on: the traced probe, then those the trace did not see
    verified_on: list[str] = field(default_factory=list)
    #: train-mode draws (RNG seeds) of the traced probe verification also compared on (`verify.TRAIN_DRAWS`)
    train_draws: int = 0
    rolled_back: list[tuple[str, float]] = field(default_factory=list)  # (unit label, output error it caused)
    #: unit label → why it was rolled back when its outputs were within tolerance (its backward, its gradients)
    rolled_back_cause: dict[str, str] = field(default_factory=dict)
    train_backward: bool = False  # the first train-mode draw ran a backward too (`apply/train_backward.py`)
    #: relative error of the gradients against the original's on that draw (None: not compared)
    gradient_error: float | None = None
    notes: list[str] = field(default_factory=list)
    mismatch: str = ""  # how the converted outputs differ in structure from the original's ("": they do not)
    unverified_why: str = ""  # why verification could not compare anything ("": it could)
    seconds: float = 0.0
    #: saved-for-backward bytes of one training forward on the probe, (original, converted), by the exact ledger
    measured_bytes: tuple[int, int] | None = None
    measured_mode: str = ""  # what that forward ran in (dtype, autocast, train mode, trainable parameters)
    previous: "ConversionReport | None" = field(default=None, repr=False)  # an earlier convert() of this model
    #: calls of each applied rewrite in a counted stretch of training, {plan tag: {module name: calls}}
    #: (`lmbp_convert.apply.runs.count_runs`; the trainer callback counts the first step); None: not counted
    ran: dict[str, dict[str, int]] | None = None

    @property
    def swapped(self) -> list[str]:
        return [it.name for kind in self.plan.kinds() for it in self.plan.of(kind)]

    @property
    def inexact_training(self) -> dict[str, str]:
        """Rewritten module → why its training differs from the original's (`PlanItem.inexact_training`); the
        rewrites not named here keep the original parameters and their gradients."""
        return {it.name: kind.inexact_training for kind in self.plan.kinds() if kind.inexact_training
                for it in self.plan.of(kind)}

    @property
    def predicted_saved_bytes_per_unit(self) -> float:
        return self.plan.predicted_saved_bytes / max(1, self.plan.probe_tokens)

    @property
    def measured_saved_bytes(self) -> int | None:
        """What the conversion saves on the probe's training forward, measured (None: not measured)."""
        return None if self.measured_bytes is None else self.measured_bytes[0] - self.measured_bytes[1]

    def _measured_line(self) -> str:
        before, after = self.measured_bytes
        share = f" ({(before - after) / before:.1%})" if before else ""
        per = (before - after) / max(1, self.plan.probe_tokens)
        return (f"activation memory saved, measured on the probe: {fmt_bytes(before)} → {fmt_bytes(after)}"
                f"{share}, {fmt_bytes(per)} per {self.plan.probe_unit}; mode: {self.measured_mode}")

    @property
    def never_ran(self) -> list:
        """The applied rewrites that the counted training (`ran`) never called ([] where nothing was counted): in
        place, saving nothing there (a trainer that computes its own loss never calls the memory-sharing one)."""
        if self.ran is None:
            return []
        return [it for it in self.plan.items if not self.ran.get(it.tag, {}).get(it.name, 0)]

    def _ran_line(self) -> str:
        idle = self.never_ran
        idle_ids = {id(it) for it in idle}
        ran = []
        for kind in self.plan.kinds():
            items = self.plan.of(kind)
            hit = sum(1 for it in items if id(it) not in idle_ids)
            if hit:
                ran.append(f"{hit} of {len(items)} {kind.noun}")
        line = "ran in the counted training step: " + (", ".join(ran) or "nothing")
        idle_by = {}
        for it in idle:
            idle_by.setdefault(type(it).noun, []).append(it.name or "<model>")
        never = "; ".join(f"{noun} ({', '.join(names)})" for noun, names in idle_by.items())
        return line + (f"; in place but never called: {never}" if never else "")

    def _verification_line(self) -> str:
        if self.verification is Verification.NOT_RUN:
            return "verification: not run" + (f" ({self.notes[0]})" if self.notes else "")
        if self.verification is Verification.CANNOT_VERIFY:
            return f"verification: CANNOT VERIFY ({self.unverified_why or 'nothing finite to compare'})"
        err = "n/a" if self.relative_error is None else f"{self.relative_error:.2e}"
        passed = self.verification is Verification.PASSED
        on = ""
        if len(self.verified_on) > 1:
            on = f" on {len(self.verified_on)} inputs ({'; '.join(self.verified_on)})"
        elif self.verified_on:
            on = " on the traced probe only"
        if self.train_draws:
            back = ", a backward on the first" if self.train_backward else ""
            on += f", in train mode too ({self.train_draws} RNG draw{'s' if self.train_draws > 1 else ''}{back})"
        line = (f"verification: {'passed' if passed else 'FAILED'}{on}; relative output error "
                f"{err} (tolerance {self.rtol:.0e})")
        if self.gradient_error is not None:
            line += f"; gradients' relative error {self.gradient_error:.2e}"
        return line + (f"; converted outputs differ: {self.mismatch}" if self.mismatch and not passed else "")

    def to_dict(self) -> dict:
        d: dict = {"plan": self.plan.to_dict()}
        for f in fields(self):
            if f.name not in ("plan", "previous"):
                value = getattr(self, f.name)
                d[f.name] = list(value) if isinstance(value, list) else value
        d["measured_saved_bytes"] = self.measured_saved_bytes
        d["predicted_saved_bytes"] = self.plan.predicted_saved_bytes
        d["predicted_saved_bytes_per_" + self.plan.probe_unit] = self.predicted_saved_bytes_per_unit
        return d

    def __str__(self) -> str:
        p = self.plan
        counts = ", ".join(f"{len(p.of(kind))} {kind.noun}" for kind in p.kinds()
                           if p.of(kind) or kind.counted_when_none)
        lines = [f"lmbp-convert: {counts} converted; {len(p.skips)} skipped"]
        for kind in p.kinds():
            items = p.of(kind)
            if items:
                lines += kind.report_lines(items)
        if p.skips:
            lines.append("skipped:")
            for s in p.skips:
                lines.append(f"  {s.name} ({s.cls.split(':')[-1]}): {s.reason}")
        for kind in p.kinds():
            if kind.inexact_training and p.of(kind):
                names = ", ".join(it.name for it in p.of(kind))
                lines.append(f"training not exact ({kind.inexact_training}): {names}")
        if p.already_converted:
            lines.append(f"already converted: {len(p.already_converted)} modules")
        for label, err in self.rolled_back:
            cause = self.rolled_back_cause.get(label, f"changed outputs, relative error {err:.2e}")
            lines.append(f"rolled back: {label} ({cause})")
        lines.append(self._verification_line())
        if self.ran is not None:
            lines.append(self._ran_line())
        if self.measured_bytes is not None:
            lines.append(self._measured_line())
        lines.append(f"predicted activation memory saved: {fmt_bytes(self.plan.predicted_saved_bytes)} on the "
                     f"probe, {fmt_bytes(self.predicted_saved_bytes_per_unit)} per {p.probe_unit} "
                     "(analytic, per rewrite; the measured line above is what one training forward keeps)")
        return "\n".join(lines)
