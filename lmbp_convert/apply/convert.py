"""``convert(model)``: see → decide → rewrite → prove, in place; each rewrite is kept only if verified, and the
whole call is a transaction (any exception restores the model)."""
from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..catalogue import load_catalogue
from ..deprecation import warn_renamed
from ..errors import NothingToConvertError, ProbeError, TraceError
from ..match.norm import CONFIG_KEY, prefolded_norms
from ..match.plan import Measurement, Plan, PlanItem
from ..match.planner import make_plan
from ..match.roles import assign_roles, is_leaf_factory
from ..options import ConvertOptions, resolve_options
from ..report import ConversionReport
from ..trace.device import keeps_model_device, outside_autocast
from ..trace.own_forward import own_forward_failure
from ..trace.probe import make_probe_with_output, search_probe
from ..trace.second_probe import Probes, derived_inputs
from ..trace.tracer import OUT_OF_MEMORY, trace
from .measure import checkpointing, describe_inputs, measure_saved
from .progress import Progress
from .rewrite import Unit, UnitBuilder
from .ties import TieRecord
from .train_backward import gradient_error, run_train_step
from .verify import (CANNOT_VERIFY, FAILED, NOISE_FACTOR, PASSED, Comparison, calibrated_rtol, compare_outputs,
                     default_rtol, eval_mode, float_tensors, fp32_copy_bytes, free_bytes, half_precision,
                     rng_kept, rollback_reason, run_in_mode, run_probe, run_probe_train, TRAIN_DRAWS)

__all__ = ["CONFIG_KEY", "convert", "last_report", "plan_conversion", "prefolded_norms"]

REPORT_ATTR = "lmbp_report"


def _is_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


@keeps_model_device
def plan_conversion(model: nn.Module, options: ConvertOptions | None = None, *, probe: Any = None,
                    **overrides: Any) -> Plan:
    """Trace and plan; the model is left as it was. The plan also carries (not serialised) the probe it was made
    on, ``plan.probe``, and the model's output on it, ``plan.reference_output``.

    With ``measure`` (the default) and real weights, the plan is applied, one training forward on the probe is
    measured before and after (as convert() measures), and it is undone (a transaction, as in convert()):
    ``plan.measurement``, what ``print(ConversionReport(plan))`` leads with. It is not verified, so convert() may
    keep less (a rewrite verification rolls back). The per-rewrite analytic estimate
    (``plan.predicted_saved_bytes``) is not printed: it cannot know what the rest of the step keeps."""
    opt, probe = resolve_options(options, probe, overrides)
    steps = ["probe", "plan"] + (["measure"] if opt.measure else [])
    # planned in the model's own dtypes, as convert() does; measured under the caller's autocast
    with torch.inference_mode(False), outside_autocast() as amp, rng_kept(model), \
            Progress(opt.progress, steps, "plan_conversion()") as bar:
        plan = _plan(model, opt, probe, bar)
        if opt.measure:
            bar.phase("measure")
            _measure_plan(model, plan, amp)
        else:
            plan.unmeasured_why = "measure=False"
    return plan


def _measure_plan(model: nn.Module, plan: Plan, amp: list[tuple[str, torch.dtype]]) -> None:
    """``plan.measurement``: the plan applied, measured as convert() measures, undone (also on any exception, as
    convert() restores the model); where it cannot be, ``plan.unmeasured_why``."""
    if plan.empty:
        plan.unmeasured_why = "nothing to convert"
        return
    if _is_meta(model):
        plan.unmeasured_why = _META_UNMEASURED
        return
    applied: list[Unit] = []
    try:
        builder = UnitBuilder(model)
        units = [item.build_unit(builder) for item in plan.items]
        start = _measure_start(model, plan.probe, amp)
        for u in units:
            applied.append(u)  # (a unit's undo is idempotent: one that failed half-way is undone too)
            u.apply()
        plan.measurement = _measured(model, plan.probe, amp, start, by="plan")
    except OUT_OF_MEMORY as exc:
        plan.unmeasured_why = f"the measuring forward ran out of memory ({type(exc).__name__})"
    except Exception as exc:  # noqa: BLE001 - convert() would fail the same way and say so; the plan still stands
        plan.unmeasured_why = f"applying the plan to measure it failed ({type(exc).__name__}: {exc})"
    finally:
        for u in reversed(applied):
            u.undo()


