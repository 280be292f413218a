"""Drop-in replacement for a LLaMA-style gated MLP that saves only x, g and u for backward.

`MSGatedMLP` keeps the original projection modules under their original attribute names (so state_dict keys,
LoRA wrappers and hooks on gate/up are untouched), computes g and u by calling those modules, and hands the
tail ``down(act(g)·u)`` to `lmbp_convert.ops.gated_mlp`. How the down projection is run (`down_support`):

* plain ``nn.Linear`` (no forward override, no hooks): the fused op with its weight and bias;
* PEFT ``lora.Linear`` over such a Linear, vanilla LoRA with dropout 0 (any number of active adapters,
  merged or disabled adapters, ``lora_bias``): the fused op with the adapters' A/B tensors;
* anything else (LoRA dropout > 0, LoRA variants such as DoRA, custom or quantised Linears, hooked modules):
  called unchanged through `lmbp_convert.ops.gated_recompute.gated_act_recomputed`, which turns what it saves
  of h (h, a view or a cast of it) into a recipe recomputed from g and u in backward. Exact; it saves g, u and
  whatever the module saves besides h.

Between the product and the down projection, ``pre_down`` children (Dropout, Identity, a norm) run in order,
then an optional cast to the down projection's weight dtype (``cast_to_down``); ``post_down`` children
(Dropout, Identity) run on the output. While the pre-down chain is an identity (nn.Identity, Dropout with p = 0
or in eval, no cast needed) it is skipped and the down projection runs as above. A leading nn.Dropout with p > 0
in training is applied to u instead (dropout(act(g)·u) = act(g)·dropout(u), the same mask from the same draw;
equal up to rounding of the order of the two products), so the down projection still reads the product and only
dropout's mask is kept, not the dropped product. Otherwise (a norm, a cast) the rest of the chain and the down
projection are called unchanged as one consumer through `gated_act_recomputed`: what the chain saves of h
itself (a norm's input, a cast of h) is recomputed, while a new tensor it makes (a norm's output) is kept as
eager autograd keeps it.

``down_mode="recompute"`` runs every down projection that way, with no knowledge of the module. Against the
fused path it keeps the rank-r A(h) of a LoRA adapter (the fused op recomputes it) and computes act(g) once
more in backward; docs/gated_recompute.md has the measurements.
"""
from __future__ import annotations

from typing import Literal, Mapping, Optional, Sequence, get_args

import torch
import torch.nn.functional as F
from torch import nn

from ..enums import ConvertedModule
from ..ops.gated_mlp import ACT_KINDS, LoraAdapter, gated_mlp
from ..ops.gated_recompute import gated_act_recomputed

__all__ = ["MSGatedMLP", "down_support", "DOWN_MODES", "DownMode"]

#: How the down projection is run: fused into the op where it can be (``"fused"``) or called as is with h
#: recomputed for its backward (``"recompute"``).
DownMode = Literal["fused", "recompute"]
DOWN_MODES: tuple[str, ...] = get_args(DownMode)


def _peft_lora_linear_cls():
    """peft.tuners.lora.Linear when peft is importable, else None (imported lazily: peft is optional)."""
    try:
        from peft.tuners.lora import Linear
    except Exception:  # pragma: no cover - depends on the environment
        return None
    return Linear


def _is_plain_linear(m: nn.Module) -> bool:
    """An nn.Linear whose forward is F.linear(x, weight, bias) and that no hook or patched forward observes."""
    return (isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward and "forward" not in m.__dict__
            and not m._forward_hooks and not m._forward_pre_hooks)


