"""Catalogue roles + traced graph → a Plan. No mutation, no kernels: pure decisions with reasons."""
from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import nn

from ..catalogue import class_key
from ..fold import effective_scale, shift_is_expressible
from ..options import ConvertOptions
from ..trace.graph import Graph, Node
from .commute import Block, Pass, is_metadata, op_short, step
from .plan import ActSwap, LinearTarget, NormFold, Plan, ReapplySite, Skip
from .roles import Role, quantized_linear, user_hooks

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def _bytes(g: Graph, tid: int) -> tuple[int, int]:
    info = g.tensors[tid]
    n = math.prod(info.shape)
    return n, n * _ITEMSIZE.get(info.dtype, 4)


def code_bytes(numel: int, bits: int) -> int:
    """Bytes an approximate activation keeps for ``numel`` elements (3 bits use 4-bit slots)."""
    slot = 4 if bits == 3 else bits
    return math.ceil(numel * slot / 8)


def _foreign(hook) -> bool:
    """A hook the user (or another library) registered, not one of this package's re-apply hooks."""
    return not type(getattr(hook, "__self__", hook)).__module__.startswith("lmbp_convert")


class Planner:
    def __init__(self, model: nn.Module, graph: Graph, roles: dict[str, Role], options: ConvertOptions):
        self.model = model
        self.g = graph
        self.roles = roles
        self.opt = options
        self.modules = dict(model.named_modules())
        self.plan = Plan(options=options.summary())
        # parameters reachable under more than one module: tied weights
        owners: dict[int, list[str]] = defaultdict(list)
        for mname, mod in model.named_modules(remove_duplicate=False):
            for pname, p in mod.named_parameters(recurse=False, remove_duplicate=False):
                owners[id(p)].append(f"{mname}.{pname}" if mname else pname)
        self.param_owners = owners

    # -- entry point ---------------------------------------------------------------------------------
    def run(self) -> Plan:
        for name, mod in self.modules.items():
            if type(mod).__module__.startswith("lmbp_convert.nn"):
                self.plan.already_converted.append(name)
        claimed: set[str] = set()
        if self.opt.gated_mlp:
            from .gated import find_gated_mlps  # local import: optional pattern, kept in its own file

            for swap, skip in find_gated_mlps(self):
                if swap is not None:
                    self.plan.gated_mlps.append(swap)
                    claimed.add(swap.act_module)
                elif skip is not None:
                    self.plan.skips.append(skip)
        for name, role in self.roles.items():
            mod = self.modules.get(name)
            if mod is None or name in claimed:
                continue
            if role.problem and self.opt.norms and self.opt.selected(name):
                self.plan.skips.append(Skip(name, class_key(mod), role.problem))
            elif role.kind == "activation" and self.opt.activations and self.opt.selected(name):
                self._plan_activation(name, mod, role)
            elif role.kind == "norm" and self.opt.norms and self.opt.selected(name):
                self._plan_norm(name, mod, role)
        return self.plan

    # -- activations ---------------------------------------------------------------------------------
    def _plan_activation(self, name: str, mod: nn.Module, role: Role) -> None:
        saved = 0
        for node in self.g.module_nodes(name):
            if node.inputs:
                n, nbytes = _bytes(self.g, node.inputs[0])
                saved += nbytes - code_bytes(n, self.opt.bits)
        self.plan.act_swaps.append(ActSwap(name, class_key(mod), role.act, self.opt.bits, saved))

    # -- norms ---------------------------------------------------------------------------------------
    def _skip(self, name: str, mod: nn.Module, reason: str) -> None:
        self.plan.skips.append(Skip(name, class_key(mod), reason))

    def _linear_problem(self, node: Node, tid: int, has_beta: bool) -> str | None:
        name = node.target
        mod = self.modules[name]
        lora = self.roles[name].lora
        slots = node.info["slots"].get(tid, [])
        if not slots or slots[0] not in ((0, None), (None, "input"), (None, "x"), (None, "hidden_states")):
            return f"{name} takes the norm output as a secondary argument"
        if self.opt.excluded(name):
            return f"{name} is excluded by the options"
        if any(not type(h).__module__.startswith("lmbp_convert") for h in mod._forward_pre_hooks.values()):
            return (f"{name} has forward pre-hooks registered, which would see its input without the norm's "
                    "affine (folded into its weight)")
        if self.g.module_calls.get(name, 0) != 1:
            return f"{name} is called {self.g.module_calls.get(name, 0)} times per forward"
        if lora is not None:
            problem = self._lora_problem(name, mod, lora, has_beta)
            if problem:
                return problem
            mod = getattr(mod, lora["base"])
        quantized = quantized_linear(mod)
        if quantized:
            return f"consumer {name} is a quantized Linear ({quantized}): its weight cannot be folded"
        w = getattr(mod, "weight", None)
        if not isinstance(w, torch.Tensor) or not w.is_floating_point():
            return f"{name} has weights that cannot be rewritten ({getattr(w, 'dtype', None)})"
        owners = self.param_owners.get(id(w), [])
        if len(owners) > 1 and not self.opt.untie:
            return f"{name}.weight is tied to {', '.join(o for o in owners if not o.startswith(name + '.'))} (untie=True would fold into an untied copy)"
        return None

    @staticmethod
    def _lora_problem(name: str, mod: nn.Module, lora: dict, has_beta: bool) -> str | None:
        """Folding γ into lora_A is exact for any adapter; β is only exact while no adapter can see it."""
        use_dora = getattr(mod, "use_dora", None)
        if isinstance(use_dora, dict) and any(use_dora.values()):
            return f"{name} uses DoRA (magnitude vector depends on the weight norm; not folded)"
        if getattr(mod, "merged", False):
            return f"{name} has merged adapters; unmerge them first"
        if not has_beta:
            return None
        for adapter, drop in getattr(mod, lora["dropout"]).items():
            p = float(getattr(drop, "p", 0.0) or 0.0)
            if p > 0:
                return (f"{name}: adapter {adapter!r} has lora_dropout={p}, which would drop the norm's β on the "
                        "adapter path (convert before get_peft_model, or use lora_dropout=0)")
        for adapter, b in getattr(mod, lora["adapters_B"]).items():
            if b.weight.device.type != "meta" and bool(b.weight.detach().ne(0).any()):
                return (f"{name}: adapter {adapter!r} is already trained (lora_B ≠ 0), so the norm's β would have "
                        "to enter the adapter; convert before get_peft_model or before training")
        return None

    def _plan_norm(self, name: str, mod: nn.Module, role: Role) -> None:
        nr = role.norm
        hooks = user_hooks(mod)
        if hooks:  # their meaning would change: the output loses its affine, which moves into the next Linears
            return self._skip(name, mod, f"has {', '.join(hooks)} registered, which would see the normalised "
                                         "output without its affine (folded into the next Linears); remove them "
                                         "or exclude this norm")
        calls = self.g.module_calls.get(name, 0)
        if calls == 0:
            return self._skip(name, mod, "not called by the probe forward")
        if calls > 1:
            return self._skip(name, mod, f"called {calls} times per forward (shared module)")
        (node,) = self.g.module_nodes(name)
        if len(node.outputs) != 1:
            return self._skip(name, mod, "norm returns more than one tensor")
        out = node.outputs[0]
        d = nr.shape[0]
        targets: dict[str, LinearTarget] = {}
        target_inputs: dict[str, tuple[Node, int, int]] = {}
        others: list[tuple[Node | None, int, int, str]] = []  # consumer, tid, axis, what
        blocks: list[str] = []
        caveats: list[str] = []
        inplace: list[str] = []
        active_scopes: set[int] = set()
        frontier = [(out, len(self.g.tensors[out].shape) - 1, [])]
        seen: set[int] = set()
        while frontier:
            tid, axis, via = frontier.pop()
            if tid in seen:
                continue
            seen.add(tid)
            if tid in self.g.root_outputs:
                others.append((None, tid, axis, "model output"))
            for c in self.g.consumers(tid):
                if is_metadata(c):
                    continue
                if c.info.get("inplace"):
                    inplace.append(f"{op_short(c)} in {self._scope_name(c)}")
                    continue
                if c.kind == "module":
                    r = self.roles.get(c.target, Role("other"))
                    ndim = len(self.g.tensors[tid].shape)
                    if r.kind == "linear" and axis == ndim - 1:
                        problem = self._linear_problem(c, tid, nr.has_bias)
                        if problem is None:
                            mod_l = self.modules[c.target]
                            adapters = list(getattr(mod_l, r.lora["adapters_A"]).keys()) if r.lora else []
                            if r.lora:
                                mod_l = getattr(mod_l, r.lora["base"])
                            adds_bias = nr.has_bias and getattr(mod_l, "bias", None) is None
                            targets[c.target] = LinearTarget(c.target, r.layout, list(via), adds_bias,
                                                             r.lora["base"] if r.lora else None, adapters,
                                                             r.lora["adapters_A"] if r.lora else None)
                            target_inputs[c.target] = (c, tid, axis)
                            active_scopes.update(c.scopes)
                        else:
                            blocks.append(problem)
                            others.append((c, tid, axis, c.target))
                        continue
                    if r.kind in ("dropout", "identity"):
                        if r.kind == "dropout" and r.p:
                            blocks.append(f"dropout (p={r.p}) at {c.target} between norm and Linear")
                            others.append((c, tid, axis, c.target))
                            continue
                        active_scopes.update(c.scopes)
                        for o in c.outputs:
                            frontier.append((o, axis, via + [c.target]))
                        continue
                    quantized = quantized_linear(self.modules[c.target]) if axis == ndim - 1 else None
                    if quantized:
                        blocks.append(f"consumer {c.target} is a quantized Linear ({quantized}): its weight "
                                      "cannot be folded")
                    others.append((c, tid, axis, c.target))
                    continue
                if c.inputs and c.inputs[0] != tid and op_short(c).endswith("_as"):
                    continue  # t only provides a shape/dtype
                res = step(c, self.g.tensors, tid, axis, d)
                if isinstance(res, Pass):
                    active_scopes.update(c.scopes)
                    if res.caveat:
                        caveats.append(f"{res.caveat} ({self._scope_name(c)})")
                    for o in c.outputs:
                        ax = res.axis if res.axis >= 0 else len(self.g.tensors[o].shape) + res.axis
                        frontier.append((o, ax, via + [op_short(c)]))
                else:
                    if isinstance(res, Block):
                        blocks.append(f"{res.reason} ({self._scope_name(c)})")
                    others.append((c, tid, axis, f"{op_short(c)} in {self._scope_name(c)}"))
        if inplace:
            return self._skip(name, mod, f"output modified in place ({'; '.join(sorted(set(inplace)))})")
        demoted = self._reapply_small_readers(out, targets, target_inputs, others) if others else []
        if not targets and not demoted:
            quantized = sorted({b for b in blocks if "quantized Linear" in b})
            why = "no Linear consumer reachable through affine-commuting ops"
            if quantized:  # the real cause first: there are Linear consumers, but their weights are quantized
                rest = sorted(set(blocks) - set(quantized))
                why = "; ".join(quantized) + " (no other Linear consumer reachable through affine-commuting ops" + (
                    f"; blocked: {'; '.join(rest)})" if rest else ")")
            elif blocks:
                why += f" (blocked: {'; '.join(sorted(set(blocks)))})"
            return self._skip(name, mod, why)
        sites: dict[tuple, ReapplySite] = {}
        for consumer, tid, axis, what in others:
            site = self._site_for(consumer, tid, axis, active_scopes)
            if site is None:
                return self._skip(
                    name, mod,
                    f"output also feeds {what}, and there is no module boundary where the affine could be "
                    "re-applied for it",
                )
            key = (site.kind, site.module, site.position, site.keyword)
            if key in sites:
                for p in site.paths:
                    if p not in sites[key].paths:
                        sites[key].paths.append(p)
            else:
                sites[key] = site
        watched = self._watched_by_user_hooks(name, seen, sites)
        if watched:
            return self._skip(name, mod, f"{watched}, which would see the normalised tensor without its affine "
                                         "(folded into the next Linears); remove the hook or exclude this norm")
        n, nbytes = _bytes(self.g, node.inputs[0])
        rows = n // d
        predicted = nbytes + (rows * 4 if nr.kind == "layer" else 0)
        beta = "none" if not nr.has_bias else ("shift" if any(t.adds_bias for t in targets.values()) else "fold")
        if beta == "shift" and not shift_is_expressible(mod.bias, effective_scale(mod.weight, nr.param)):
            bare = next(t.name for t in targets.values() if t.adds_bias)
            return self._skip(name, mod, f"{bare} has no bias to take the norm's shift, and γ = 0 on a channel "
                                         "where β ≠ 0 (β cannot move behind the scale)")
        self.plan.norm_folds.append(
            NormFold(name, class_key(mod), nr.kind, nr.param, nr.eps, list(nr.shape), nr.has_bias,
                     list(targets.values()), list(sites.values()), sorted(set(caveats)), predicted, beta=beta)
        )

    def _watched_by_user_hooks(self, norm: str, affine_less: set[int], sites: dict) -> str | None:
        """A user's hook that sees a tensor the fold leaves without the affine (the norm's output on its way to the
        folded Linears): a forward pre-hook on a module it enters (an attention block, a dropout) unless the affine
        is re-applied at that very input (that re-apply runs first), or a forward/backward hook on a module that
        returns it. Verification cannot see an observing hook, so such a fold is refused."""
        reapplied = {(s.module, s.position, s.keyword) for s in sites.values() if s.kind == "module_input"}
        calls = [(n.target, n.info["slots"], n.outputs) for n in self.g.nodes if n.kind == "module"]
        calls += [(sc.module, {t: [(a.position, a.keyword) for a in sl] for t, sl in sc.args.items()}, sc.outputs)
                  for sc in self.g.scopes if sc.module]
        for mname, slots, outputs in calls:
            mod = self.modules.get(mname)
            if mod is None or mname == norm:
                continue
            pre = [h for h in mod._forward_pre_hooks.values() if _foreign(h)]
            if pre and any((mname, pos, kw) not in reapplied for t in affine_less for pos, kw in slots.get(t, [])):
                return f"{mname} has forward pre-hooks registered"
            post = [k for k, hooks in (("forward hooks", mod._forward_hooks), ("backward hooks", mod._backward_hooks),
                                       ("backward pre-hooks", mod._backward_pre_hooks))
                    if any(_foreign(h) for h in hooks.values())]
            if post and affine_less.intersection(outputs):
                return f"{mname} returns the norm's output and has {' and '.join(post)} registered"
        return None

    def _reapply_small_readers(self, out: int, targets: dict[str, LinearTarget],
                               target_inputs: dict[str, tuple[Node, int, int]], others: list) -> list[str]:
        """A norm whose affine is re-applied elsewhere keeps γ, β as parameters, so a Linear folded as well would
        have to be unfolded for every plain checkpoint. A Linear that reads only part of the output (a token
        slice, a pooled row: fewer elements) gets the affine re-applied at its input instead: it stays plain, at
        the cost of keeping that small part once more for backward. Returns the Linears moved."""
        whole = math.prod(self.g.tensors[out].shape)
        moved = []
        for lname, (node, tid, axis) in list(target_inputs.items()):
            if math.prod(self.g.tensors[tid].shape) < whole:
                del targets[lname]
                others.append((node, tid, axis, lname))
                moved.append(lname)
        return moved

    def _scope_name(self, node: Node) -> str:
        return self.g.scopes[node.scopes[-1]].module or "<model>" if node.scopes else "<model>"

    def _site_for(self, consumer: Node | None, tid: int, axis: int, active: set[int]) -> ReapplySite | None:
        if axis != len(self.g.tensors[tid].shape) - 1:
            return None
        if consumer is None:  # escapes as a model output
            return ReapplySite("root_output", "", paths=[list(p) for p in self.g.root_outputs[tid]],
                               consumer="model output")
        if consumer.kind == "module":
            slots = consumer.info["slots"].get(tid, [])
            if len(slots) == 1 and self.g.module_calls.get(consumer.target) == 1:
                pos, kw = slots[0]
                return ReapplySite("module_input", consumer.target, pos, kw, consumer=consumer.target)
        for sidx in reversed(consumer.scopes):
            if sidx in active:
                return None  # this boundary (and every outer one) also feeds the folded Linears
            sc = self.g.scopes[sidx]
            slots = sc.args.get(tid, [])
            if len(slots) == 1 and self.g.module_calls.get(sc.module) == 1 and sc.module:
                s = slots[0]
                return ReapplySite("module_input", sc.module, s.position, s.keyword,
                                   consumer=f"{op_short(consumer)} in {sc.module}")
        return None


def make_plan(model: nn.Module, graph: Graph, roles: dict[str, Role], options: ConvertOptions) -> Plan:
    return Planner(model, graph, roles, options).run()