_META_UNMEASURED = ("meta device: no weights to run the forward with; convert() measures it on the model once its "
                    "weights are loaded")


@dataclass(frozen=True)
class _Start:
    """What `_measure_start` measured before the rewrites."""

    before: Any
    plain: Any  # with the model's activation checkpointing off (None: it has none)
    checkpointing: str


def _measure_start(model: nn.Module, probe: Any, amp) -> _Start:
    ck = checkpointing(model)
    before = measure_saved(model, probe, amp)
    plain = measure_saved(model, probe, amp, checkpoints=False) if ck else None
    return _Start(before, plain, "; ".join(c.describe() for c in ck))


def _measured(model: nn.Module, probe: Any, amp, start: _Start, by: str) -> Measurement:
    after = measure_saved(model, probe, amp)
    plain = None
    if start.plain is not None:
        plain = (start.plain.bytes, measure_saved(model, probe, amp, checkpoints=False).bytes)
    return Measurement(start.before.bytes, after.bytes, start.before.mode, describe_inputs(probe),
                       start.checkpointing, plain, by)


def _plan(model: nn.Module, opt: ConvertOptions, probe: Any, bar: Progress | None = None) -> Plan:
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert() takes an nn.Module, got {type(model).__name__}")
    if bar is not None:
        bar.phase("probe")
    cat = load_catalogue()
    roles = assign_roles(model, cat, opt.accept_norms or ())
    if isinstance(probe, Probes):  # several inputs: the first is traced, all are verified
        probe = probe[0]
    is_leaf = is_leaf_factory(model, roles)
    with eval_mode(model):
        if probe is not None:
            count, unit, index = 0, "sample", 0
            try:
                graph, out = trace(model, probe, is_leaf)
            except TraceError as exc:  # the model's own inference forward, or the probe? (`own_forward`)
                own = own_forward_failure(model, probe, exc.__cause__ or exc, "the probe given")
                if own is not None:
                    raise own from exc.__cause__
                raise
        else:  # the trace is the probe's acceptance check: one forward, not two
            probe, count, unit, (graph, out), index = search_probe(model, lambda p: trace(model, p, is_leaf))
    if bar is not None:
        bar.phase("plan")
    plan = make_plan(model, graph, roles, opt, prefolded_norms(model), probe)
    plan.probe_tokens = count or _batch_of(probe)
    plan.probe_unit = unit
    plan.probe, plan.reference_output, plan.probe_index = probe, out, index
    return plan


def _check_patterns(model: nn.Module, opt: ConvertOptions) -> None:
    """include/exclude patterns that name no module: an error when no include pattern matches, else a warning
    (`ConvertOptions.check_patterns`, which the checkpoint CLI shares)."""
    names = [n for n, _ in model.named_modules(remove_duplicate=False) if n]
    opt.check_patterns(names, type(model).__name__, lambda msg: warnings.warn(msg, UserWarning, stacklevel=5))


def _batch_of(probe: Any) -> int:
    t = probe if isinstance(probe, torch.Tensor) else next(
        (v for v in (probe.values() if isinstance(probe, dict) else probe) if isinstance(v, torch.Tensor)), None)
    return int(t.shape[0]) if t is not None and t.dim() else 1


