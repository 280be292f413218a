"""Disk rules: how the items of each plan kind go into a plain checkpoint (one `DiskRule` per kind, declared as `RewriteKind.disk` in `lmbp_convert.rewrites`).

A kind without a rule is a module swap only, which ``convert()`` makes when it loads the written checkpoint; today
only norm folds (`FoldOnDisk`, `ConsumerFoldOnDisk`) change stored weights. The planner (`diskplan._Planner`)
asks a rule whether an item fits on disk and which tensors it rewrites, and how.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..enums import Layout
from ..match.consumers import ConsumerFold
from ..match.plan import LinearTarget, NormFold, PlanItem
from .disk_actions import STORED, Action, ActionKind

if TYPE_CHECKING:
    from .diskplan import _Planner

__all__ = ["DiskRule", "FoldOnDisk", "ConsumerFoldOnDisk"]


class DiskRule(Protocol):
    """How the items of one kind go into a plain checkpoint."""

    def problem(self, p: _Planner, item: PlanItem) -> tuple[str | None, bool]:
        """(why a plain checkpoint cannot hold it or None, whether it needs an untied head)."""

    def actions(self, p: _Planner, item: PlanItem) -> dict[str, Action]:
        """Model tensor name → how its output tensor is made."""

    def targets(self, item: PlanItem) -> list[str]:
        """The other layers whose tensors it rewrites."""

    def summary(self, item: PlanItem) -> dict:
        """Its entry in the disk plan's JSON."""

    def describe(self, item: PlanItem) -> str:
        """Its line in the printed disk plan."""


class FoldOnDisk:
    """A norm fold: γ (and β) written into the following Linears, the norm's weight set to the identity."""

    def problem(self, p: _Planner, f: NormFold) -> tuple[str | None, bool]:
        if f.prefolded:
            return "already folded on disk (config.json records it)", False
        if f.reapply:
            where = "; ".join(r.describe() for r in f.reapply)
            return (f"its affine must be re-applied at run time for {where}, which a plain checkpoint cannot "
                    "express (convert() does it when it loads the model)"), False
        bare = next((t.name for t in f.targets if t.adds_bias), None)
        if bare is not None:
            return (f"{bare} has no bias to take the norm's shift (beta); the plain architecture cannot express "
                    "the fold"), False
        return self._tensor_problem(p, f)

    @staticmethod
    def _tensor_problem(p: _Planner, f: NormFold) -> tuple[str | None, bool]:
        names = [f"{f.name}.weight"] + ([f"{f.name}.bias"] if f.has_bias else [])
        needs_untie = False
        for t in f.targets:
            if t.through_op or t.weight != "weight":  # a parameter the module applies itself (MoE experts)
                problem = _param_sources(p, t, f.shape[0])
                if isinstance(problem, str):
                    return problem, False
                continue
            names.append(f"{t.name}.weight")
            if f"{t.name}.bias" in p.view.state:
                names.append(f"{t.name}.bias")
            w = p.view.state.get(f"{t.name}.weight")
            if w is None:
                return f"{t.name} has no weight tensor", False
            if len(w[0]) != 2 or [w[0][1] if t.layout is Layout.OUT_IN else w[0][0]] != list(f.shape):
                return f"{t.name}.weight has shape {list(w[0])}, which does not take {f.shape[0]} inputs", False
            if len(p.view.group(f"{t.name}.weight")) > 1:
                if not p.untie:
                    return f"{t.name}.weight is tied (--untie folds into an untied copy)", False
                needs_untie = True
        problem = next((pr for pr in map(p._tensor_problem, names) if pr), None)
        return (problem, False) if problem else (None, needs_untie)

    def actions(self, p: _Planner, f: NormFold) -> dict[str, Action]:
        gk = p.key_of(f"{f.name}.weight")
        bk = p.key_of(f"{f.name}.bias") if f.has_bias else None
        acts = {f"{f.name}.weight": Action(ActionKind.IDENTITY, f.name, f.param)}
        if f.has_bias:
            acts[f"{f.name}.bias"] = Action(ActionKind.ZERO, f.name, f.param)
        for t in f.targets:
            if t.through_op or t.weight != "weight":  # no bias: such targets are planned only without β
                for name, layout in _param_sources(p, t, f.shape[0]):
                    acts[name] = Action(ActionKind.FOLD_W, f.name, f.param, layout, gamma=gk)
                continue
            acts[f"{t.name}.weight"] = Action(ActionKind.FOLD_W, f.name, f.param, t.layout, gamma=gk)
            if f"{t.name}.bias" in p.view.state and bk is not None:
                acts[f"{t.name}.bias"] = Action(ActionKind.FOLD_B, f.name, f.param, t.layout, gamma=gk, beta=bk,
                                                weight=p.key_of(f"{t.name}.weight"))
        return acts

    def targets(self, f: NormFold) -> list[str]:
        return [t.name for t in f.targets]

    def summary(self, f: NormFold) -> dict:
        return {"norm": f.name, "norm_type": f.norm_type, "param": f.param, "into": [t.label for t in f.targets]}

    def describe(self, f: NormFold) -> str:
        kind = f"{f.norm_type}, {f.param}" + (", +bias" if f.has_bias else "")
        return f"  fold {f.name} [{kind}] -> {', '.join(t.label for t in f.targets)}"