def _observed(m: nn.Module) -> bool:
    """A hook sees the call, other than this package's notes for memory sharing (`NoteInput`: ``only_notes``),
    which a caller computing the module's output itself may skip."""
    hooks = (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
    return any(not getattr(h, "only_notes", False) for h in hooks)


def _is_peft_lora_linear(m: nn.Module) -> bool:
    if not type(m).__module__.startswith("peft."):
        return False
    cls = _peft_lora_linear_cls()
    return (cls is not None and isinstance(m, cls) and type(m).forward is cls.forward
            and "forward" not in m.__dict__ and not _observed(m))


def _lora_adapters(down: nn.Module) -> list[LoraAdapter]:
    """The active adapters of a PEFT lora.Linear as op inputs; NotImplementedError for what is not exact."""
    if down.disable_adapters or down.merged:
        return []
    cast_input = getattr(down, "cast_input_dtype_enabled", True)
    adapters = []
    for name in down.active_adapters:
        if name not in down.lora_A.keys():
            continue
        variant = getattr(down, "lora_variant", {}).get(name)
        if variant is not None or getattr(down, "use_dora", {}).get(name, False):
            raise NotImplementedError(
                f"MSGatedMLP: LoRA adapter {name!r} on the down projection uses a variant "
                f"({type(variant).__name__ if variant is not None else 'DoRA'}); only vanilla LoRA is supported")
        drop = down.lora_dropout[name]
        if not (isinstance(drop, nn.Identity) or (isinstance(drop, nn.Dropout) and drop.p == 0)):
            raise NotImplementedError(
                f"MSGatedMLP: LoRA adapter {name!r} on the down projection has lora_dropout > 0; the "
                f"memory-sharing MLP would have to save the dropout mask, which it does not support")
        lora_a, lora_b, scale = down.lora_A[name], down.lora_B[name], down.scaling[name]
        if not (_is_plain_linear(lora_a) and _is_plain_linear(lora_b)) or lora_a.bias is not None:
            raise NotImplementedError(f"MSGatedMLP: LoRA adapter {name!r}: A/B are not plain Linear layers")
        if isinstance(scale, torch.Tensor) or not isinstance(scale, (int, float)):
            raise NotImplementedError(f"MSGatedMLP: LoRA adapter {name!r}: non-scalar scaling")
        adapters.append(LoraAdapter(lora_a.weight, lora_b.weight, lora_b.bias, float(scale), cast_input))
    return adapters


def _is_identity(m: nn.Module) -> bool:
    """A module that returns its input unchanged in its current mode, with no hook or patched forward observing
    the call: nn.Identity, nn.Dropout with p = 0 or in eval."""
    if m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__:
        return False
    if type(m).forward is nn.Identity.forward:
        return True
    return (isinstance(m, nn.Dropout) and type(m).forward is nn.Dropout.forward
            and (m.p == 0 or not m.training))


def _is_plain_dropout(m: nn.Module) -> bool:
    """nn.Dropout itself (an elementwise mask, no hook or patched forward seeing its input)."""
    return (isinstance(m, nn.Dropout) and type(m).forward is nn.Dropout.forward and "forward" not in m.__dict__
            and not m._forward_hooks and not m._forward_pre_hooks)


def down_support(down: nn.Module) -> str:
    """How `MSGatedMLP` runs this down projection: ``"linear"``, ``"lora"`` (both fused) or ``"eager"`` (called
    unchanged, h recomputed for its backward), the latter also for the PEFT LoRA features the fused op does not
    reproduce: lora_dropout > 0, LoRA variants such as DoRA."""
    return _down_plan(down)[0]


def _down_plan(down: nn.Module) -> tuple[str, list[LoraAdapter]]:
    """`down_support`'s answer with the adapters it read (the forward uses both: the adapters are read once)."""
    if _is_plain_linear(down):
        return "linear", []
    if _is_peft_lora_linear(down):
        base = down.get_base_layer()
        if not _is_plain_linear(base) or getattr(down, "fan_in_fan_out", False):
            return "eager", []
        try:
            return "lora", _lora_adapters(down)  # raises for what the fused op cannot reproduce
        except NotImplementedError:
            return "eager", []
    return "eager", []


class MSGatedMLP(ConvertedModule, nn.Module):
    """``down(act(gate(x)) · up(x))`` (or a fused ``gate_up`` split in two) saving only x, g and u.

    Args:
        act_kind: ``"silu"``, ``"gelu"`` (erf) or ``"gelu_tanh"``.
        down: attribute name of the down projection.
        gate, up: attribute names of separate gate / up projections, or
        gate_up: attribute name of a fused projection whose output is chunked in two along the last dim;
        gate_first: with ``gate_up``, whether the first half is the gate (Phi-3: True).
        pre_down: attribute names of modules run in order between the product and ``down`` (Dropout, a norm);
        post_down: attribute names of modules run in order on ``down``'s output (Dropout, Identity);
        cast_to_down: cast the product to ``down.weight``'s dtype before ``down`` when they differ (T5);
        modules: the modules by attribute name; exactly the names above.
        down_mode: ``"fused"`` (default) or ``"recompute"`` (see the module docstring).

    The modules are registered under those names, so the state_dict keys equal the replaced MLP's (as long
    as its other children hold no parameters or buffers). In the fused mode the down projection's support
    (`down_support`) is decided on every forward, since adapters can change after construction.
    """

    def __init__(self, act_kind: str, down: str, gate: Optional[str] = None, up: Optional[str] = None,
                 gate_up: Optional[str] = None, gate_first: bool = True, *,
                 modules: Mapping[str, nn.Module], down_mode: DownMode = "fused", pre_down: Sequence[str] = (),
                 post_down: Sequence[str] = (), cast_to_down: bool = False) -> None:
        super().__init__()
        if down_mode not in DOWN_MODES:
            raise ValueError(f"MSGatedMLP: unknown down_mode {down_mode!r}; expected one of {DOWN_MODES}")
        if act_kind not in ACT_KINDS:
            raise ValueError(f"MSGatedMLP: unknown act_kind {act_kind!r}; expected one of {ACT_KINDS}")
        fused = gate_up is not None
        if fused == (gate is not None or up is not None) or (not fused and (gate is None or up is None)):
            raise ValueError("MSGatedMLP: give either gate and up, or gate_up")
        names = ([gate_up, down] if fused else [gate, up, down]) + list(pre_down) + list(post_down)
        if len(set(names)) != len(names):
            raise ValueError(f"MSGatedMLP: projection names must be distinct, got {names}")
        if set(modules) != set(names):
            raise ValueError(f"MSGatedMLP: modules must be exactly {sorted(names)}, got {sorted(modules)}")
        for name in names:
            if not isinstance(modules[name], nn.Module):
                raise TypeError(f"MSGatedMLP: {name!r} is not an nn.Module")
            self.add_module(name, modules[name])
        self.down_mode = down_mode
        self.act_kind = act_kind
        self.down_name = down
        self.gate_name, self.up_name, self.gate_up_name = gate, up, gate_up
        self.gate_first = bool(gate_first)
        self.pre_down, self.post_down = tuple(pre_down), tuple(post_down)
        self.cast_to_down = bool(cast_to_down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # children are read from ``_modules`` directly: nn.Module.__getattr__ is a slow fallback, and this runs
        # on every call of every MLP (a GPU step's host time)
        mods = self._modules
        if self.gate_up_name is not None:
            first, second = mods[self.gate_up_name](x).chunk(2, dim=-1)
            g, u = (first, second) if self.gate_first else (second, first)
        else:
            g = mods[self.gate_name](x)
            u = mods[self.up_name](x)
        out = self._down_of_product(g, u)
        for name in self.post_down:
            out = mods[name](out)
        return out

    def _down_of_product(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        down = self._modules[self.down_name]
        if not self.pre_down and not self.cast_to_down and self.down_mode == "fused":
            return self._fused_down(g, u, down)  # the common layout: no chain, nothing else to decide
        pre = [self._modules[name] for name in self.pre_down]
        while pre and _is_plain_dropout(pre[0]):
            # dropout(act(g)·u) = act(g)·dropout(u): the same mask (same draw) moves onto u, so the down
            # projection's input stays the recomputable product instead of a new tensor that must be kept
            if not _is_identity(pre[0]):
                u = F.dropout(u, pre[0].p, training=True)  # never in place: u may be a chunk of gate_up's output
            pre = pre[1:]
        weight = getattr(down, "weight", None)
        cast = (self.cast_to_down and isinstance(weight, torch.Tensor) and weight.dtype != g.dtype
                and weight.dtype.is_floating_point)  # T5 leaves int8 weights alone
        if cast or not all(_is_identity(m) for m in pre):
            def consumer(h: torch.Tensor) -> torch.Tensor:
                for m in pre:
                    h = m(h)
                return down(h.to(weight.dtype) if cast else h)
            return gated_act_recomputed(g, u, self.act_kind, consumer)
        if self.down_mode == "recompute":
            return gated_act_recomputed(g, u, self.act_kind, down)
        return self._fused_down(g, u, down)

    def _fused_down(self, g: torch.Tensor, u: torch.Tensor, down: nn.Module) -> torch.Tensor:
        """``down(act(g)·u)`` through the fused op where `down_support` allows, else recomputed."""
        kind, adapters = _down_plan(down)
        if kind == "linear":
            return gated_mlp(g, u, down.weight, down.bias, self.act_kind)
        if kind == "lora":
            if down.disable_adapters and down.merged:
                down.unmerge()  # as lora.Linear.forward does before running the base layer alone
                # (adapters stays []: read while merged, and disabled adapters are none either way)
            base = down.get_base_layer()
            return gated_mlp(g, u, base.weight, base.bias, self.act_kind, adapters)
        return gated_act_recomputed(g, u, self.act_kind, down)

    def extra_repr(self) -> str:
        if self.gate_up_name is not None:
            halves = "gate, up" if self.gate_first else "up, gate"
            layout = f"{self.gate_up_name}->({halves})"
        else:
            layout = f"{self.gate_name}, {self.up_name}"
        mode = "" if self.down_mode == "fused" else f", down_mode={self.down_mode}"
        chain = "".join(f"{n} → " for n in self.pre_down) + ("cast → " if self.cast_to_down else "")
        post = "".join(f" → {n}" for n in self.post_down)
        return f"act={self.act_kind}, layout={layout}, down={chain}{self.down_name}{post}{mode}"
