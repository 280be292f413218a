"""Norm matcher: a LayerNorm/RMSNorm whose output reaches Linear layers through affine-commuting ops becomes a
`NormFold` — its affine folded into those Linears and re-applied for every other reader.

Three steps, each with a typed result, and a refusal (`Refused`, carrying a `Reason`) wherever one fails:
walk (the readers of the normalised tensor: foldable Linears and the rest) → re-apply sites (a module boundary
per other reader) → byte prediction and where β goes.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
from torch import nn

from ..catalogue import class_key
from ..fold import effective_scale, shift_is_expressible
from ..enums import BetaMode, NormType, ReapplyKind
from ..reasons import Reason, ReasonCode, then
from ..trace.graph import Node, Callee
from .commute import op_short
from .context import MatchContext, tensor_bytes
from .plan import LinearTarget, NormFold, ReapplySite, Skip
from .reach import follow
from .roles import NormRole, Role, ModuleRole, is_scripted, user_hooks
from .norm_walk import Reader, Refused, Walk, _foreign, _weight_problem, walk_readers

#: config attribute written by the checkpoint CLI: norms whose affine is already folded on disk
CONFIG_KEY = "lmbp_convert"


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
    ctx.walks[name] = walk
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