@keeps_model_device
def convert(model: nn.Module, options: ConvertOptions | None = None, *, probe: Any = None,
            **overrides: Any) -> nn.Module:
    """Convert ``model`` in place for memory-lean fine-tuning and return it.

    Approximate-backprop activations replace GELU/SiLU modules; memory-sharing norms replace LayerNorm/RMSNorm
    whose output a consumer keeps (exact by default: γ, β, W, b stay the original parameters and the consumers'
    copies of the output are rebuilt from x̂; ``fold_norms=True`` folds the affine into the next Linears
    instead); gated MLPs, PEFT LoRA inputs and the LM loss use memory-sharing ops.
    Options: a ``ConvertOptions`` and/or its fields as keyword arguments (merged; a keyword contradicting a
    value the options object was built with is a TypeError). ``probe``: the input of the tracing and
    verification forwards when the model's config cannot provide one; ``Probes(first, second, ...)`` for
    several (the first is traced, the conversion is verified on all).

    All analysis happens before the first change. From the first change on, convert() is a transaction: on any
    exception (including KeyboardInterrupt) the model is restored exactly and the exception re-raised. Each
    rewrite is checked against the original outputs, on the traced probe and on a second input the trace did
    not see (so a branch only other data takes, such as an MoE expert the probe routed no token to, shows up;
    see `lmbp_convert.trace.second_probe`), and on the traced probe in train mode on fixed RNG draws, and rolled
    back if it changes them. The report is ``model.lmbp_report``.
    Errors: see ``lmbp_convert.errors``. ``return_report=True`` (0.1.0; deprecated, goes in 0.3.0) returns
    ``(model, model.lmbp_report)`` instead, with a DeprecationWarning.
    """
    return_report = _return_report(overrides)
    # Tensors made under torch.inference_mode() are inference tensors, which training can never save for
    # backward: a model converted inside such a block (e.g. right after an evaluation) must stay trainable.
    # Under torch.autocast, verification would compare rounding, not the rewrite: see `outside_autocast`.
    # Its probes and checks draw random numbers: the caller's RNG stream is left where it was (`rng_kept`).
    with torch.inference_mode(False), outside_autocast() as amp, rng_kept(model):
        out = _convert(model, options, probe, overrides, amp)
    return (out, getattr(out, REPORT_ATTR)) if return_report else out


#: the phases of convert() as its progress line names them (verify and measure alternate: the measurement before
#: the rewrites comes after the original's references are taken, the one after them after verification)
_CONVERT_STEPS = ("probe", "plan", "verify", "measure", "verify", "measure")


def _return_report(overrides: dict[str, Any]) -> bool:
    """0.1.0's ``convert(..., return_report=True)``, which returned ``(model, report)``: still taken, with a
    DeprecationWarning naming ``model.lmbp_report`` (the keyword goes in 0.3.0)."""
    if "return_report" not in overrides:
        return False
    value = overrides.pop("return_report")
    if not isinstance(value, bool):
        raise TypeError(f"convert(): return_report must be True or False, got {value!r}")
    warn_renamed("convert(..., return_report=True)", f"model.{REPORT_ATTR} (convert() returns the model)",
                 stacklevel=5, what="replaced")  # 5: past _return_report, convert and the device-keeping wrapper
    return value


def last_report(model: nn.Module) -> ConversionReport | None:
    """Deprecated (0.1.0; goes in 0.3.0): read ``model.lmbp_report`` (``getattr(model, "lmbp_report", None)`` if it
    may be unconverted)."""
    warn_renamed("lmbp_convert.last_report(model)", f"model.{REPORT_ATTR}", what="replaced")
    return getattr(model, REPORT_ATTR, None)


def _convert(model: nn.Module, options: ConvertOptions | None, probe: Any, overrides: dict[str, Any],
             amp: list[tuple[str, torch.dtype]] = ()):
    t0 = time.perf_counter()
    opt, given = resolve_options(options, probe, overrides)
    if isinstance(model, nn.Module):
        _check_patterns(model, opt)
    with Progress(opt.progress, _CONVERT_STEPS if opt.measure else _CONVERT_STEPS[:3]) as bar:
        return _convert_steps(model, opt, given, amp, t0, bar)


