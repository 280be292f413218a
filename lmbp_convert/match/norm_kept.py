"""Affine-keeping fallback for norms whose fold is refused: where a consumer keeps the norm's output for its own
backward anyway (a Linear reading a post-LN output whose residual add sits in the same forward, a tied head), the
norm becomes a memory-sharing norm that keeps γ, β as its parameters (`NormKeep`) and computes its backward from
that output — so its input is no longer kept. Planned only where it saves bytes: some consumer keeps the very
output (same storage, in the dtype it computes in), and nothing else keeps the input.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from ..catalogue import class_key
from ..fold import unreliable_channels
from ..enums import NormType, WeightParam
from ..reasons import Reason, ReasonCode
from ..trace.graph import Node, Callee
from .commute import is_metadata, op_short
from .context import MatchContext, tensor_bytes
from .norm import emitted_dtype, plan_norm
from .norm_walk import Refused
from .plan import AffineNormItem, Skip
from .readers import At, end_readers
from .roles import NormRole, Role, ModuleRole, quantized_linear, user_hooks

#: ops whose result shares its input's storage (what a consumer saves of a view is the norm's output itself)
_VIEW_OPS = {"view", "reshape", "transpose", "permute", "flatten", "unflatten", "squeeze", "unsqueeze", "t",
             "view_as", "reshape_as", "expand", "expand_as", "movedim", "swapaxes", "narrow"}
#: ops that keep their *result* for backward: a norm input made by one of them stays kept whatever the norm does
_SAVE_OUTPUT_OPS = {"tanh", "sigmoid", "exp", "relu", "relu_", "softmax", "log_softmax", "sqrt", "rsqrt", "elu",
                    "hardtanh", "threshold", "logsigmoid", "exp2", "reciprocal"}


@dataclass
class NormKeep(AffineNormItem):
    """A norm whose affine could not be folded, swapped for a memory-sharing norm that keeps γ, β (the same
    Parameters) and computes its backward from its output, which ``keepers`` keep for their backward anyway."""

    tag = "norm_keeps"
    noun = "norms (affine kept)"
    noun_one = "norm (affine kept)"
    heading = "norms → memory-sharing (affine kept, backward from the output)"

    keepers: list[str] = field(default_factory=list)  # consumers that keep the norm's output for backward
    fold_refused: str = ""  # why the affine could not be folded
    kept_channels: int = 0  # channels whose input column is kept (γ too small to invert), at conversion
    predicted_saved_bytes: int = 0
    out_dtype: str | None = None

    def describe(self) -> list[str]:
        kept = f"; {self.kept_channels} channel(s) keep their input (γ too small to invert)" if self.kept_channels \
            else ""
        return [f"  {self.name} [{self.norm_type}, {self.param}] → output shared with {', '.join(self.keepers)}{kept}",
                f"      fold refused: {self.fold_refused}"]


def match_kept_affine_norms(ctx: MatchContext) -> Iterator[NormKeep]:
    """Norms with an affine that no earlier matcher took (their fold was refused): an affine-keeping MS norm
    where it saves bytes; otherwise nothing (the refusal the norm matcher reported stands)."""
    if not (ctx.opt.norms and getattr(ctx.opt, "keep_affine", True)):
        return
    for name, role in ctx.roles.items():
        mod = ctx.modules.get(name)
        if (mod is None or name in ctx.claimed or role.plays is not ModuleRole.NORM or role.why
                or not role.norm.affine or not ctx.opt.selected(name) or name in ctx.prefolded):
            continue
        try:
            plan_norm(ctx, name, mod, role.norm)
            continue  # foldable: the norm matcher's business (it was dropped there for another reason)
        except Refused as why:
            refused = why.reason.text
        try:
            yield plan_kept(ctx, name, mod, role.norm, refused)
        except Refused:
            pass


def plan_kept(ctx: MatchContext, name: str, mod: nn.Module, nr: NormRole, refused: str) -> NormKeep:
    if user_hooks(mod):
        raise Refused(Reason(ReasonCode.HOOKED, "has hooks registered"))
    if ctx.g.module_calls.get(name, 0) != 1:
        raise Refused(Reason(ReasonCode.SHARED_CALL, "not called exactly once"))
    (node,) = ctx.g.module_nodes(name)
    if len(node.inputs) != 1 or len(node.outputs) != 1:
        raise Refused(Reason(ReasonCode.SIGNATURE, "takes or returns more than one tensor"))
    x, y = ctx.g.tensors[node.inputs[0]], ctx.g.tensors[node.outputs[0]]
    w, b = getattr(mod, "weight", None), getattr(mod, "bias", None) if nr.has_bias else None
    if not isinstance(w, nn.Parameter) or w.dim() != 1 or (b is not None and not isinstance(b, nn.Parameter)):
        raise Refused(Reason(ReasonCode.WEIGHTS, "its affine is not a pair of 1-D Parameters"))
    d = w.numel()
    if x.shape != y.shape or not x.shape or x.shape[-1] != d or tuple(nr.shape) not in ((), (d,)):
        raise Refused(Reason(ReasonCode.SIGNATURE, "does not normalise the last dim of one tensor"))
    if w.device.type == "meta":
        raise Refused(Reason(ReasonCode.WEIGHTS, "its parameters are on the meta device"))
    keepers = output_keepers(ctx, node.outputs[0])
    if not keepers:
        raise Refused(Reason(ReasonCode.NO_CONSUMER, "no consumer keeps its output for backward"))
    other = input_kept_elsewhere(ctx, node.inputs[0], node)
    if other:
        raise Refused(Reason(ReasonCode.NO_GAIN, f"its input stays kept anyway ({other})"))
    saved = kept_bytes_saved(ctx, node, nr, w, b)
    if saved <= 0:
        raise Refused(Reason(ReasonCode.NO_GAIN, "keeping the channels γ cannot invert would cost what it saves"))
    return NormKeep(name, class_key(mod), nr.norm_type, nr.param, nr.eps, [d], b is not None, keepers, refused,
                    _unreliable_count(w, b, nr.param), saved, emitted_dtype(ctx, node))


def _unreliable_count(w: torch.Tensor, b: torch.Tensor | None, param: WeightParam) -> int:
    return int(unreliable_channels(w, b, param is WeightParam.ONE_PLUS_W).sum())


def kept_bytes_saved(ctx: MatchContext, node: Node, nr: NormRole, w: torch.Tensor, b: torch.Tensor | None) -> int:
    """The input (and LayerNorm's per-row mean) no longer kept, less the input columns of the channels whose
    x̂ cannot be recovered from the output (and the per-row mean they need); ≤ 0 where the module falls back."""
    n, nbytes = tensor_bytes(ctx.g, node.inputs[0])
    d = w.numel()
    rows = n // d
    k = _unreliable_count(w, b, nr.param)
    if k > d // 2:
        return 0  # the module runs the plain norm
    mean = rows * 4 if nr.norm_type is NormType.LAYER else 0
    side = (nbytes // n) * rows * k + (rows * 4 if nr.norm_type is NormType.LAYER else 0) + k * 8 if k else 0
    return nbytes + mean - side


def output_keepers(ctx: MatchContext, out: int) -> list[str]:
    """Consumers that keep ``out`` itself (or a view of it) for their backward: Linear-like modules whose weight
    (or a LoRA adapter without dropout) is trained."""
    def through(c: Node, at: At) -> list[At] | None:
        if c.callee is Callee.MODULE:
            role = ctx.roles.get(c.target, Role(ModuleRole.OTHER))
            passes = role.plays is ModuleRole.IDENTITY or (role.plays is ModuleRole.DROPOUT and not role.p)
        else:
            passes = bool(c.inputs) and c.inputs[0] == at[0] and (op_short(c) in _VIEW_OPS or _basic_getitem(c))
        return [(o, None) for o in c.outputs] if passes else None

    found = [c.target for c, _ in end_readers(ctx.g, (out, None), through)
             if c.callee is Callee.MODULE and _keeper(ctx, c.target)]
    return sorted(set(found))


def _keeper(ctx: MatchContext, name: str) -> bool:
    role = ctx.roles.get(name, Role(ModuleRole.OTHER))
    return role.plays is ModuleRole.LINEAR and _keeps_input(ctx, name, role)


def _basic_getitem(c: Node) -> bool:
    """``t[...]`` with ints, slices, None and Ellipsis only: a view (HF heads slice ``h[:, -k:, :]``)."""
    if op_short(c) != "__getitem__":
        return False
    args = c.info.get("args", ())
    if len(args) < 2:
        return False
    idx = args[1]
    items = [idx] if not isinstance(idx, tuple) or (idx and idx[0] == "slice") else list(idx)
    return all(it is None or it == "..." or (isinstance(it, int) and not isinstance(it, bool))
               or (isinstance(it, tuple) and it and it[0] == "slice") for it in items)


def _keeps_input(ctx: MatchContext, name: str, role: Role) -> bool:
    mod = ctx.modules[name]
    if role.lora:
        drops = dict(getattr(mod, role.lora.dropout, {}).items())
        for adapter, a in getattr(mod, role.lora.adapters_a).items():
            if a.weight.requires_grad and not float(getattr(drops.get(adapter), "p", 0.0) or 0.0):
                return True
        mod = getattr(mod, role.lora.base)
    if quantized_linear(mod):
        return False  # what a quantized kernel keeps is its own business
    w = getattr(mod, "weight", None)
    return isinstance(w, torch.Tensor) and w.requires_grad


def input_kept_elsewhere(ctx: MatchContext, tid: int, norm: Node) -> str | None:
    """Why the norm's input would stay kept without the norm keeping it (None: nothing else keeps it): another
    reader of it (or of the tensor it is a view of), or an op that keeps its result made it."""
    while True:
        readers = [c for c in ctx.g.consumers(tid) if c is not norm and not is_metadata(c)]
        if readers:
            return f"also read by {', '.join(sorted({_what(c) for c in readers}))}"
        prod = ctx.g.tensors[tid].producer
        if prod is None:
            return None
        p = ctx.g.nodes[prod]
        short = op_short(p) if p.callee is Callee.OP else ""
        if short in _SAVE_OUTPUT_OPS:
            return f"made by {short}, which keeps its result"
        if short in _VIEW_OPS and p.inputs:
            norm, tid = p, p.inputs[0]
            continue
        return None


def _what(c: Node) -> str:
    return c.target if c.callee is Callee.MODULE else op_short(c)


__all__ = ["NormKeep", "Skip", "match_kept_affine_norms", "plan_kept"]
