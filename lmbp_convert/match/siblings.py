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
    from .norm_walk import module_problem

    seen: dict[str, dict[str, list[str]]] = {}  # container → member key → paths of its folded Linears
    for tname in walk.targets:
        for cname, key, rel in _memberships(ctx, tname):
            if not _under(norm, cname):
                seen.setdefault(cname, {}).setdefault(key, []).append(rel)
    found: dict[str, LinearTarget] = {}
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
                mod = ctx.modules.get(lname)
                if _signature(mod) != _signature(ctx.modules[tmpl.name]):
                    return Reason(ReasonCode.UNSEEN_CONSUMER, f"{head}, and it has no Linear {rel or 'itself'} shaped "
                                  "like theirs", mname)
                role = ctx.roles.get(lname)
                if role is None or role.plays is not ModuleRole.LINEAR:
                    return Reason(ReasonCode.UNSEEN_CONSUMER, f"{head}, and its {rel or 'module'} is not a plain "
                                  "Linear", mname)
                problem = module_problem(ctx, lname, has_beta)
                if problem is not None:
                    return Reason(ReasonCode.UNSEEN_CONSUMER, f"{head}, and it cannot take the fold: {problem}",
                                  mname, (problem,))
                base = getattr(mod, role.lora.base) if role.lora else mod
                found[lname] = replace(tmpl, name=lname, unseen=True, via=list(tmpl.via),
                                       adds_bias=has_beta and getattr(base, "bias", None) is None,
                                       lora_adapters=(list(getattr(mod, role.lora.adapters_a).keys())
                                                      if role.lora else []))
    return found