def _convert_steps(model: nn.Module, opt: ConvertOptions, given: Any, amp: list[tuple[str, torch.dtype]],
                   t0: float, bar: Progress):
    plan = _plan(model, opt, given, bar)
    probe, reference = plan.probe, plan.reference_output
    plan.probe = plan.reference_output = None  # the report keeps the plan: not the probe data and outputs
    report = ConversionReport(plan)
    if amp:
        where = ", ".join(f"{dev}: {str(dt).replace('torch.', '')}" for dev, dt in amp)
        report.notes.append(f"convert() was called under torch.autocast ({where}): it traced and verified outside "
                            "it, in the model's own dtypes; under autocast the converted model adapts itself, and "
                            "its outputs differ from the original's by that dtype's rounding, as the original's own "
                            "do")
    if plan.empty:
        if plan.already_converted:
            report.notes.append("nothing left to convert: the model is already converted")
            report.unmeasured_why = "nothing left to convert"
            report.seconds = time.perf_counter() - t0
            _attach(model, report)
            return model
        skipped = "\n".join(f"  {s.name}: {s.reason}" for s in plan.skips) or "  (no candidate modules found)"
        raise NothingToConvertError(
            f"nothing to convert in {type(model).__name__}: no GELU/SiLU-family activation, no LayerNorm/RMSNorm "
            f"feeding a Linear (catalogue: lmbp_convert/patterns/catalogue.json). Candidates:\n{skipped}"
        )
    bar.phase("verify")
    checks = [Check(probe, reference, "the traced probe")]
    if opt.verify and not _is_meta(model):  # the original's outputs on the other inputs, before any change
        checks += _other_inputs(model, given, probe, report, plan.probe_index)
        accepted = _accepted_norms(plan, opt)
        if accepted:  # the user vouched for these norms' training forward, which is what differs from the swap's
            report.notes.append(f"verified in eval mode only: accept_norms accepts {', '.join(accepted)}, whose "
                                "training forward is not a plain norm's (so train-mode outputs would differ by design)")
        else:
            checks += _train_checks(model, probe, report, _wants_gradients(model, plan))
    rtol = _budget(model, checks, opt, report)  # a half-precision budget is measured on every check, train ones too
    builder = UnitBuilder(model)
    units: list[tuple[Unit, PlanItem | None]] = [(item.build_unit(builder), item) for item in plan.items]
    ties = TieRecord(model)
    params_before = dict(_params(model))
    had_report, old_report = REPORT_ATTR in model.__dict__, model.__dict__.get(REPORT_ATTR)
    start = None
    if not opt.measure:
        report.unmeasured_why = "measure=False"
    elif _is_meta(model):
        report.unmeasured_why = _META_UNMEASURED
    else:
        bar.phase("measure")
        start = _measure_start(model, probe, amp)
        bar.phase("verify")
    try:  # everything prepared: from here on only references change, and any exception undoes them all
        for u, _ in units:
            u.apply()
        _verify(model, checks, units, opt, report, rtol, bar)
        untie = ties.untie_unit()  # what a fold untied stays untied: tie_weights() must not re-tie it
        units.append((untie, None))
        untie.apply()
        if untie.steps:
            report.notes.append("untied weights: config.tie_word_embeddings is now False (and transformers' tie map "
                                "drops them), so tie_weights() and resize_token_embeddings() keep the folded head")
        if start is not None:
            bar.phase("measure")
            report.measurement = _measured(model, probe, amp, start, by="convert")
        _warn_orphans(model, params_before)
        report.seconds = time.perf_counter() - t0
        _attach(model, report)
        from ..export import guard_plain_save  # export reads the report just attached (a call-time import: no cycle)

        step = guard_plain_save(model)
        if step is not None:  # plain save_pretrained would write a different model: it raises instead
            guard = Unit("plain save_pretrained refused")
            guard.steps.append(step)
            units.append((guard, None))
            guard.apply()
            report.notes.append("save_pretrained() raises ExportError: this model's state dict is not a plain "
                                "checkpoint (lmbp_convert.export.save_pretrained writes one)")
    except BaseException as exc:
        _restore(model, units, had_report, old_report, exc)
        raise
    return model


