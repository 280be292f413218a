"""Consumers the trace could not see: members of a ModuleList/ModuleDict that the probe did not run.

A trace sees only the branches its probe takes. In a mixture of experts the experts are members of one container
(a ``ModuleList``/``ModuleDict``) called in a loop over the experts the router picked, so an expert the probe
routed no token to is absent from the graph, although on other inputs it reads the same normalised tensor (the
rows routed to it: token indexing commutes with a per-channel scale) through the same path as its siblings.
Folding the norm into the siblings that ran and not into it would be silently wrong.

Rule: for every container that holds Linears the norm folds into (and that does not hold the norm itself: the
decoder-layer stack a norm lives in is not one of its consumers), each member the probe never ran is taken to
consume the output like the members that did. If it has the same structure (the same Linears at the same paths,
same class and weight shape) and those Linears can take a fold, they become fold targets too (marked ``unseen``);
otherwise the norm is refused, with the reason naming that member. A fold whose consumers depend on data and are
not all known is never made.

The same holds one level up, without a container: the module that called a fold target (its lowest ancestor
that ran, not one holding the norm) may call another of its children on other runs. A direct child of it that
the probe never ran, shaped like the target (same class, same weight shape), is taken as such an alternative:
PEFT's ``modules_to_save`` wrapper runs a trained copy of the head and, under ``disable_adapter()``, its
``original_module`` (left unfolded, the disabled head was 0.60 off on GPT-J).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from torch import nn

from ..reasons import Reason, ReasonCode
from ..trace.graph import Callee
from .plan import LinearTarget
from .roles import ModuleRole

if TYPE_CHECKING:
    from .context import MatchContext
    from .norm_walk import Walk

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _memberships(ctx: "MatchContext", name: str) -> list[tuple[str, str, str]]:
    """(container, member key, path inside the member) for every ModuleList/ModuleDict above module ``name``."""
    parts = name.split(".")
    out = []
    for i in range(1, len(parts)):
        cname = ".".join(parts[:i])
        if isinstance(ctx.modules.get(cname), _CONTAINERS):
            out.append((cname, parts[i], ".".join(parts[i + 1:])))
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _signature(mod: nn.Module | None) -> tuple | None:
    w = getattr(mod, "weight", None)
    return None if mod is None else (type(mod), tuple(getattr(w, "shape", ())))


def _other_readers_in(ctx: "MatchContext", walk: "Walk", member: str) -> str | None:
    """A reader of the output inside ``member`` that is not a folded Linear (it would need the affine put back
    in the unseen members as well)."""
    for r in walk.others:
        if r.node is None:
            continue
        names = [r.node.target] if r.node.callee is Callee.MODULE else []
        names += [ctx.g.scopes[s].module for s in r.node.scopes]
        if any(_under(n, member) for n in names):
            return r.what
    return None


def unseen_sibling_targets(ctx: "MatchContext", norm: str, walk: "Walk",
                           has_beta: bool) -> dict[str, LinearTarget] | Reason:
    """The fold targets in container members the probe did not run (see the module doc), or why the fold must be
    refused."""
    seen: dict[str, dict[str, list[str]]] = {}  # container → member key → paths of its folded Linears
    for tname in walk.targets:
        for cname, key, rel in _memberships(ctx, tname):
            if not _under(norm, cname):
                seen.setdefault(cname, {}).setdefault(key, []).append(rel)
    found: dict[str, LinearTarget] = {}
    for tname, alt, caller in _unrun_alternatives(ctx, norm, walk):
        head = (f"consumers depend on the data and are not all known: {alt} (a child of {caller} that the probe "
                f"did not run, shaped like {tname}, which reads this norm's output)")
        got = _as_target(ctx, alt, walk.targets[tname], head, alt, "", has_beta)
        if isinstance(got, Reason):
            return got
        found[alt] = got
    for cname, members in seen.items():
        keys = list(members)
        rels = list(dict.fromkeys(r for k in keys for r in members[k]))
        for key, member in ctx.modules[cname].named_children():
            mname = _join(cname, key)
            if key in members or ctx.g.module_calls.get(mname, 0) or any(
                    ctx.g.module_calls.get(n, 0) for n, _ in member.named_modules(prefix=mname)):
                continue  # it ran on the probe: the trace knows what it reads
            like = ", ".join(_join(cname, k) for k in keys[:3]) + (" ..." if len(keys) > 3 else "")
            head = (f"consumers depend on the data and are not all known: {mname} (a member of {cname} that the "
                    f"probe did not run; its siblings {like} read this norm's output)")
            inner = next((r for k in keys for r in [_other_readers_in(ctx, walk, _join(cname, k))] if r), None)
            if inner is not None:
                return Reason(ReasonCode.UNSEEN_CONSUMER, f"{head}, and its siblings also read it other than through "
                              f"Linears ({inner})", mname)
            for rel in rels:
                lname = _join(mname, rel)
                tmpl = walk.targets[_join(cname, next(k for k in keys if rel in members[k]), rel)]
                got = _as_target(ctx, lname, tmpl, head, mname, rel, has_beta)
                if isinstance(got, Reason):
                    return got
                found[lname] = got
    return found


def _ran(ctx: "MatchContext", name: str, mod: nn.Module) -> bool:
    return any(ctx.g.module_calls.get(n, 0) for n, _ in mod.named_modules(prefix=name))


def _unrun_alternatives(ctx: "MatchContext", norm: str, walk: "Walk") -> list[tuple[str, str, str]]:
    """(fold target, unrun child shaped like it, their caller) for each target's lowest ancestor that ran and
    does not hold the norm (see the module doc)."""
    out = []
    for tname in list(walk.targets):
        parts = tname.split(".")
        caller = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)
                       if ctx.g.module_calls.get(".".join(parts[:i]), 0)), None)
        if caller is None or _under(norm, caller):
            continue
        for key, child in ctx.modules[caller].named_children():
            cname = _join(caller, key)
            if (cname not in walk.targets and not _ran(ctx, cname, child)
                    and _signature(child) == _signature(ctx.modules[tname])):
                out.append((tname, cname, caller))
    return out


def _as_target(ctx: "MatchContext", lname: str, tmpl: LinearTarget, head: str, member: str, rel: str,
               has_beta: bool) -> LinearTarget | Reason:
    """``lname`` as an unseen fold target like ``tmpl``, or why the fold must be refused."""
    from .norm_walk import module_problem

    mod = ctx.modules.get(lname)
    if _signature(mod) != _signature(ctx.modules[tmpl.name]):
        return Reason(ReasonCode.UNSEEN_CONSUMER, f"{head}, and it has no Linear {rel or 'itself'} shaped "
                      "like theirs", member)
    role = ctx.roles.get(lname)
    if role is None or role.plays is not ModuleRole.LINEAR:
        return Reason(ReasonCode.UNSEEN_CONSUMER, f"{head}, and its {rel or 'module'} is not a plain Linear", member)
    problem = module_problem(ctx, lname, has_beta)
    if problem is not None:
        return Reason(ReasonCode.UNSEEN_CONSUMER, f"{head}, and it cannot take the fold: {problem}",
                      member, (problem,))
    base = getattr(mod, role.lora.base) if role.lora else mod
    return replace(tmpl, name=lname, unseen=True, via=list(tmpl.via),
                   adds_bias=has_beta and getattr(base, "bias", None) is None,
                   lora_adapters=(list(getattr(mod, role.lora.adapters_a).keys()) if role.lora else []))
