"""Compare a model's outputs on the probe with reference outputs (eval mode, no grad).

The comparison cannot be fooled by non-finite values: finite reference positions are compared by relative
error, non-finite ones must match exactly (NaN where NaN, the same sign of inf), and when no finite reference
value is left there is nothing to compare, which is a verdict of its own ("cannot verify"), never a pass.
"""
from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..enums import Verification
from ..reasons import Reason, ReasonCode
from ..trace.containers import children
from ..trace.device import training_mode
from ..trace.tracer import call_model

PASSED = Verification.PASSED
FAILED = Verification.FAILED
CANNOT_VERIFY = Verification.CANNOT_VERIFY
NOT_RUN = Verification.NOT_RUN


def _float_tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            out.append(obj)
    else:
        for _, v in children(obj):
            _float_tensors(v, out)
    return out


def float_tensors(obj: Any) -> list[torch.Tensor]:
    """Every floating-point tensor of a model output, in a fixed order."""
    return _float_tensors(obj, [])


HALF = (torch.float16, torch.bfloat16)
#: the budget of a half-precision model: this many times its own rounding noise (a correct rewrite rounds
#: differently, not more: its error against the half-precision original is at most about twice the noise)
NOISE_FACTOR = 4.0
FP32_RTOL = 1e-4


def default_rtol(model: nn.Module) -> float:
    """The fixed budget: 1e-4 for fp32/fp64 models; for half-precision ones the calibrated budget
    (`calibrated_rtol`) applies, this fixed 5e-2 only where it cannot be measured."""
    return 5e-2 if half_precision(model) else FP32_RTOL


def half_precision(model: nn.Module) -> bool:
    return any(p.dtype in HALF for p in model.parameters())


@contextmanager
def _in_fp32(model: nn.Module):
    """The model's half-precision parameters and buffers as fp32 copies, put back (the same tensors) on exit."""
    params = [p for p in model.parameters() if p.dtype in HALF]
    buffers = [(m, n, b) for m in model.modules() for n, b in m._buffers.items()
               if b is not None and b.dtype in HALF]
    originals = [p.data for p in params]
    try:
        for p in params:
            p.data = p.data.float()
        for m, n, b in buffers:
            m._buffers[n] = b.float()
        yield
    finally:
        for p, d in zip(params, originals):
            p.data = d
        for m, n, b in buffers:
            m._buffers[n] = b