@dataclass(frozen=True)
class Check:
    """One verification input and the original model's output on it."""

    probe: Any
    reference: Any
    how: str  # where the input came from, for the report
    train_seed: int | None = None  # run in train mode on this RNG seed (`verify.run_probe_train`), else eval mode
    backward: bool = False  # train mode: a backward too (`train_backward.run_train_step`), whose failure fails
    grads: dict[str, torch.Tensor | None] | None = None  # the original's gradients on it (None: not compared)

    def run(self, model: nn.Module) -> Any:
        return run_in_mode(model, self.probe, self.train_seed)

    def compare(self, model: nn.Module, exact_training: bool) -> Comparison:
        """The converted model against the original here; gradients too where every rewrite applied now claims
        exact training (approximate backward and folds change them by design)."""
        if not self.backward:
            return compare_outputs(self.run(model), self.reference)
        want = exact_training and self.grads is not None
        got = run_train_step(model, self.probe, self.train_seed, keep_grads=want)
        cmp = compare_outputs(got.output, self.reference)
        err = gradient_error(got.grads, self.grads) if want and got.grads is not None else None
        return dataclasses.replace(cmp, backward_failure=got.failure, gradient_error=err)


def _accepted_norms(plan: Plan, opt: ConvertOptions) -> list[str]:
    """Planned modules whose class ``accept_norms`` names (by ``module:QualName`` or class name)."""
    names = set(opt.accept_norms or ())
    return [it.name for it in plan.items if it.cls in names or it.cls.rsplit(":", 1)[-1] in names]


def _wants_gradients(model: nn.Module, plan: Plan) -> bool:
    """Keep the original's gradients for comparison: some planned rewrite claims exact training, and the model is
    not half precision (its gradients' rounding noise is not what the output budget was calibrated on)."""
    return not half_precision(model) and any(not item.training_differs() for item in plan.items)


def _exact_training(units: list[tuple[Unit, PlanItem | None]]) -> bool:
    return all(item is None or not item.training_differs() for _, item in units)


def _train_checks(model: nn.Module, probe: Any, report: ConversionReport, gradients: bool) -> list[Check]:
    """The traced probe in train mode, on `TRAIN_DRAWS` RNG seeds (one where the output does not depend on the
    seed), with the original's outputs: branches only training takes (dropout, LayerDrop, code under
    ``if self.training``) are verified too. The first draw also runs one backward (`train_backward`): a rewrite
    whose backward fails (a tensor it keeps modified in place) fails it; with ``gradients`` the original's
    gradients are kept for the rewrites that claim exact training. A model whose training forward fails on the
    probe gets a note, as does one whose own backward fails (then no draw runs a backward)."""
    def check(seed: int, out: Any, **kw: Any) -> Check:
        return Check(probe, out, f"the traced probe in train mode (RNG seed {seed})", seed, **kw)

    try:
        head = _backward_check(model, probe, report, gradients, check)
        second = run_probe_train(model, probe, 1)
        again = compare_outputs(second, head.reference)
        if again.mismatch is None and again.error == 0.0:  # nothing random in training: one draw says it all
            return [head]
        return [head, check(1, second)] + [check(s, run_probe_train(model, probe, s))
                                                      for s in range(2, TRAIN_DRAWS)]
    except OUT_OF_MEMORY:
        raise
    except Exception as exc:  # noqa: BLE001 - the model's own training forward refuses the probe: said, not fatal
        report.notes.append(f"verified in eval mode only: the original's training forward on the probe failed "
                            f"({type(exc).__name__}: {exc})")
        return []


