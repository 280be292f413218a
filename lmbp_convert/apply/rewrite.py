"""Plan → in-place rewrite of a live model, as reversible units.

Every unit is *prepared* first (new modules built, folded weights computed) so that nothing can fail once
mutation starts; ``apply()`` then only swaps references and ``undo()`` swaps them back exactly (the old
tensors are kept until the conversion is accepted).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..fold import effective_scale, fold_affine, fold_lora_a, shift_through_scale
from ..enums import BetaMode, NormType, ReapplyKind, WeightParam
from ..errors import ConversionError
from ..match.consumers import ConsumerFold
from ..match.loss import LossSwap, users_loss
from ..match.moe import RecomputeRegion
from ..match.norm_kept import NormKeep
from ..match.kinds import declared
from ..match.plan import ActSwap, GatedMLPSwap, LinearTarget, NormFold, NormSwap, OutputActSwap, PlanItem
from .hooks import AddShift, FollowModule, ReapplyInput, ReapplyOutput, register_output_reapply
from .load_hooks import FoldOnLoad, FoldParamsOnLoad


#: per-module hook registries carried from a swapped module to its replacement (state-dict hooks are not:
#: the replacement's state is not the original's)
HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
              "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


def module_aliases(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(module) → every (parent, attribute) that references it (shared modules have several)."""
    refs: dict[int, list[tuple[nn.Module, str]]] = {}
    for pname, parent in model.named_modules(remove_duplicate=False):
        for cname, child in parent.named_children():
            slots = refs.setdefault(id(child), [])
            if (parent, cname) not in slots:
                slots.append((parent, cname))
    return refs


@dataclass
class Unit:
    """One reversible rewrite: a list of (do, undo) steps."""

    label: str
    steps: list[tuple[Callable[[], None], Callable[[], None]]] = field(default_factory=list)
    applied: bool = False

    def apply(self) -> None:
        """Do every step; on any exception undo them (an interrupted step too: undos are idempotent and
        harmless on a step that did not happen, so an interrupt between a step and its bookkeeping is safe)."""
        done = []
        try:
            for do, undo in self.steps:
                done.append(undo)
                do()
        except BaseException:
            for undo in reversed(done):
                undo()
            raise
        self.applied = True

    def undo(self) -> None:
        """Undo every step; idempotent, so an interrupted undo can simply be run again."""
        if self.applied:
            for _, undo in reversed(self.steps):
                undo()
            self.applied = False


