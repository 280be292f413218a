"""``convert(model)``: see → decide → rewrite → prove, in place, all-or-nothing per rewrite."""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from ..catalogue import load_catalogue
from ..errors import NothingToConvertError
from ..match.plan import Plan
from ..match.planner import make_plan
from ..match.roles import assign_roles, is_leaf_factory
from ..options import ConvertOptions
from ..report import ConversionReport
from ..trace.device import keeps_model_device
from ..trace.probe import make_probe
from ..trace.tracer import trace
from .rewrite import Unit, UnitBuilder
from .verify import default_rtol, eval_mode, relative_error, run_probe

#: config attribute written by the checkpoint CLI: norms whose affine is already folded on disk.
CONFIG_KEY = "lmbp_convert"
REPORT_ATTR = "lmbp_report"


def _is_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def prefolded_norms(model: nn.Module) -> set[str]:
    cfg = getattr(model, "config", None)
    rec = getattr(cfg, CONFIG_KEY, None) if cfg is not None else None
    if isinstance(rec, dict):
        return set(rec.get("folded_norms", []))
    return set()


@keeps_model_device
def plan_conversion(model: nn.Module, options: ConvertOptions | None = None, **kwargs: Any) -> tuple[Plan, Any, Any]:
    """Trace and plan without changing anything. Returns (plan, probe, reference output)."""
    opt = options if options is not None else ConvertOptions(**kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert() takes an nn.Module, got {type(model).__name__}")
    cat = load_catalogue()
    roles = assign_roles(model, cat)
    if opt.probe is not None:
        probe, count, unit = opt.probe, 0, "sample"
    else:
        probe, count, unit = make_probe(model)
    with eval_mode(model):
        graph, out = trace(model, probe, is_leaf_factory(model, roles))
    plan = make_plan(model, graph, roles, opt)
    plan.probe_tokens = count or _batch_of(probe)
    plan.probe_unit = unit
    _mark_prefolded(model, plan)
    return plan, probe, out


def _batch_of(probe: Any) -> int:
    t = probe if isinstance(probe, torch.Tensor) else next(
        (v for v in (probe.values() if isinstance(probe, dict) else probe) if isinstance(v, torch.Tensor)), None)
    return int(t.shape[0]) if t is not None and t.dim() else 1


def _mark_prefolded(model: nn.Module, plan: Plan) -> None:
    done = prefolded_norms(model)
    if not done:
        return
    modules = dict(model.named_modules())
    keep = []
    for f in plan.norm_folds:
        if f.name in done:
            w = modules[f.name].weight
            ident = 1.0 if f.param == "w" else 0.0
            if w.device.type != "meta" and not torch.all(w.detach() == ident):
                from ..match.plan import Skip

                plan.skips.append(Skip(f.name, f.cls, "config says its affine is folded on disk, but its weight "
                                                      "is not the identity; left as is"))
                continue
            f.prefolded = True
            f.reapply = []
        keep.append(f)
    plan.norm_folds = keep


@keeps_model_device
def convert(model: nn.Module, options: ConvertOptions | None = None, *, return_report: bool = False,
            **kwargs: Any):
    """Convert ``model`` in place for memory-lean fine-tuning and return it.

    Approximate-backprop activations replace GELU/SiLU modules; memory-sharing norms replace LayerNorm/RMSNorm
    whose output feeds Linear layers, with the affine folded into those Linears (and re-applied on any other
    branch, e.g. the residual of a post-LN encoder); gated MLPs use the memory-sharing fused op.
    Options: see ``ConvertOptions`` (activations, norms, gated_mlp, bits, include, exclude, probe, verify,
    rtol, untie), given as a ConvertOptions or as keyword arguments.

    All analysis happens before the first change; on any error the model is as it was. Each rewrite is
    checked on the probe against the original outputs and rolled back if it changes them. The report is
    returned with ``return_report=True`` and kept as ``model.lmbp_report``.
    """
    t0 = time.perf_counter()
    opt = options if options is not None else ConvertOptions(**kwargs)
    plan, probe, reference = plan_conversion(model, opt)
    report = ConversionReport(plan)
    if plan.empty:
        if plan.already_converted:
            report.notes.append("nothing left to convert: the model is already converted")
            report.verified = None
            report.seconds = time.perf_counter() - t0
            _attach(model, report)
            return (model, report) if return_report else model
        skipped = "\n".join(f"  {s.name}: {s.reason}" for s in plan.skips) or "  (no candidate modules found)"
        raise NothingToConvertError(
            f"nothing to convert in {type(model).__name__}: no GELU/SiLU-family activation, no LayerNorm/RMSNorm "
            f"feeding a Linear (catalogue: lmbp_convert/patterns/catalogue.json). Candidates:\n{skipped}"
        )
    builder = UnitBuilder(model)
    units: list[tuple[Unit, object]] = []
    for g in plan.gated_mlps:
        units.append((builder.gated_mlp(g), g))
    for n in plan.norm_folds:
        units.append((builder.norm(n), n))
    for a in plan.act_swaps:
        units.append((builder.activation(a), a))
    for u, _ in units:  # everything prepared: from here on only references change
        u.apply()
    meta = _is_meta(model)
    if meta or not opt.verify:
        report.notes.append("meta device: planned and swapped, no weights to verify" if meta else "verify=False")
    else:
        rtol = opt.rtol if opt.rtol is not None else default_rtol(model)
        report.rtol = rtol
        try:
            err = relative_error(run_probe(model, probe), reference)
        except Exception as exc:  # a rewrite broke the forward: find it below
            err = float("inf")
            report.notes.append(f"converted forward raised {type(exc).__name__}: {exc}")
        if err > rtol:
            err = _isolate_failures(model, probe, reference, units, rtol, report)
        report.verified = err <= rtol
        report.relative_error = err
    report.seconds = time.perf_counter() - t0
    _attach(model, report)
    return (model, report) if return_report else model


def _isolate_failures(model, probe, reference, units, rtol, report) -> float:
    """Undo everything, then re-apply unit by unit, keeping only those that leave outputs unchanged."""
    for u, _ in reversed(units):
        u.undo()
    for u, item in units:
        u.apply()
        try:
            err = relative_error(run_probe(model, probe), reference)
        except Exception:
            err = float("inf")
        if err > rtol:
            u.undo()
            report.rolled_back.append((u.label, err))
            _drop(report.plan, item)
    return relative_error(run_probe(model, probe), reference)


def _drop(plan: Plan, item) -> None:
    from ..match.plan import Skip

    for lst in (plan.act_swaps, plan.norm_folds, plan.gated_mlps):
        if item in lst:
            lst.remove(item)
            plan.skips.append(Skip(item.name, item.cls, "rolled back: changed the probe outputs beyond tolerance"))


def _attach(model: nn.Module, report: ConversionReport) -> None:
    """Keep the report on the model; an earlier conversion's report stays reachable as ``.previous``
    (its folds are still in the weights, and export needs them)."""
    prev = getattr(model, REPORT_ATTR, None)
    if isinstance(prev, ConversionReport) and prev is not report:
        report.previous = prev
    object.__setattr__(model, REPORT_ATTR, report)


def last_report(model: nn.Module) -> ConversionReport | None:
    """The report of the last ``convert()`` of this model (None if never converted)."""
    return getattr(model, REPORT_ATTR, None)
