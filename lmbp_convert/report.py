"""What a conversion did: the plan, plus what verification found. Printable and machine-readable."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from .enums import Verification
from .match.plan import Measurement, Plan


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _share(m: Measurement) -> str:
    """"30.6 % less" / "2.0 % more" activation memory, or "" when nothing was kept before."""
    if not m.before:
        return ""
    share = (m.before - m.after) / m.before
    return f"{abs(share):.1%} {'less' if share >= 0 else 'more'} activation memory: "


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
    #: saved-for-backward bytes of one training forward on the probe before and after, by the exact ledger, with
    #: the probe and the mode they were measured in (None: not measured, `unmeasured_why` says why)
    measurement: Measurement | None = None
    unmeasured_why: str = ""
    previous: "ConversionReport | None" = field(default=None, repr=False)  # an earlier convert() of this model
    #: calls of each applied rewrite in a counted stretch of training, {plan tag: {module name: calls}}
    #: (`lmbp_convert.apply.runs.count_runs`; the trainer callback counts the first step); None: not counted
    ran: dict[str, dict[str, int]] | None = None

    @property
    def measured_bytes(self) -> tuple[int, int] | None:
        """(original, converted) saved-for-backward bytes of one training forward on the probe (None: not
        measured)."""
        m = self.measurement if self.measurement is not None else self.plan.measurement
        return None if m is None else (m.before, m.after)

    @property
    def measured_mode(self) -> str:
        """What that forward ran in (dtype, autocast, train mode, trainable parameters, checkpointing)."""
        m = self.measurement if self.measurement is not None else self.plan.measurement
        return "" if m is None else m.mode

    @property
    def swapped(self) -> list[str]:
        return [it.name for kind in self.plan.kinds() for it in self.plan.of(kind)]

    @property
    def inexact_training(self) -> dict[str, str]:
        """Rewritten module → why its training differs from the original's (`PlanItem.training_differs`); the
        rewrites not named here keep the original parameters and their gradients."""
        return {it.name: why for kind in self.plan.kinds() for it in self.plan.of(kind)
                if (why := it.training_differs())}

    @property
    def predicted_saved_bytes_per_unit(self) -> float:
        """The per-rewrite analytic estimate per token / image (`Plan.predicted_saved_bytes`): not printed, since it
        cannot know what the rest of the step keeps (measured: `measured_saved_bytes`)."""
        return self.plan.predicted_saved_bytes / max(1, self.plan.probe_tokens)

    @property
    def measured_saved_bytes(self) -> int | None:
        """What the conversion saves on the probe's training forward, measured (None: not measured)."""
        m = self.measured_bytes
        return None if m is None else m[0] - m[1]

    def _headline(self) -> str:
        """The first line: one measured figure, and the probe and mode it was measured in."""
        m = self.measurement if self.measurement is not None else self.plan.measurement
        who = "lmbp-convert" if self.measurement is not None or self.seconds else "lmbp-convert plan"
        if m is None:
            why = self.unmeasured_why or self.plan.unmeasured_why or "not asked for"
            return f"{who}: activation memory saved: not measured ({why})"
        per = (m.before - m.after) / max(1, self.plan.probe_tokens)
        how = ("measured by applying this plan and undoing it (unverified: convert() keeps what verification "
               "passes)" if m.by == "plan" else "measured")
        return (f"{who}: {_share(m)}{fmt_bytes(m.before)} → {fmt_bytes(m.after)} kept for backward "
                f"({fmt_bytes(per)} less per {self.plan.probe_unit}), {how} on one training forward of the probe "
                f"{m.inputs} ({m.mode})")

    def _checkpointing_line(self) -> str | None:
        m = self.measurement if self.measurement is not None else self.plan.measurement
        if m is None or not m.checkpointing:
            return None
        line = (f"activation checkpointing is on ({m.checkpointing}): in a training forward a checkpointed layer "
                "keeps only its inputs, so the figure above is mostly what is saved outside those layers; the "
                "rewrites inside them act while each is recomputed in backward, one layer at a time")
        if m.without_checkpointing is not None:
            b, a = m.without_checkpointing
            share = f" ({(b - a) / b:.1%} less)" if b else ""
            line += f": the same forward with checkpointing off keeps {fmt_bytes(b)} → {fmt_bytes(a)}{share}"
        return line

    def counts(self) -> str:
        """The report's second line: how many of each kind were converted (kinds with none are not named), and how
        many modules were skipped: "converted: 2 gated MLPs, 5 norms (exact), 1 loss; 0 skipped"."""
        p = self.plan
        idle = {id(it) for it in self.never_ran}  # in place, never called in the counted training: not counted

        def live(kind):
            return [it for it in p.of(kind) if id(it) not in idle]

        counts = ", ".join(kind.counted(len(live(kind))) for kind in p.kinds()
                           if live(kind) or (kind.counted_when_none and not p.of(kind)))
        never = ", ".join(kind.counted(len(p.of(kind)) - len(live(kind))) for kind in p.kinds()
                          if len(live(kind)) < len(p.of(kind)))
        never = f"; in place but never called: {never}" if never else ""
        return f"converted: {counts or 'nothing'}{never}; {len(p.skips)} skipped"

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
                ran.append(f"{hit} of {kind.counted(len(items))}")
        line = "ran in the counted training step: " + (", ".join(ran) or "nothing")
        idle_by: dict = {}
        for it in idle:
            idle_by.setdefault(type(it), []).append(it.name or "<model>")
        never = "; ".join(f"{kind.counted(len(names))} ({', '.join(names)})" for kind, names in idle_by.items())
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
            if f.name not in ("plan", "previous", "measurement"):
                value = getattr(self, f.name)
                d[f.name] = list(value) if isinstance(value, list) else value
        m = self.measurement
        d["measurement"] = None if m is None else asdict(m)
        d["measured_bytes"] = self.measured_bytes
        d["measured_mode"] = self.measured_mode
        d["measured_saved_bytes"] = self.measured_saved_bytes
        # the per-rewrite analytic estimate (not printed: it cannot know what the rest of the step keeps)
        d["predicted_saved_bytes"] = self.plan.predicted_saved_bytes
        d["predicted_saved_bytes_per_" + self.plan.probe_unit] = self.predicted_saved_bytes_per_unit
        return d

    def __str__(self) -> str:
        p = self.plan
        lines = [self._headline(), self.counts()]
        for kind in p.kinds():
            items = p.of(kind)
            if items:
                lines += kind.report_lines(items)
        if p.skips:
            lines.append("skipped:")
            for s in p.skips:
                lines.append(f"  {s.name or '<model>'} ({s.cls.split(':')[-1]}): {s.reason}")
        inexact: dict[str, list[str]] = {}
        for kind in p.kinds():
            for it in p.of(kind):
                why = it.training_differs()
                if why:
                    inexact.setdefault(why, []).append(it.name)
        for why, names in inexact.items():
            lines.append(f"training not exact ({why}): {', '.join(names)}")
        if p.already_converted:
            lines.append(f"already converted: {len(p.already_converted)} modules")
        for label, err in self.rolled_back:
            cause = self.rolled_back_cause.get(label, f"changed outputs, relative error {err:.2e}")
            lines.append(f"rolled back: {label} ({cause})")
        lines.append(self._verification_line())
        if self.ran is not None:
            lines.append(self._ran_line())
        ckpt = self._checkpointing_line()
        if ckpt:
            lines.append(ckpt)
        lines += [f"note: {n}" for n in p.notes]
        return "\n".join(lines)