def _backward_check(model: nn.Module, probe: Any, report: ConversionReport, gradients: bool, check) -> Check:
    """The first train draw with its backward (`train_backward`); without one, noted, where the original's own
    backward fails or runs out of memory (a plain train-mode forward is what verification ran before)."""
    try:
        step = run_train_step(model, probe, 0, keep_grads=gradients)
    except OUT_OF_MEMORY as exc:
        report.notes.append(f"train mode verified without a backward: the original's training step on the probe "
                            f"ran out of memory ({type(exc).__name__})")
        return check(0, run_probe_train(model, probe, 0))
    if step.failure is not None:
        report.notes.append(f"train mode verified without a backward: the original's backward on the probe "
                            f"failed ({step.failure})")
        return check(0, step.output)
    return check(0, step.output, backward=True, grads=step.grads)


def _other_inputs(model: nn.Module, given: Any, traced: Any, report: ConversionReport, index: int = 0
                  ) -> list[Check]:
    """The inputs verification uses besides the traced one, each with the original's output (one forward each):
    the user's further `Probes`, else the automatic probe drawn with another seed (trying first the candidate
    that won at seed 0, ``index``), else one derived from the user's probe (`lmbp_convert.trace.second_probe`).
    None found: a note and a warning, never an error."""
    if isinstance(given, Probes):
        return [Check(p, _reference(model, p, i + 2), f"probe {i + 2} of {len(given)}")
                for i, p in enumerate(given[1:])]
    if given is None:
        try:
            second, _, _, ref = make_probe_with_output(model, seed=1, first=index)
        except ProbeError as exc:
            why = f"the automatic probe with another seed was refused ({exc})"
        else:
            if ref is not None:
                return [Check(second, ref, "a second automatic probe (seed 1)")]
            why = "the automatic probe with another seed gave no output"
    else:
        refusals = []
        for second, how in derived_inputs(traced):
            try:
                return [Check(second, run_probe(model, second), f"a second input, {how}")]
            except OUT_OF_MEMORY:
                raise
            except Exception as exc:  # noqa: BLE001 - the model rejects this variant: try the next rule
                refusals.append(f"{type(exc).__name__}: {exc}")
        why = ("the model refused every input derived from the probe (" + "; ".join(refusals) + ")" if refusals
               else "no tensor of the probe holds data that can be varied (only masks or non-tensors)")
    note = (f"verified on the traced probe only: {why}; a consumer the trace missed (a branch only other inputs "
            "take) would go unnoticed. Pass probe=lmbp_convert.Probes(first, second) to verify on more inputs")
    report.notes.append(note)
    warnings.warn(f"convert() {note}", UserWarning, stacklevel=3)
    return []


def _reference(model: nn.Module, probe: Any, number: int) -> Any:
    try:
        return run_probe(model, probe)
    except OUT_OF_MEMORY:
        raise
    except Exception as exc:
        raise TraceError(f"the model refused probe {number} of the Probes given to convert() "
                         f"({type(exc).__name__}: {exc})") from exc


def _compare_each(model: nn.Module, checks: list[Check], exact_training: bool = False,
                  bar: Progress | None = None) -> list[Comparison]:
    """The converted model against the original on every input, one comparison per check."""
    out = []
    for c in checks:
        if bar is not None:
            bar.tick(c.how)
        out.append(c.compare(model, exact_training))
    return out


def _worst(cmps: list[Comparison]) -> Comparison:
    """The worst of the checks' comparisons (a mismatch first; a backward's failure and the worst gradient error
    carried along)."""
    bad = next((c for c in cmps if c.mismatch is not None), None)
    if bad is not None:
        return bad
    failure = next((c.backward_failure for c in cmps if c.backward_failure is not None), None)
    grads = [c.gradient_error for c in cmps if c.gradient_error is not None]
    return Comparison(max(c.error for c in cmps), sum(c.compared for c in cmps), None, failure,
                      max(grads) if grads else None)


