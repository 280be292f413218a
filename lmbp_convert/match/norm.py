"""Norm matcher: a LayerNorm/RMSNorm whose output reaches Linear layers through affine-commuting ops becomes a
`NormFold` — its affine folded into those Linears and re-applied for every other reader.

Three steps, each with a typed result, and a refusal (`Refused`, carrying a `Reason`) wherever one fails:
walk (the readers of the normalised tensor: foldable Linears and the rest) → re-apply sites (a module boundary
per other reader) → byte prediction and where β goes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

import torch
from torch import nn

from ..catalogue import LoraLayout, class_key
from ..fold import effective_scale, shift_is_expressible
from ..enums import BetaMode, ConvertedHook, NormType, ReapplyKind
from ..reasons import Reason, ReasonCode, option, then
from ..trace.graph import Node, Callee
from .commute import Block, Pass, is_metadata, op_short, step
from .context import MatchContext, tensor_bytes
from .plan import LinearTarget, NormFold, ParamTarget, ReapplySite, Skip
from .reach import follow
from .roles import NormRole, Role, ModuleRole, is_scripted, quantized_linear, user_hooks

#: config attribute written by the checkpoint CLI: norms whose affine is already folded on disk
CONFIG_KEY = "lmbp_convert"


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


def prefolded_norms(model: nn.Module) -> set[str]:
    """Norms the model's config says the checkpoint CLI folded on disk, named from ``model``: the record names
    them from the model class that loaded the checkpoint, which a wrapper (PEFT's) may hold under a prefix."""
    owner, prefix = model, ""
    for name, mod in model.named_modules():  # the outermost module that holds the config itself
        if isinstance(getattr(vars(mod).get("config"), CONFIG_KEY, None), dict):
            owner, prefix = mod, name + "." if name else ""
            break
    cfg = getattr(owner, "config", None)
    rec = getattr(cfg, CONFIG_KEY, None) if cfg is not None else None
    if isinstance(rec, dict):
        return {prefix + n for n in rec.get("folded_norms", [])}
    return set()


def match_norms(ctx: MatchContext) -> Iterator[NormFold | Skip]:
    if not ctx.opt.norms:
        return
    for name, role in ctx.roles.items():
        mod = ctx.modules.get(name)
        if mod is None or name in ctx.claimed or not ctx.opt.selected(name):
            continue
        if role.why:
            yield Skip(name, class_key(mod), role.why)
        elif role.plays is ModuleRole.NORM and role.norm.affine:  # affine-free ones: match/norm_free.py
            if role.norm.channel_dim != -1:  # channel-first norms: match/consumers.py (it claims the ones it takes)
                yield Skip(name, class_key(mod), Reason(ReasonCode.NO_CONSUMER, "channel-first norm whose output "
                                                        "reaches no consumer the fold can go into"))
                continue
            try:
                yield _adopt_prefolded(ctx, plan_norm(ctx, name, mod, role.norm))
            except Refused as why:
                yield _prefolded_swap(ctx, name, mod, role.norm) or Skip(name, class_key(mod), why.reason)


def _prefolded_swap(ctx: MatchContext, name: str, mod: nn.Module, nr: NormRole) -> NormFold | None:
    """A norm folded on disk whose consumers cannot take a fold (quantized) is still swapped (None: it cannot)."""
    if name not in ctx.prefolded:
        return None
    from .prefolded import plan_prefolded_swap  # it builds on this module's walk

    try:
        return plan_prefolded_swap(ctx, name, mod, nr)
    except Refused:
        return None


def _adopt_prefolded(ctx: MatchContext, fold: NormFold) -> NormFold:
    """A norm the checkpoint CLI folded on disk is only swapped (its weights are already the identity)."""
    if fold.name not in ctx.prefolded:
        return fold
    w = ctx.modules[fold.name].weight
    if w.device.type != "meta" and not torch.all(w.detach() == fold.param.identity):
        raise Refused(Reason(ReasonCode.PREFOLDED, "config says its affine is folded on disk, but its weight is not "
                             "the identity; left as is"))
    fold.prefolded = True
    fold.reapply = []
    return fold


def plan_norm(ctx: MatchContext, name: str, mod: nn.Module, nr: NormRole, walk: Walk | None = None) -> NormFold:
    """``walk``: an empty `Walk` to fill, with the parameter rows functional ops apply (`ParamTarget`s,
    match/functional.py) taken as targets; the caller (match/consumers.py) reads them there, even on a refusal.
    Without it they are readers like any other op."""
    node = _single_call(ctx, name, mod)
    walk = walk_readers(ctx, node.outputs[0], nr, mod.bias if nr.has_bias else None, walk)
    unseen = unseen_siblings(ctx, name, walk, nr.has_bias)  # consumers only other data would reach
    if isinstance(unseen, Reason):
        raise Refused(unseen)
    walk.targets.update(unseen)
    if walk.param_uses:  # a folded parameter must serve this norm's output alone
        from .functional import unknown_uses

        other_use = unknown_uses(ctx, walk.param_uses)
        if other_use is not None:
            raise Refused(other_use)
    if walk.inplace:
        raise Refused(inplace_reason(walk))
    demoted = _reapply_small_readers(ctx, node.outputs[0], walk) if walk.others else []
    if not walk.targets and not demoted and not walk.params:  # parameter rows count as targets
        why = no_target_reason(ctx, walk)
        raise Refused(_opaque_first(walk, why))
    try:
        sites = reapply_sites(ctx, walk)
    except Refused as why:  # the real cause first: consumers the fold cannot go into
        if walk.opaque:
            raise Refused(_opaque_first(walk, why.reason)) from None
        raise
    if walk.params:  # a ConsumerFold: folded even with exact norms
        beta_problem = next((ctx.beta_fold_problems[t] for t in walk.targets if t in ctx.beta_fold_problems), None)
        if beta_problem:
            raise Refused(beta_problem)
    watched = _watched_by_user_hooks(ctx, name, walk.seen, sites)
    if watched:
        raise Refused(Reason(ReasonCode.HOOKED, f"{watched}, which would see the normalised tensor without its "
                             "affine (folded into the next Linears); remove the hook or exclude this norm"))
    beta = _beta_mode(mod, nr, walk)
    return NormFold(name, class_key(mod), nr.norm_type, nr.param, nr.eps, list(nr.shape), nr.has_bias,
                    list(walk.targets.values()), sites, sorted(set(walk.caveats)),
                    predicted_norm_bytes(ctx, node, nr), beta=beta, out_dtype=emitted_dtype(ctx, node))


def inplace_reason(walk: Walk) -> Reason:
    return Reason(ReasonCode.IN_PLACE, f"output modified in place ({'; '.join(sorted(set(walk.inplace)))})")


def _opaque_first(walk: Walk, why: Reason) -> Reason:
    """``why``, after the consumers that apply their own weights (the real cause), if any."""
    if not walk.opaque:
        return why
    opaque = list(dict.fromkeys(walk.opaque))
    return then(opaque[0], "; ".join(r.text for r in opaque) + f" (and: {why})", *opaque[1:], why)


def emitted_dtype(ctx: MatchContext, node: Node) -> str | None:
    """The dtype the original norm cast its output to, where it differs from its input's (T5's norms cast to a
    half-precision weight, so an fp32 residual stream meets bf16 Linears): the memory-sharing norm must emit the
    same, or the next Linear gets another dtype. None: it kept the input's."""
    src, out = ctx.g.tensors[node.inputs[0]].dtype, ctx.g.tensors[node.outputs[0]].dtype
    return out if out != src else None


def _single_call(ctx: MatchContext, name: str, mod: nn.Module) -> Node:
    """The norm's one call in the graph, or a refusal."""
    hooks = user_hooks(mod)
    if hooks:  # their meaning would change: the output loses its affine, which moves into the next Linears
        raise Refused(Reason(ReasonCode.HOOKED, f"has {', '.join(hooks)} registered, which would see the normalised "
                             "output without its affine (folded into the next Linears); remove them or exclude this "
                             "norm"))
    calls = ctx.g.module_calls.get(name, 0)
    if calls == 0:
        raise Refused(Reason(ReasonCode.NOT_CALLED, "not called by the probe forward"))
    if calls > 1:
        raise Refused(Reason(ReasonCode.SHARED_CALL, f"called {calls} times per forward (shared module)"))
    (node,) = ctx.g.module_nodes(name)
    if len(node.outputs) != 1:
        raise Refused(Reason(ReasonCode.SIGNATURE, "norm returns more than one tensor"))
    return node


def no_target_reason(ctx: MatchContext, walk: Walk) -> Reason:
    """Why no Linear takes the fold, naming the real cause: a block counts only if a Linear lies beyond it
    (`reach.follow`); otherwise the Linears reached only through a non-commuting op, or where the channels end."""
    why = "no Linear consumer reachable through affine-commuting ops"
    blocks, behind, ends = [], {}, []
    for r in walk.others:
        reach = follow(ctx, r.node, r.tid, r.axis)
        is_linear = r.node is not None and ctx.roles.get(r.node.target, Role(ModuleRole.OTHER)).plays is ModuleRole.LINEAR
        if r.block and (is_linear or reach.linears or r.block.code is ReasonCode.QUANTIZED_LINEAR):
            blocks.append(r.block)
            continue
        for lin, via in reach.nearest().items():
            behind.setdefault(lin, via or r.what)
        ends += reach.ends
    quantized = sorted({b for b in blocks if b.code is ReasonCode.QUANTIZED_LINEAR}, key=str)
    if quantized:  # the real cause first: there are Linear consumers, but their weights are quantized
        rest = sorted(set(blocks) - set(quantized), key=str)
        return then(quantized[0], "; ".join(map(str, quantized)) + " (no other Linear consumer reachable through "
                    "affine-commuting ops" + (f"; blocked: {'; '.join(map(str, rest))})" if rest else ")"),
                    *quantized[1:], *rest)
    if blocks:
        uniq = sorted(set(blocks), key=str)
        return then(uniq[0], why + f" (blocked: {'; '.join(map(str, uniq))})", *uniq[1:])
    if behind:
        vias = sorted(set(behind.values()))
        also = sorted({p for lin in behind if (p := _weight_problem(ctx, lin, ctx.modules[lin]))}, key=str)
        return Reason(ReasonCode.BLOCKING_OP, why + f": its output reaches {_some(sorted(behind))} only through "
                      f"{'; '.join(vias)}, which does not commute with the norm's affine"
                      + (f" (and {'; '.join(map(str, also))})" if also else ""), parts=tuple(also))
    if ends:
        return Reason(ReasonCode.NO_CONSUMER,
                      why + f": no Linear reads its channels (they end in {_some(list(dict.fromkeys(ends)))})")
    return Reason(ReasonCode.NO_CONSUMER, why + ": its output is not read")


def _some(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def predicted_norm_bytes(ctx: MatchContext, node: Node, nr: NormRole) -> int:
    """The norm's input is no longer kept for backward (its output is, by the Linears, anyway); LayerNorm's
    per-row mean goes too (4 bytes a row)."""
    n, nbytes = tensor_bytes(ctx.g, node.inputs[0])
    rows = n // nr.shape[0]
    return nbytes + (rows * 4 if nr.norm_type is NormType.LAYER else 0)


def _beta_mode(mod: nn.Module, nr: NormRole, walk: Walk) -> BetaMode:
    if not nr.has_bias:
        return BetaMode.NONE
    if not any(t.adds_bias for t in walk.targets.values()):
        return BetaMode.FOLD
    if not shift_is_expressible(mod.bias, effective_scale(mod.weight, nr.param)):
        bare = next(t.name for t in walk.targets.values() if t.adds_bias)
        raise Refused(Reason(ReasonCode.SHIFT, f"{bare} has no bias to take the norm's shift, and γ = 0 on a channel "
                             "where β ≠ 0 (β cannot move behind the scale)", bare))
    return BetaMode.SHIFT


def unseen_siblings(ctx: MatchContext, norm: str, walk: Walk, has_beta: bool) -> dict[str, LinearTarget] | Reason:
    from .siblings import unseen_sibling_targets  # it builds on this module's walk

    return unseen_sibling_targets(ctx, norm, walk, has_beta)


# -- walk --------------------------------------------------------------------------------------------------
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


def _reapply_small_readers(ctx: MatchContext, out: int, walk: Walk) -> list[str]:
    """A norm whose affine is re-applied elsewhere keeps γ, β as parameters, so a Linear folded as well would
    have to be unfolded for every plain checkpoint. A Linear that reads only part of the output (a token
    slice, a pooled row: fewer elements) gets the affine re-applied at its input instead: it stays plain, at
    the cost of keeping that small part once more for backward. Returns the Linears moved."""
    whole = math.prod(ctx.g.tensors[out].shape)
    moved = []
    for lname, reader in list(walk.target_inputs.items()):
        if math.prod(ctx.g.tensors[reader.tid].shape) < whole:
            del walk.targets[lname]
            walk.others.append(reader)
            moved.append(lname)
    return moved


# -- re-apply sites ----------------------------------------------------------------------------------------
def reapply_sites(ctx: MatchContext, walk: Walk) -> list[ReapplySite]:
    """One module boundary per reader that is not a folded Linear (readers at the same boundary share it)."""
    sites: dict[tuple, ReapplySite] = {}
    for reader in walk.others:
        site = site_for(ctx, reader, walk.active_scopes)
        if site is None:
            raise Refused(Reason(ReasonCode.NO_REAPPLY_SITE, f"output also feeds {reader.what}, and there is no "
                                 "module boundary where the affine could be re-applied for it", reader.what))
        key = (site.kind, site.module, site.position, site.keyword)
        if key in sites:
            sites[key].paths += [p for p in site.paths if p not in sites[key].paths]
        else:
            sites[key] = site
    return list(sites.values())


def site_for(ctx: MatchContext, reader: Reader, active: set[int]) -> ReapplySite | None:
    """The innermost module boundary where the affine can be put back for ``reader`` alone (None: none)."""
    g, consumer, tid = ctx.g, reader.node, reader.tid
    if reader.axis != len(g.tensors[tid].shape) - 1:
        return None
    if consumer is None:  # escapes as a model output
        return ReapplySite(ReapplyKind.ROOT_OUTPUT, "", paths=[list(p) for p in g.root_outputs[tid]],
                           consumer="model output")
    if consumer.callee is Callee.MODULE and not is_scripted(ctx.modules.get(consumer.target)):  # (takes no hook)
        slots = consumer.info["slots"].get(tid, [])
        if len(slots) == 1 and g.module_calls.get(consumer.target) == 1:
            pos, kw = slots[0]
            return ReapplySite(ReapplyKind.MODULE_INPUT, consumer.target, pos, kw, consumer=consumer.target)
    for sidx in reversed(consumer.scopes):
        if sidx in active:
            return None  # this boundary (and every outer one) also feeds the folded Linears
        sc = g.scopes[sidx]
        slots = sc.args.get(tid, [])
        if len(slots) == 1 and g.module_calls.get(sc.module) == 1 and sc.module:
            s = slots[0]
            return ReapplySite(ReapplyKind.MODULE_INPUT, sc.module, s.position, s.keyword,
                               consumer=f"{op_short(consumer)} in {sc.module}")
    return None


def _foreign(hook) -> bool:
    """A hook the user (or another library) registered, not one of this package's re-apply hooks."""
    return not isinstance(getattr(hook, "__self__", hook), ConvertedHook)


def _watched_by_user_hooks(ctx: MatchContext, norm: str, affine_less: set[int],
                           sites: list[ReapplySite]) -> str | None:
    """A user's hook that sees a tensor the fold leaves without the affine (the norm's output on its way to the
    folded Linears): a forward pre-hook on a module it enters (an attention block, a dropout) unless the affine
    is re-applied at that very input (that re-apply runs first), or a forward/backward hook on a module that
    returns it. Verification cannot see an observing hook, so such a fold is refused."""
    reapplied = {(s.module, s.position, s.keyword) for s in sites if s.kind is ReapplyKind.MODULE_INPUT}
    for mname, slots, outputs, pre, post in _hooked_calls(ctx):
        if mname == norm:
            continue
        if pre and any((mname, pos, kw) not in reapplied for t in affine_less for pos, kw in slots.get(t, [])):
            return f"{mname} has forward pre-hooks registered"
        if post and affine_less.intersection(outputs):
            return f"{mname} returns the norm's output and has {' and '.join(post)} registered"
    return None


def _hooked_calls(ctx: MatchContext) -> list[tuple[str, dict, list[int], bool, list[str]]]:
    """(module, its input slots, its outputs, has foreign pre-hooks, kinds of foreign forward/backward hooks) of
    every module call whose module has a user's hook, found once per graph: each norm checks only these (most
    models have none), not every call of the model again."""
    if ctx.hooked_calls is None:
        calls = [(n.target, n.info["slots"], n.outputs) for n in ctx.g.nodes if n.callee is Callee.MODULE]
        calls += [(sc.module, {t: [(a.position, a.keyword) for a in sl] for t, sl in sc.args.items()}, sc.outputs)
                  for sc in ctx.g.scopes if sc.module]
        found = []
        for mname, slots, outputs in calls:
            mod = ctx.modules.get(mname)
            if mod is None:
                continue
            pre = any(_foreign(h) for h in mod._forward_pre_hooks.values())
            post = [k for k, hooks in (("forward hooks", mod._forward_hooks), ("backward hooks", mod._backward_hooks),
                                       ("backward pre-hooks", mod._backward_pre_hooks))
                    if any(_foreign(h) for h in hooks.values())]
            if pre or post:
                found.append((mname, slots, outputs, pre, post))
        ctx.hooked_calls = found
    return ctx.hooked_calls