#: converter operations that only stack or join whole tensors along a dim (transformers' MoE expert merges)
_JOINS = ("MergeModulelist", "Concatenate")


def _param_sources(p: _Planner, t: LinearTarget, d: int) -> list[tuple[str, Layout]] | str:
    """The checkpoint tensors holding a parameter target (MoE experts as one 3-D parameter): the parameter itself
    when stored as it is, or the per-expert tensors a load-time converter stacks into it (transformers ≥ 5 saves
    Mixtral / Qwen-MoE experts as ``experts.{e}.w1.weight`` …), each folded along its own input dim. Only joins
    that leave the input dim in place are followed; otherwise the reason why not."""
    name = t.weight_key
    key = p.key_of(name)
    if key is not None:
        info = p.src.infos[key]
        if len(info.shape) < 2 or info.shape[-1 if t.layout is Layout.OUT_IN else -2] != d:
            return f"{name} has shape {list(info.shape)}, which does not take {d} inputs"
        problem = p._tensor_problem(name)
        return problem if problem else [(name, t.layout)]
    sources = sorted(k for k, m in p.km.converted.items() if m == name)
    if not sources:
        return f"{name} is not in the checkpoint"
    for k in sources:
        info, ops = p.src.infos[k], p.km.operations.get(k)
        ndim = len(info.shape)
        if t.layout is not Layout.OUT_IN or ndim < 2 or info.shape[-1] != d or ops is None:
            return (f"{name} is made at load time from {k} {list(info.shape)} by a conversion the disk fold does "
                    "not follow (convert() folds it when it loads the model)")
        for op, dim in ops:  # each join must leave the input dim (the last) where it is
            out_ndim = ndim + 1 if op == "MergeModulelist" else ndim
            if op not in _JOINS or not isinstance(dim, int) or dim % out_ndim == out_ndim - 1:
                return (f"{name} is made at load time from {k} by {op}(dim={dim}), which the disk fold does not "
                        "follow (convert() folds it when it loads the model)")
            ndim = out_ndim
        if not info.is_float:
            return f"{k} is stored as {info.dtype} (quantized or integer), which cannot be rewritten"
    return [(STORED + k, Layout.OUT_IN) for k in sources]


class ConsumerFoldOnDisk(FoldOnDisk):
    """A norm folded into functional consumers (`ConsumerFold`): on disk only where each is a whole 2-D weight that
    F.linear applies (γ: W·diag(γ), as a Linear) and β, if any, goes into one whole bias parameter; rows of a
    weight (nn.MultiheadAttention's in_proj), bias pieces assembled in forward (EVA's q/k/v biases), convolutions
    and channel-first norms are refused with that reason (convert() folds them when it loads the checkpoint)."""

    def problem(self, p: _Planner, f: ConsumerFold) -> tuple[str | None, bool]:
        if f.channel_dim != -1:
            return "a channel-first norm: its memory-sharing form is made by convert() when it loads the model", False
        for t in f.params:
            why = self._param_problem(t)
            if why:
                return f"{t.describe()}: {why}; convert() folds it when it loads the model", False
        reason, untie = super().problem(p, f)
        if reason:
            return reason, untie
        names = [t.weight for t in f.params] + [b.tensor for t in f.params for b in t.bias]
        problem = next((pr for pr in map(p._tensor_problem, names) if pr), None)
        return (problem, False) if problem else (None, untie)

    @staticmethod
    def _param_problem(t) -> str | None:
        if t.conv:
            return "the on-disk fold does not rewrite convolutions"
        if t.rows:
            return "the on-disk fold rewrites whole weights, not a block of rows"
        if len(t.bias) > 1 or any(not b.parameter for b in t.bias):
            return "its bias is assembled in forward from several tensors"
        return None

    def actions(self, p: _Planner, f: ConsumerFold) -> dict[str, Action]:
        acts = super().actions(p, f)
        gk = p.key_of(f"{f.name}.weight")
        bk = p.key_of(f"{f.name}.bias") if f.has_bias else None
        for t in f.params:
            acts[t.weight] = Action(ActionKind.FOLD_W, f.name, f.param, Layout.OUT_IN, gamma=gk)
            for b in t.bias:
                acts[b.tensor] = Action(ActionKind.FOLD_B, f.name, f.param, Layout.OUT_IN, gamma=gk, beta=bk,
                                        weight=p.key_of(t.weight))
        return acts

    def targets(self, f: ConsumerFold) -> list[str]:
        return super().targets(f) + [t.weight.rpartition(".")[0] for t in f.params]