def _check_all(model: nn.Module, checks: list[Check], units: list, bar: Progress | None = None) -> Comparison:
    return _worst(_compare_each(model, checks, _exact_training(units), bar))


def _budget(model: nn.Module, checks: list[Check], opt: ConvertOptions, report: ConversionReport) -> float:
    """Verification's tolerance: the user's ``rtol``; else 1e-4 in fp32; else, for a half-precision model, the
    budget calibrated on its own rounding noise (`verify.calibrated_rtol`), measured before any rewrite."""
    if opt.rtol is not None or not opt.verify or _is_meta(model) or not half_precision(model):
        return opt.rtol if opt.rtol is not None else default_rtol(model)
    fixed = f"verification tolerance: the fixed {default_rtol(model):.0e}"
    need = fp32_copy_bytes(model)
    devices = {p.device for p in model.parameters()}
    free = free_bytes(next(iter(devices))) if len(devices) == 1 else None
    if free is None or 2 * need > free:  # twice: the copies, and the fp32 forward's own activations
        why = "free memory cannot be read here" if free is None else "more than half the memory free now"
        report.notes.append(f"{fixed} (measuring the model's rounding noise needs fp32 copies of its weights, "
                            f"{need / 2**30:.2f} GiB: {why})")
        return default_rtol(model)
    try:
        rtol, noise = calibrated_rtol(model, [(c.probe, c.reference, c.train_seed) for c in checks])
    except OUT_OF_MEMORY as exc:  # the copies did not fit after all: put back (calibrated_rtol did), fixed budget
        report.notes.append(f"{fixed} (the fp32 forward that measures the model's rounding noise ran out of "
                            f"memory: {type(exc).__name__})")
        return default_rtol(model)
    except Exception as exc:  # noqa: BLE001 - the model refuses fp32: the fixed budget, said so
        report.notes.append(f"{fixed} (the model's fp32 forward, to measure its rounding noise, failed: "
                            f"{type(exc).__name__}: {exc})")
        return default_rtol(model)
    report.notes.append(f"verification tolerance {rtol:.1e}: {NOISE_FACTOR:g}× the model's own rounding noise "
                        f"({noise:.1e}, its half-precision outputs against the same forwards in fp32)")
    return rtol


def _verify(model: nn.Module, checks: list[Check], units: list, opt: ConvertOptions,
            report: ConversionReport, rtol: float, bar: Progress | None = None) -> None:
    """Compare the converted outputs with the original's on every input, within ``rtol`` (`_budget`); roll back
    what changes them. A NaN is never a pass."""
    if _is_meta(model) or not opt.verify:
        report.notes.append("meta device: planned and swapped, no weights to verify" if _is_meta(model)
                            else "verify=False")
        return
    report.rtol = rtol
    cmp = _check_all(model, checks, units, bar)
    if cmp.verdict(rtol) == FAILED:
        cmp = _isolate_failures(model, checks, units, rtol, report)
    report.verification = cmp.verdict(rtol)
    report.verified = {PASSED: True, FAILED: False}.get(report.verification)
    report.relative_error = cmp.error if cmp.compared or cmp.mismatch else None  # inf on a mismatch
    report.verified_on = [c.how for c in checks if c.train_seed is None]
    report.train_draws = sum(c.train_seed is not None for c in checks)
    report.train_backward = any(c.backward for c in checks)
    report.gradient_error = cmp.gradient_error
    if cmp.mismatch:
        report.mismatch = cmp.mismatch
        report.notes.append(f"converted outputs differ: {cmp.mismatch}")
    if cmp.backward_failure:
        report.notes.append(f"the converted model's backward fails: {cmp.backward_failure}")
    reference = checks[0].reference
    if report.verification == CANNOT_VERIFY:
        why = ("the original model's outputs on the probe are NaN or inf everywhere (non-finite weights or "
               "probe?): nothing to compare, the rewrites are unchecked")
        if not float_tensors(reference):
            why = (f"the model's output ({type(reference).__name__}) holds no floating-point tensor in a tensor, "
                   "dict, list, tuple or dataclass: nothing to compare, the rewrites are unchecked")
        report.unverified_why = why
        report.notes.append(why)
        warnings.warn(f"convert() cannot verify {type(model).__name__}: {why}", UserWarning, stacklevel=3)