def _fp32_input(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in HALF else obj
    if isinstance(obj, dict):
        return {k: _fp32_input(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_fp32_input(v) for v in obj)
    return obj


def fp32_copy_bytes(model: nn.Module) -> int:
    """Bytes the fp32 copies of the model's half-precision parameters and buffers take (`calibrated_rtol`)."""
    tensors = [p for p in model.parameters()] + [b for b in model.buffers()]
    return sum(4 * t.numel() for t in tensors if t.dtype in HALF)


def free_bytes(device: torch.device) -> int | None:
    """Memory free on ``device`` now (CUDA: the driver's figure; CPU: available physical pages), None where it
    cannot be read."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        if device.type == "cpu":
            return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, RuntimeError, ValueError):
        return None
    return None


def calibrated_rtol(model: nn.Module, runs: list[tuple[Any, Any, int | None]]) -> tuple[float, float]:
    """Budget for a half-precision model, from its own rounding noise: the relative error of its outputs
    (``runs``: (probe, the original's output, the train-mode RNG seed or None for eval mode), taken before any
    rewrite; dropout makes the same draws in either dtype) against the same forwards in fp32
    (parameters and buffers upcast in place, for these forwards only: the model's memory in fp32 for a moment),
    times `NOISE_FACTOR`, and at least `FP32_RTOL`. A fixed budget (5e-2 was) lets through any error below it,
    such as a rewrite 1 % off in a model whose own noise is 0.3 %. Returns (budget, noise); raises whatever the
    model's fp32 forward raises (the caller falls back to the fixed budget)."""
    with _in_fp32(model):
        noise = max(compare_outputs(ref, run_in_mode(model, _fp32_input(probe), seed)).error for probe, ref, seed in runs)
    return max(NOISE_FACTOR * noise, FP32_RTOL), noise


def eval_mode(model: nn.Module):
    """Run in eval mode, then put every module's own training flag back."""
    return training_mode(model, False)


def run_probe(model: nn.Module, probe: Any) -> Any:
    with eval_mode(model), torch.no_grad():
        return call_model(model, probe)


#: Train-mode draws verification compares (RNG seeds 0, 1, ...): the original and the converted model take the
#: same dropout masks, LayerDrop skips and router noise on each, so a rewrite wrong only on a branch training takes
#: shows. A model whose train-mode output does not depend on the seed is checked on one draw.
TRAIN_DRAWS = 4


@contextmanager
def rng_kept(model: Any):
    """The default generators' states (CPU, and CUDA for the model's devices) put back afterwards: convert()'s
    probes and checks draw nothing from the caller's stream, so a run takes the same draws converted or not."""
    tensors = [*model.parameters(), *model.buffers()] if isinstance(model, nn.Module) else []
    cuda = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        yield


@contextmanager
def _seeded(model: nn.Module, seed: int):
    with rng_kept(model):
        torch.manual_seed(seed)
        yield


@contextmanager
def _buffers_kept(model: nn.Module):
    """A training forward may update buffers (BatchNorm's running statistics, counters): put back what changed
    (compared by value: ATen's batch norm updates its statistics without moving their version counters)."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, old in saved:
                if not torch.equal(b, old):
                    b.copy_(old)


def run_in_mode(model: nn.Module, probe: Any, train_seed: int | None) -> Any:
    """`run_probe` (eval mode) or, with a seed, `run_probe_train`: how a verification check runs its input."""
    return run_probe(model, probe) if train_seed is None else run_probe_train(model, probe, train_seed)


def run_probe_train(model: nn.Module, probe: Any, seed: int) -> Any:
    """The model's output on ``probe`` in train mode (no grad), on RNG seed ``seed``; model state and the caller's
    RNG state unchanged."""
    with training_mode(model, True), torch.no_grad(), _seeded(model, seed), _buffers_kept(model):
        return call_model(model, probe)


@dataclass(frozen=True)
class Comparison:
    """Outputs vs reference. ``error`` is never NaN: inf when the outputs differ in structure or in their
    non-finite positions; ``compared`` counts the finite reference values the error is taken over."""

    error: float
    compared: int
    mismatch: str | None = None  # why the outputs differ beyond numbers (structure, non-finite positions)
    #: train-mode checks with a backward (`train_backward`): what the converted model's backward raised, and the
    #: relative error of its gradients against the original's (only where every applied rewrite claims exact
    #: training; None: not compared)
    backward_failure: str | None = None
    gradient_error: float | None = None

    def verdict(self, rtol: float) -> Verification:
        if self.mismatch is not None or self.backward_failure is not None or not self.gradients_pass(rtol):
            return FAILED
        if self.compared == 0:
            return CANNOT_VERIFY
        return PASSED if self.error <= rtol else FAILED  # error is never NaN (see compare_outputs)

    def gradients_pass(self, rtol: float) -> bool:
        return self.gradient_error is None or self.gradient_error <= rtol


def _nonfinite_mismatch(x: torch.Tensor, y: torch.Tensor) -> bool:
    """True unless x is NaN exactly where y is, +inf where y is, -inf where y is (so finite where y is)."""
    return bool((torch.isnan(x) != torch.isnan(y)).any() or (torch.isposinf(x) != torch.isposinf(y)).any()
                or (torch.isneginf(x) != torch.isneginf(y)).any())


def _relative(x: torch.Tensor, y: torch.Tensor) -> float:
    """‖x − y‖ / ‖y‖ over finite values, computed on a common scale so that no norm overflows."""
    scale = float(y.abs().max()) if y.numel() else 0.0
    if scale == 0.0 or not math.isfinite(scale):
        return 0.0 if bool(torch.equal(x, y)) else math.inf
    num = float(torch.linalg.vector_norm((x - y) / scale))
    den = float(torch.linalg.vector_norm(y / scale))
    err = num / den
    return err if math.isfinite(err) else math.inf


def compare_outputs(out: Any, ref: Any) -> Comparison:
    """Compare every floating-point tensor of ``out`` with the one at the same place in ``ref``."""
    a, b = _float_tensors(out, []), _float_tensors(ref, [])
    if len(a) != len(b):
        return Comparison(math.inf, 0, f"{len(a)} floating-point outputs instead of {len(b)}")
    worst, compared = 0.0, 0
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            return Comparison(math.inf, compared, f"output {i} has shape {tuple(x.shape)}, not {tuple(y.shape)}")
        x, y = x.detach().double(), y.detach().double()
        if _nonfinite_mismatch(x, y):
            return Comparison(math.inf, compared, f"output {i} has NaN/inf at other positions than the original")
        finite = torch.isfinite(y)
        n = int(finite.sum())
        if n == 0:
            continue
        compared += n
        worst = max(worst, _relative(x[finite], y[finite]))
    return Comparison(worst, compared)


def relative_error(out: Any, ref: Any) -> float:
    """Relative error of ``out`` against ``ref`` (inf on any mismatch; NaN never)."""
    return compare_outputs(out, ref).error


def rollback_reason(cmp: Comparison, where: str, rtol: float) -> Reason:
    """Why verification rolled a unit back, as data: the code says whether the outputs, the backward or the
    gradients failed (the cause is the reason's part)."""
    if cmp.mismatch is None and cmp.error <= rtol and cmp.backward_failure is not None:
        cause = Reason(ReasonCode.BACKWARD_FAILED, f"training's backward failed: {cmp.backward_failure}")
    elif cmp.mismatch is None and cmp.error <= rtol and not cmp.gradients_pass(rtol):
        cause = Reason(ReasonCode.GRADIENTS_CHANGED, f"changed the gradients (relative error "
                       f"{cmp.gradient_error:.2e}) though it claims exact training")
    else:
        return Reason(ReasonCode.ROLLED_BACK, f"rolled back: changed the outputs beyond tolerance on {where}")
    return Reason(ReasonCode.ROLLED_BACK, f"rolled back: {cause.text}, on {where}", parts=(cause,))
