"""The norm walker: from a norm's output, through affine-commuting ops, to the Linears its affine can fold into
and the other readers (`walk_readers` → a `Walk`), with why each Linear on the way cannot take the fold
(`linear_problem`, `module_problem`, `lora_problem`); `Refused` carries the `Reason` where planning stops.
Split from `match.norm`, which plans the fold from the walk (re-apply sites, bytes, β)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from ..catalogue import LoraLayout
from ..enums import ConvertedHook
from ..reasons import Reason, ReasonCode, option
from ..trace.graph import Node, Callee
from .commute import Block, Pass, is_metadata, op_short, step
from .context import MatchContext
from .plan import LinearTarget, ParamTarget
from .roles import NormRole, Role, ModuleRole, quantized_linear



class Refused(Exception):
    """This norm cannot be folded; ``reason`` says why (it becomes the skip's)."""

    def __init__(self, reason: Reason) -> None:
        super().__init__(reason.text)
        self.reason = reason


class Reader(NamedTuple):
    """A reader of the normalised tensor (or of a tensor derived from it through commuting ops)."""

    node: Node | None  # None: the tensor is a model output
    tid: int
    axis: int  # where the norm's channels are in that tensor
    what: str  # how the report names the reader
    block: Reason | None = None  # why the fold cannot pass this reader on its way to a Linear (if it is on one)


@dataclass
class Walk:
    """Everything reachable from the norm's output through affine-commuting ops."""

    targets: dict[str, LinearTarget] = field(default_factory=dict)  # Linears the affine folds into
    target_inputs: dict[str, Reader] = field(default_factory=dict)  # ... and where each reads
    others: list[Reader] = field(default_factory=list)  # readers that need the affine re-applied
    blocks: list[Reason] = field(default_factory=list)  # why a Linear on the way cannot take the fold
    caveats: list[str] = field(default_factory=list)
    inplace: list[str] = field(default_factory=list)  # in-place ops on the affine-less tensor
    opaque: list[Reason] = field(default_factory=list)  # modules applying their own weights to it (not nn.Linear)
    active_scopes: set[int] = field(default_factory=set)  # module calls on a path to a folded Linear
    param_uses: dict[str, set[int]] = field(default_factory=dict)  # folded parameters → the ops applying them
    params: list[ParamTarget] = field(default_factory=list)  # parameter rows functional ops apply (`ConsumerFold`)
    problems: list[Reason] = field(default_factory=list)  # why a functional consumer of that kind cannot take it
    seen: set[int] = field(default_factory=set)  # the affine-less tensors



def walk_readers(ctx: MatchContext, out: int, nr: NormRole, beta: torch.Tensor | None = None,
                 into: Walk | None = None) -> Walk:
    """Every reader of the norm's output ``out``, through affine-commuting ops: the Linears the affine can fold
    into and the others (with why a Linear on the way cannot take it). ``into``: a `Walk` to fill, which also
    takes functional consumers' parameter rows (`plan_norm`)."""
    return _Walker(ctx, nr.shape[0], nr.has_bias, beta, into).run(out, nr.channel_dim)


class _Walker:
    """Follows the normalised tensor through affine-commuting ops to the Linears that can take the fold."""

    def __init__(self, ctx: MatchContext, d: int, has_beta: bool, beta: torch.Tensor | None = None,
                 into: Walk | None = None):
        self.ctx, self.g, self.d, self.has_beta, self.beta = ctx, ctx.g, d, has_beta, beta
        self.rows = into is not None  # functional consumers' rows are taken as targets
        self.walk = into if into is not None else Walk()
        self.frontier: list[tuple[int, int, list[str]]] = []

    def run(self, out: int, channel_dim: int = -1) -> Walk:
        w = self.walk
        self.frontier.append((out, channel_dim % len(self.g.tensors[out].shape), []))
        while self.frontier:
            tid, axis, via = self.frontier.pop()
            if tid in w.seen:
                continue
            w.seen.add(tid)
            if tid in self.g.root_outputs:
                w.others.append(Reader(None, tid, axis, "model output"))
            for c in self.g.consumers(tid):
                if is_metadata(c):
                    continue
                if c.info.get("inplace"):
                    w.inplace.append(f"{op_short(c)} in {self.ctx.scope_name(c)}")
                elif c.callee is Callee.MODULE:
                    self._module(c, tid, axis, via)
                elif not (c.inputs and c.inputs[0] != tid and op_short(c).endswith("_as")):  # else: shape only
                    self._op(c, tid, axis, via)
        return w

    def _module(self, c: Node, tid: int, axis: int, via: list[str]) -> None:
        w = self.walk
        r = self.ctx.roles.get(c.target, Role(ModuleRole.OTHER))
        last = axis == len(self.g.tensors[tid].shape) - 1
        if r.plays is ModuleRole.LINEAR and last:
            return self._linear(c, r, tid, axis, via)
        block = None
        if r.plays is ModuleRole.DROPOUT and r.p:
            block = Reason(ReasonCode.BLOCKING_OP, f"dropout (p={r.p}) at {c.target} between norm and Linear", c.target)
            w.blocks.append(block)
        elif r.plays in (ModuleRole.DROPOUT, ModuleRole.IDENTITY):
            w.active_scopes.update(c.scopes)
            self.frontier.extend((o, axis, via + [c.target]) for o in c.outputs)
            return
        else:
            quantized = quantized_linear(self.ctx.modules[c.target]) if last else None
            if quantized:
                block = quantized_reason(c.target, quantized)
                w.blocks.append(block)
        w.others.append(Reader(c, tid, axis, c.target, block))

    def _linear(self, c: Node, r: Role, tid: int, axis: int, via: list[str]) -> None:
        w = self.walk
        problem = linear_problem(self.ctx, c, tid, self.has_beta)
        if problem is not None:
            w.blocks.append(problem)
            w.others.append(Reader(c, tid, axis, c.target, problem))
            return
        mod = self.ctx.modules[c.target]
        adapters = list(getattr(mod, r.lora.adapters_a).keys()) if r.lora else []
        if r.lora:
            mod = getattr(mod, r.lora.base)
        adds_bias = self.has_beta and getattr(mod, "bias", None) is None
        w.targets[c.target] = LinearTarget(c.target, r.layout, list(via), adds_bias,
                                           r.lora.base if r.lora else None, adapters,
                                           r.lora.adapters_a if r.lora else None)
        w.target_inputs[c.target] = Reader(c, tid, axis, c.target)
        w.active_scopes.update(c.scopes)

    def _op(self, c: Node, tid: int, axis: int, via: list[str]) -> None:
        w = self.walk
        res = step(c, self.g.tensors, tid, axis, self.d)
        if isinstance(res, Pass) and res.unless_beta and self.has_beta:
            res = Block(Reason(ReasonCode.BLOCKING_OP, res.unless_beta))
        if isinstance(res, Pass):
            w.active_scopes.update(c.scopes)
            if res.caveat:
                w.caveats.append(f"{res.caveat} ({self.ctx.scope_name(c)})")
            for o in c.outputs:
                ax = res.axis if res.axis >= 0 else len(self.g.tensors[o].shape) + res.axis
                self.frontier.append((o, ax, via + [op_short(c)]))
            return
        block = None
        if isinstance(res, Block):
            block = Reason(res.reason.code, f"{res.reason} ({self.ctx.scope_name(c)})", self.ctx.scope_name(c))
        if block is None and self._functional(c, tid, axis, via):
            return
        if block:
            w.blocks.append(block)
        elif op_short(c) in _WEIGHT_OPS:
            own = _own_weight_use(self.ctx, c, self.d)
            if own:
                w.blocks.append(own)
                w.opaque.append(own)
        w.others.append(Reader(c, tid, axis, f"{op_short(c)} in {self.ctx.scope_name(c)}", block))

    def _functional(self, c: Node, tid: int, axis: int, via: list[str]) -> bool:
        """An op applying a parameter to the channels (the consumer table, match/functional.py): a fold target, or
        its problems recorded. True: it is taken (or read as a blocked reader); False: the walk goes on with it."""
        from .functional import Reading, read_by

        v = read_by(Reading(self.ctx, c, tid, axis, self.d, self.has_beta, self.beta, via), self.rows)
        w = self.walk
        if v.use is not None:
            w.targets.setdefault(v.use.param, v.use.target())
            w.param_uses.setdefault(v.use.param, set()).add(c.idx)
            w.active_scopes.update(c.scopes)
            return True
        if v.params:
            w.params += v.params
            w.active_scopes.update(c.scopes)  # no re-apply site may enclose it
            return True
        w.problems += v.problems
        blocked = v.blocked
        if not blocked:
            return False
        w.blocks += blocked
        w.opaque += blocked
        w.others.append(Reader(c, tid, axis, f"{op_short(c)} in {self.ctx.scope_name(c)}", blocked[0]))
        return True


#: ops that apply a weight to their input: consumers a fold could in principle go into
_WEIGHT_OPS = {"linear", "_grouped_mm", "grouped_mm", "matmul", "mm", "bmm", "baddbmm", "addmm", "einsum", "__matmul__"}


def _own_weight_use(ctx: MatchContext, node: Node, d: int) -> Reason | None:
    """A module that applies its own parameters to the norm's output through an op instead of an nn.Linear (an MoE
    router's F.linear on its weight; experts held as 3-D parameters, applied to the routed tokens): the fold cannot
    go into it (not supported), which the skip reason should say rather than "no Linear"."""
    scope = ctx.scope_name(node)
    mod = ctx.modules.get(scope)
    if mod is None:
        return None
    for pname, p in mod.named_parameters(recurse=False):
        if p.is_floating_point() and p.dim() >= 2 and d in p.shape[-2:]:
            if p.dim() >= 3:
                return Reason(ReasonCode.OWN_WEIGHT, f"{scope} ({type(mod).__name__}) holds its experts as {p.dim()}-D "
                              f"parameters ({pname} {tuple(p.shape)}) applied to the routed tokens through "
                              f"{op_short(node)} in a way the fold cannot follow back to the parameter (expert "
                              "selection, transposes and casts only)", scope)
            return Reason(ReasonCode.OWN_WEIGHT, f"{scope} ({type(mod).__name__}) applies its own weight ({pname} "
                          f"{tuple(p.shape)}) through {op_short(node)} in a way the fold cannot follow back to the "
                          "parameter", scope)
    return None


def linear_problem(ctx: MatchContext, node: Node, tid: int, has_beta: bool) -> Reason | None:
    """Why the Linear ``node`` cannot take the fold of the tensor ``tid`` (None: it can)."""
    name = node.target
    slots = node.info["slots"].get(tid, [])
    if not slots or slots[0] not in ((0, None), (None, "input"), (None, "x"), (None, "hidden_states")):
        return Reason(ReasonCode.WEIGHTS, f"{name} takes the norm output as a secondary argument", name)
    if ctx.g.module_calls.get(name, 0) != 1:
        return Reason(ReasonCode.SHARED_CALL, f"{name} is called {ctx.g.module_calls.get(name, 0)} times per forward",
                      name)
    return module_problem(ctx, name, has_beta)


def module_problem(ctx: MatchContext, name: str, has_beta: bool) -> Reason | None:
    """Why the Linear module ``name`` cannot take a fold, whatever its input (None: it can)."""
    mod = ctx.modules[name]
    lora = ctx.roles[name].lora
    if ctx.opt.excluded(name):
        return Reason(ReasonCode.EXCLUDED, f"{name} is excluded by the options", name)
    if any(_foreign(h) for h in mod._forward_pre_hooks.values()):
        return Reason(ReasonCode.HOOKED, f"{name} has forward pre-hooks registered, which would see its input without "
                      "the norm's affine (folded into its weight)", name)
    if lora is not None:
        problem = lora_problem(name, mod, lora, False)
        if problem:
            return problem
        beta_problem = lora_problem(name, mod, lora, has_beta)
        if beta_problem and ctx.opt.fold_norms:
            return beta_problem
        if beta_problem:  # exact norms leave the adapter alone: only a norm that stays a fold is refused
            ctx.beta_fold_problems[name] = beta_problem
        mod = getattr(mod, lora.base)
    return _weight_problem(ctx, name, mod)


def quantized_reason(name: str, how: str) -> Reason:
    return Reason(ReasonCode.QUANTIZED_LINEAR, f"consumer {name} is a quantized Linear ({how}): its weight cannot be "
                  "folded", name)


def _weight_problem(ctx: MatchContext, name: str, mod: nn.Module) -> Reason | None:
    quantized = quantized_linear(mod)
    if quantized:
        return quantized_reason(name, quantized)
    w = getattr(mod, "weight", None)
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        return Reason(ReasonCode.WEIGHTS, f"{name} has weights that cannot be rewritten ({getattr(w, 'dtype', None)})",
                      name)
    owners = ctx.param_owners.get(id(w), [])
    if len(owners) > 1 and not ctx.opt.untie:
        return Reason(ReasonCode.TIED_WEIGHT, f"{name}.weight is tied to "
                      f"{', '.join(o for o in owners if not o.startswith(name + '.'))} ({option('untie')} would fold "
                      "into an untied copy)", name)
    return None


def lora_problem(name: str, mod: nn.Module, lora: LoraLayout, has_beta: bool) -> Reason | None:
    """Folding γ into lora_A is exact for any adapter; β is only exact while no adapter can see it."""
    use_dora = getattr(mod, "use_dora", None)
    if isinstance(use_dora, dict) and any(use_dora.values()):
        return Reason(ReasonCode.LORA_STATE, f"{name} uses DoRA (magnitude vector depends on the weight norm; not "
                      "folded)", name)
    if getattr(mod, "merged", False):
        return Reason(ReasonCode.LORA_STATE, f"{name} has merged adapters; unmerge them first", name)
    if not has_beta:
        return None
    for adapter, drop in getattr(mod, lora.dropout).items():
        p = float(getattr(drop, "p", 0.0) or 0.0)
        if p > 0:
            return Reason(ReasonCode.LORA_STATE, f"{name}: adapter {adapter!r} has lora_dropout={p}, which would drop "
                          "the norm's β on the adapter path (convert before get_peft_model, or use lora_dropout=0)",
                          name)
    for adapter, b in getattr(mod, lora.adapters_b).items():
        if b.weight.device.type != "meta" and bool(b.weight.detach().ne(0).any()):
            return Reason(ReasonCode.LORA_STATE, f"{name}: adapter {adapter!r} is already trained (lora_B ≠ 0), so the "
                          "norm's β would have to enter the adapter; convert before get_peft_model or before "
                          "training", name)
    return None


def _foreign(hook) -> bool:
    """A hook the user (or another library) registered, not one of this package's re-apply hooks."""
    return not isinstance(getattr(hook, "__self__", hook), ConvertedHook)