def _isolate_failures(model, checks, units, rtol, report) -> Comparison:
    """Undo everything, then re-apply unit by unit, keeping only those that leave outputs unchanged on every
    input, whose backward runs, and (where every unit kept so far claims exact training) whose gradients are the
    original's."""
    for u, _ in reversed(units):
        u.undo()
    kept: list = []
    for u, item in units:
        u.apply()
        each = _compare_each(model, checks, _exact_training([*kept, (u, item)]))
        cmp = _worst(each)
        if cmp.verdict(rtol) != FAILED:
            kept.append((u, item))
            continue
        where, one = next(((c.how, one) for c, one in zip(checks, each) if one.verdict(rtol) == FAILED),
                          ("the verification inputs", cmp))
        u.undo()
        report.rolled_back.append((u.label, cmp.error))
        why = rollback_reason(one, where, rtol)
        if why.parts:
            report.rolled_back_cause[u.label] = why.parts[0].text
        report.plan.drop(item, why)
    return _check_all(model, checks, kept)


def _restore(model: nn.Module, units: list, had_report: bool, old_report: Any, exc: BaseException) -> None:
    """Undo every applied unit (newest first) and the report attribute; keep going if an undo is interrupted."""
    failed = []
    for u, _ in reversed(units):
        try:
            u.undo()
        except BaseException as undo_exc:  # noqa: BLE001 - restore as much as possible, then re-raise the cause
            failed.append(f"{u.label} ({type(undo_exc).__name__})")
    if had_report:
        object.__setattr__(model, REPORT_ATTR, old_report)
    else:
        model.__dict__.pop(REPORT_ATTR, None)
    note = ("lmbp_convert: convert() was interrupted after it began rewriting; the model was restored to its "
            "state before convert()")
    if failed:
        note = f"lmbp_convert: convert() was interrupted and could not undo {', '.join(failed)}"
    if hasattr(exc, "add_note"):
        exc.add_note(note)


def _params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters(remove_duplicate=False)]


def _warn_orphans(model: nn.Module, before: dict[str, nn.Parameter]) -> None:
    """An optimizer built before convert() holds parameters the model no longer has and misses new ones. We
    cannot see optimizers, but gradients on the parameters say one has probably run: then warn."""
    if not any(p.grad is not None for p in before.values()):
        return
    now = {id(p) for _, p in _params(model)}
    old = {id(p) for p in before.values()}
    gone = sorted(n for n, p in before.items() if id(p) not in now and p.requires_grad)
    new = sorted(n for n, p in _params(model) if id(p) not in old and p.requires_grad)
    if not (gone or new):
        return

    def names(xs):
        return ", ".join(xs[:4]) + (f" and {len(xs) - 4} more" if len(xs) > 4 else "")

    parts = []
    if gone:
        parts.append(f"{names(gone)} are no longer parameters of the model (folded norms hold identity buffers)")
    if new:
        parts.append(f"{names(new)} are new parameters")
    warnings.warn("convert() ran on a model whose parameters already have gradients, so an optimizer may exist: "
                  + "; ".join(parts) + ". An optimizer built before convert() keeps updating the old tensors and "
                  "never sees the new ones: build (or rebuild) it after convert()", UserWarning, stacklevel=3)


def _attach(model: nn.Module, report: ConversionReport) -> None:
    """Keep the report on the model; an earlier conversion's report stays reachable as ``.previous``
    (its folds are still in the weights, and export needs them)."""
    prev = getattr(model, REPORT_ATTR, None)
    if isinstance(prev, ConversionReport) and prev is not report:
        report.previous = prev
    object.__setattr__(model, REPORT_ATTR, report)