class UnitBuilder:
    def __init__(self, model: nn.Module):
        self.model = model
        self.modules = dict(model.named_modules())
        self.aliases = module_aliases(model)

    # -- primitive steps ------------------------------------------------------------------------
    def swap_module(self, unit: Unit, name: str, new: nn.Module) -> None:
        old = self.modules[name]
        new.train(old.training)
        self.carry_hooks(unit, old, new)
        for parent, attr in self.aliases.get(id(old), []):
            unit.steps.append((
                lambda p=parent, a=attr, n=new: setattr(p, a, n),
                lambda p=parent, a=attr, o=old: setattr(p, a, o),
            ))

    @staticmethod
    def carry_hooks(unit: Unit, old: nn.Module, new: nn.Module) -> None:
        """The user's forward (pre-)hooks and backward hooks on ``old`` run on ``new``. The planner has refused
        swaps where a hook's meaning would change (hooks seeing a norm's output, whose affine is folded away).
        ``new`` shares ``old``'s hook dictionaries, so the user's handles still remove them."""
        for attr in HOOK_DICTS:
            mine, theirs = getattr(new, attr), getattr(old, attr)
            if not theirs:
                continue
            shared = theirs if not mine else type(theirs)([*theirs.items(), *mine.items()])
            unit.steps.append((lambda a=attr, v=shared: setattr(new, a, v),
                               lambda a=attr, v=mine: setattr(new, a, v)))
        if old._backward_hooks:
            flag = new._is_full_backward_hook
            unit.steps.append((lambda: setattr(new, "_is_full_backward_hook", old._is_full_backward_hook),
                               lambda f=flag: setattr(new, "_is_full_backward_hook", f)))

    @staticmethod
    def swap_data(unit: Unit, param: torch.Tensor, new: torch.Tensor) -> None:
        old = param.data

        def do(p=param, n=new):
            p.data = n

        def undo(p=param, o=old):
            p.data = o

        unit.steps.append((do, undo))

    @staticmethod
    def set_attr(unit: Unit, obj: nn.Module, attr: str, value) -> None:
        """Set a parameter/attribute; undo puts back the module's registries exactly (membership and order, so
        ``named_parameters()`` and state_dict order, and a ``bias=None`` slot, come back as they were)."""
        saved: list = []

        def do(o=obj, a=attr, v=value):
            saved[:] = [dict(o._parameters), dict(o._buffers), a in o.__dict__, o.__dict__.get(a)]
            if a in o._parameters and not isinstance(v, nn.Parameter):
                del o._parameters[a]
            setattr(o, a, v)

        def undo(o=obj, a=attr):
            if not saved:
                return
            params, buffers, in_dict, plain = saved
            o._parameters.clear()
            o._parameters.update(params)
            o._buffers.clear()
            o._buffers.update(buffers)
            o.__dict__.pop(a, None)
            if in_dict:
                o.__dict__[a] = plain
            saved.clear()

        unit.steps.append((do, undo))

    @staticmethod
    def add_hook(unit: Unit, register: Callable[[], torch.utils.hooks.RemovableHandle]) -> None:
        box: list = []

        def undo() -> None:
            while box:
                box[-1].remove()
                box.pop()

        unit.steps.append((lambda: box.append(register()), undo))

    # -- units ----------------------------------------------------------------------------------
    def build(self, item: PlanItem) -> Unit:
        """The unit of any plan item, by the builder its kind declares (`match.kinds.RewriteKind.build`; a subclass
        of a registered item class gets its base's)."""
        kind = declared(type(item))
        if kind is None:
            raise TypeError(f"no unit builder for plan item {type(item).__qualname__}: declare its kind with "
                            "lmbp_convert.match.kinds.register_kind, or override its build_unit()")
        return kind.build(self, item)

    def activation(self, swap: ActSwap) -> Unit:
        from ..nn.activations import ApproxActivation

        unit = Unit(f"activation {swap.name}")
        self.swap_module(unit, swap.name, ApproxActivation(swap.act, swap.bits))
        return unit

    def output_activation(self, swap: OutputActSwap) -> Unit:
        from ..nn.activations import OUTPUT_KINDS

        unit = Unit(f"activation {swap.name}")
        self.swap_module(unit, swap.name, OUTPUT_KINDS[swap.act]())
        return unit

    def norm(self, fold: NormFold) -> Unit:
        unit = Unit(f"norm {fold.name}")
        old = self.modules[fold.name]
        bias = getattr(old, "bias", None) if fold.has_bias else None
        new = self._ms_norm(fold, old.weight, bias)
        self.swap_module(unit, fold.name, new)
        if not fold.prefolded:
            gamma = effective_scale(old.weight, fold.param)
            for t in fold.targets:
                self._fold_into(unit, t, gamma, bias if fold.beta is BetaMode.FOLD else None)
        loader = FoldOnLoad.for_fold(self.modules, fold)  # an unfolded checkpoint loaded later is folded too
        # a re-applied norm keeps γ, β: its own state dict says that its Linears hold the fold (not on meta: not yet)
        new.marks_fold = loader.marks and not loader.awaiting
        self.add_hook(unit, lambda h=loader: self.model.register_load_state_dict_pre_hook(h))
        self._add_norm_hooks(unit, fold, new)
        return unit

    @staticmethod
    def _ms_norm(fold: NormFold, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        """The memory-sharing norm that replaces the folded one (emitting the dtype the original emitted)."""
        new = UnitBuilder._ms_norm_for(fold, weight, bias)
        if fold.out_dtype is not None:
            new.out_dtype = getattr(torch, fold.out_dtype.rsplit(".", 1)[-1])
        return new

    @staticmethod
    def _ms_norm_for(fold: NormFold, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        from ..nn.norms import MSLayerNorm, MSRMSNorm

        cls = MSLayerNorm if fold.norm_type is NormType.LAYER else MSRMSNorm
        if fold.channel_axis() != -1:  # a channel-first norm (match/consumers.py)
            from ..nn.channel_first import channel_first_class

            cls = channel_first_class(cls)
        if fold.reapply:  # other branches still need γ, β: the MS norm keeps them for the re-apply hooks
            return cls.reapplying(tuple(fold.shape), fold.eps, weight, bias, fold.param)
        ident = WeightParam(fold.param).identity_fill
        new = cls(tuple(fold.shape), fold.eps, identity_affine=ident, dtype=weight.dtype, device=weight.device)
        if fold.norm_type is NormType.LAYER and (bias is None or fold.beta is BetaMode.SHIFT) and "bias" in new._buffers:
            del new._buffers["bias"]
        if fold.beta is BetaMode.SHIFT:  # the norm keeps β/γ as its own parameter (same key); see AddShift
            shift = shift_through_scale(bias, effective_scale(weight, fold.param))
            new.register_parameter("bias", nn.Parameter(shift, requires_grad=bias.requires_grad))
        return new

    def _fold_into(self, unit: Unit, t: LinearTarget, gamma: torch.Tensor, beta: torch.Tensor | None) -> None:
        """W' = W·diag(γ), b' = b + W·β into one target Linear (and γ into its LoRA adapters' A)."""
        lin = self.modules[t.name]
        if t.base:  # LoRA-wrapped: A(γ·x̂) = (A·diag(γ))·x̂; β only reaches the base (planner checked)
            for adapter in t.lora_adapters:
                a = getattr(lin, t.lora_a_attr)[adapter]
                a_new = fold_lora_a(a.weight, gamma)
                if a.weight.device.type != "meta":
                    self.swap_data(unit, a.weight, a_new)
            lin = getattr(lin, t.base)
        weight = getattr(lin, t.weight)
        bias = getattr(lin, "bias", None) if t.weight == "weight" else None  # a parameter target: bias untouched
        w_new, b_new = fold_affine(weight, bias, gamma, beta, t.layout)
        if weight.device.type == "meta":
            return
        self._set_weight(unit, lin, w_new, t.weight)
        if b_new is None:
            return
        if getattr(lin, "bias", None) is None:
            self.set_attr(unit, lin, "bias", nn.Parameter(b_new, requires_grad=lin.weight.requires_grad))
        else:
            self.swap_data(unit, lin.bias, b_new)

    def _add_norm_hooks(self, unit: Unit, fold: NormFold, new: nn.Module) -> None:
        """The shift for targets without a bias, and the affine re-applied for every other reader."""
        if fold.beta is BetaMode.SHIFT:
            for t in fold.targets:
                lin = self.modules[t.name]
                lin = getattr(lin, t.base) if t.base else lin
                hook = AddShift(new, t.layout, behind_scale=bool(fold.reapply))
                path = f"{t.name}.{t.base}" if t.base else t.name
                self.add_hook(unit, lambda h=hook, p=path: FollowModule(self.model, p, h, pre=False).attach(self.model))
        for site in fold.reapply:
            if site.kind is ReapplyKind.ROOT_OUTPUT:
                hook = ReapplyOutput(new, site.paths)
                self.add_hook(unit, lambda h=hook: register_output_reapply(self.model, h))
            else:
                hook = ReapplyInput(new, site.position, site.keyword)
                self.add_hook(unit, lambda h=hook, p=site.module: FollowModule(self.model, p, h, pre=True)
                              .attach(self.model))

    def _set_weight(self, unit: Unit, lin: nn.Module, w_new: torch.Tensor, attr: str = "weight") -> None:
        weight = getattr(lin, attr)
        tied = sum(1 for m in self.model.modules() for p in m._parameters.values() if p is weight) > 1
        if tied:  # only planned with untie=True: give this Linear its own weight
            self.set_attr(unit, lin, attr, nn.Parameter(w_new, requires_grad=weight.requires_grad))
        else:
            self.swap_data(unit, weight, w_new)

    def gated_mlp(self, swap: GatedMLPSwap) -> Unit:
        from ..nn.gated_mlp import MSGatedMLP

        unit = Unit(f"gated MLP {swap.name}")
        old = self.modules[swap.name]
        names = [n for n in (swap.gate, swap.up, swap.gate_up, swap.down) if n]
        names += [*swap.pre_down, *swap.post_down]
        children = {n: getattr(old, n) for n in names}
        kw = dict(act_kind=swap.act, down=swap.down, modules=children, gate_first=swap.gate_first,
                  pre_down=swap.pre_down, post_down=swap.post_down, cast_to_down=swap.cast_to_down)
        if swap.gate_up:
            kw["gate_up"] = swap.gate_up
        else:
            kw["gate"], kw["up"] = swap.gate, swap.up
        new = MSGatedMLP(**kw)
        self.swap_module(unit, swap.name, new)
        for n, child in children.items():  # a later unit swapping a child (an inner norm) reaches both parents
            self.aliases.setdefault(id(child), []).append((new, n))
        return unit


def affine_free_norm(builder: UnitBuilder, swap: NormSwap) -> Unit:
    """The memory-sharing norm with no affine at all: same maths, same (empty) state dict. It replays the replaced
    module in full precision (`_MSNorm.replaying`), which needs the model's shared-saves region open."""
    from ..nn.norms import MSLayerNorm, MSRMSNorm
    from .shared_hooks import add_region

    unit = Unit(f"affine-free norm {swap.name}")
    cls = MSLayerNorm if swap.norm_type is NormType.LAYER else MSRMSNorm
    new = cls(tuple(swap.shape), swap.eps).replaying(builder.modules[swap.name])
    builder.swap_module(unit, swap.name, new)
    if new._original is not None:
        add_region(builder, unit)
    return unit


def kept_affine_norm(builder: UnitBuilder, keep: NormKeep) -> Unit:
    """The memory-sharing norm that applies γ, β itself: the same Parameters under the same keys, no weight
    rewritten (so no load hook and no disk rule)."""
    from ..nn.affine_norms import MSAffineNorm

    unit = Unit(f"norm {keep.name} (affine kept)")
    old = builder.modules[keep.name]
    out = getattr(torch, keep.out_dtype.rsplit(".", 1)[-1]) if keep.out_dtype else None
    new = MSAffineNorm(keep.norm_type, keep.shape[0], keep.eps, old.weight, old.bias if keep.has_bias else None,
                       keep.param, out_dtype=out)
    builder.swap_module(unit, keep.name, new)
    return unit


def consumer_fold(builder: UnitBuilder, fold: ConsumerFold) -> Unit:
    """The norm fold of `UnitBuilder.norm` (MS norm, Linear targets, re-apply hooks), plus γ (and β) folded into the
    parameter rows that functional ops apply to the norm's output. Its load hook comes first, so it reads an
    arriving original γ, β before the norm's own hook puts the identity in their place."""
    from .param_fold import param_folds

    unit = Unit(f"norm {fold.name} (functional consumers)")
    old = builder.modules[fold.name]
    meta = any(_tensor(builder, t.weight).device.type == "meta" for t in fold.params)
    if fold.params and not fold.prefolded:
        hook = FoldParamsOnLoad(fold)
        builder.add_hook(unit, lambda h=hook: builder.model.register_load_state_dict_pre_hook(h))
    norm_unit = builder.norm(fold)
    if not fold.prefolded and not meta:
        gamma = effective_scale(old.weight, fold.param)
        beta = getattr(old, "bias", None) if fold.has_bias else None
        for name, new in param_folds(fold.params, lambda n: _tensor(builder, n), gamma, beta).items():
            builder.swap_data(unit, _tensor(builder, name), new)
    unit.steps += norm_unit.steps
    return unit


def _tensor(builder: UnitBuilder, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    return getattr(builder.modules[owner], attr)


def recompute_region(builder: UnitBuilder, item: RecomputeRegion) -> Unit:
    """Hooks on the module and its activations (`region_hooks`): nothing swapped, the state dict unchanged."""
    from .region_hooks import register_region

    unit = Unit(f"recompute region {item.name}")
    module, acts = builder.modules[item.name], [builder.modules[a] for a in item.acts]
    builder.add_hook(unit, lambda: _Handles(register_region(module, acts)))
    return unit


class _Handles:
    """Several hook handles removed as one (`UnitBuilder.add_hook` keeps one handle per step)."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def loss_swap(builder: UnitBuilder, item: LossSwap) -> Unit:
    """``loss_function`` set on the instance (the property transformers provides stores ``_loss_function``); undo
    puts the attribute back as it was (absent, or the user's own). Before anything changes, the memory-sharing
    loss is checked against the original on the matcher's calls: loss and logits gradient, fp32 and the model's
    logits dtype."""
    from ..nn.loss import MSCrossEntropyLoss

    mod = builder.modules[item.name]
    if users_loss(mod) is not None:  # set since the plan was made: the user's, never replaced
        raise ConversionError(f"{item.name or '<model>'}'s loss_function was set on the instance (the user's), which "
                              "the plan's loss swap would replace; convert(..., loss=False) leaves it as it is")
    new = MSCrossEntropyLoss(item.shift)
    why = loss_mismatch(mod.loss_function, new, item, getattr(mod, "config", None))
    if why is not None:
        raise ConversionError(f"the memory-sharing loss differs from {item.name or '<model>'}'s loss_function "
                              f"({why}); convert(..., loss=False) leaves the loss as it is")
    unit = Unit(f"loss {item.name or '<model>'}")
    state: list = []

    def do() -> None:
        state[:] = ["_loss_function" in mod.__dict__, mod.__dict__.get("_loss_function")]
        mod.loss_function = new

    def undo() -> None:
        if not state:
            return
        had, old = state
        mod.__dict__.pop("_loss_function", None)
        if had:
            mod.__dict__["_loss_function"] = old
        state.clear()

    unit.steps.append((do, undo))
    if item.head:
        _logits_head(unit, builder.modules[item.head])
    return unit


def _logits_head(unit: Unit, head: nn.Module) -> None:
    """The head's class set to `MSLogitsHead` (an nn.Linear subclass with the same forward), on the object itself:
    its Parameters, ties, hooks and state-dict keys are untouched, whatever other units do to them."""
    from ..nn.loss import MSLogitsHead

    if type(head) is not nn.Linear or "forward" in vars(head):
        raise ConversionError(f"the LM head is a {type(head).__name__} (its forward set on the instance: "
                              f"{'forward' in vars(head)}), not the plain nn.Linear the plan found")
    unit.steps.append((lambda: setattr(head, "__class__", MSLogitsHead),
                       lambda: setattr(head, "__class__", nn.Linear)))


def loss_mismatch(orig, new, item: LossSwap, config) -> str | None:
    """Why ``new`` is not ``orig`` on the check calls (None: it is): the loss within fp32 rounding, the logits
    gradient within one rounding of the logits' dtype (fp32 and ``item.logits_dtype``)."""
    from ..match.loss import example, replay, variants

    logits32, labels = example([2, 3, item.classes], item.classes)
    dtypes = dict.fromkeys([torch.float32, getattr(torch, item.logits_dtype, torch.float32)])
    for dtype in dtypes:
        for lab, extra in variants(list(logits32.shape), item.classes, labels):
            outs = []
            for fn in (orig, new):
                x = logits32.to(dtype).requires_grad_()
                loss = replay(fn, item.call, x, lab, config, extra)
                (g,) = torch.autograd.grad(loss, x)
                outs.append((loss.detach(), g))
            (l0, g0), (l1, g1) = outs
            if l1.dtype != l0.dtype or not torch.allclose(l1.double(), l0.double(), rtol=1e-5, atol=1e-6,
                                                          equal_nan=True):
                return f"loss {float(l1)} instead of {float(l0)} for {dtype} logits with {sorted(extra)}"
            eps = 2 * torch.finfo(dtype).eps + 8 * torch.finfo(torch.float32).eps  # + a few fp32 ulps of exp
            tol = eps * float(g0.abs().max()) + 1e-8
            if g1.dtype != g0.dtype or float((g1.double() - g0.double()).abs().max()) > tol:
                return f"logits gradient off by more than one rounding for {dtype} logits with {sorted(extra)}"
    return None
