"""Decide which role each module plays (activation, norm, Linear-like, dropout), from the catalogue.

Norms are also identified *by behaviour*: a copy of the module is run on a small random input with random
weights and compared with LayerNorm / RMSNorm formulas, with weight ``w`` or ``(1 + w)``. That catches a wrong
catalogue entry and lets any class named like a norm (``*RMSNorm``) be supported without an entry.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from ..catalogue import Catalogue, class_key
from ..fold import norm_scale
from ..kinds import Layout, NormKind, StrChoice, WeightParam


class RoleKind(StrChoice):
    ACTIVATION = "activation"
    NORM = "norm"
    LINEAR = "linear"
    QUANTIZED_LINEAR = "quantized_linear"
    DROPOUT = "dropout"
    IDENTITY = "identity"
    OTHER = "other"


@dataclass(frozen=True)
class NormRole:
    kind: NormKind
    param: WeightParam
    eps: float
    shape: tuple[int, ...]
    has_bias: bool

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", NormKind(self.kind))
        object.__setattr__(self, "param", WeightParam(self.param))


@dataclass(frozen=True)
class Role:
    kind: RoleKind
    act: str | None = None  # activation kind (the ops layer's table)
    norm: NormRole | None = None
    layout: Layout | None = None  # linear weight layout
    p: float | None = None  # dropout probability
    lora: dict | None = None  # for LoRA-wrapped Linears: catalogue entry (base layer / adapter attributes)
    problem: str | None = None  # why a would-be norm cannot be used

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", RoleKind(self.kind))
        if self.layout is not None:
            object.__setattr__(self, "layout", Layout(self.layout))


def _reference(kind: NormKind, param: WeightParam, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    x = x.double()
    if kind is NormKind.LAYER:
        y = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
    else:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    y = y * norm_scale(w.double(), param)
    return y + b.double() if b is not None else y


def identify_norm(module: nn.Module, entry: dict, eps: float | None) -> NormRole | str:
    """Return the norm's role, or a string saying why it is not a usable norm."""
    w = getattr(module, "weight", None)
    b = getattr(module, "bias", None)
    if not isinstance(w, torch.Tensor):
        return "norm has no weight (nothing to fold); left as is"
    if w.dim() != 1:
        return f"normalised shape {tuple(w.shape)} is not a single channel dim"
    if b is not None and not isinstance(b, torch.Tensor):
        b = None
    if eps is None:
        return "no eps attribute found (catalogue eps_attributes)"
    if not w.is_floating_point():
        return f"weight dtype {w.dtype} cannot be folded"
    d = w.shape[0]
    probe = copy.deepcopy(module)
    if any(t.device.type == "meta" for t in list(probe.parameters()) + list(probe.buffers())):
        probe = probe.to_empty(device="cpu")
    probe = probe.to(device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        probe.weight.copy_(torch.rand(d, generator=gen, device="cpu") + 0.5)
        if b is not None:
            probe.bias.copy_(torch.randn(d, generator=gen, device="cpu"))
        for name, buf in probe.named_buffers(recurse=False):
            if buf.is_floating_point() and buf.numel() and name not in ("weight", "bias"):
                return f"norm has buffer {name!r}; not a plain LayerNorm/RMSNorm"
        x = torch.randn(3, d, generator=gen, device="cpu") * 3 + 1
        try:
            y = probe.eval()(x)
        except Exception as exc:
            return f"behaviour check failed to run ({type(exc).__name__}: {exc})"
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return "norm does not map a (N, C) tensor to the same shape"
    kinds = [NormKind(entry["kind"])] if entry.get("kind") else [NormKind.RMS, NormKind.LAYER]
    params = [WeightParam(entry["param"])] if entry.get("param") else [WeightParam.W, WeightParam.ONE_PLUS_W]
    for kind in kinds:
        for param in params:
            ref = _reference(kind, param, x, probe.weight.detach(), probe.bias.detach() if b is not None else None, eps)
            if torch.allclose(y.double(), ref, rtol=1e-4, atol=1e-4):
                return NormRole(kind, param, eps, (d,), b is not None)
    expected = "/".join(f"{k}({p})" for k in kinds for p in params)
    return f"behaviour does not match {expected} norm over the last dim (catalogue entry wrong or exotic norm)"


def quantized_linear(module: nn.Module) -> str | None:
    """How a Linear-like layer (an nn.Linear subclass, or a module with in/out_features) stores its weight when
    that is not a floating-point tensor — bitsandbytes Linear4bit/Linear8bitLt, GPTQ/AWQ ``qweight`` ... —, found
    by behaviour, not by class name. None for anything else."""
    if not (isinstance(module, nn.Linear) or (hasattr(module, "in_features") and hasattr(module, "out_features"))):
        return None
    cls = f"{type(module).__module__.split('.')[0]} {type(module).__name__}"
    w = getattr(module, "weight", None)
    if isinstance(w, torch.Tensor):
        if getattr(w, "quant_state", None) is not None:  # 4-bit codes in a float storage dtype (FSDP QLoRA)
            return f"{cls}, weight is a quantized {type(w).__name__} stored as {w.dtype}"
        return None if w.is_floating_point() else f"{cls}, weight stored as {w.dtype}"
    for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
        if t.dim() == 2 and not t.is_floating_point():
            return f"{cls}, {name} stored as {t.dtype}"
    return None


def user_hooks(module: nn.Module) -> list[str]:
    """The forward hooks and backward hooks on a module: they see its output (or the gradient of it)."""
    kinds = [("forward hook", module._forward_hooks), ("backward hook", module._backward_hooks),
             ("backward pre-hook", module._backward_pre_hooks)]
    return [f"{len(d)} {kind}{'s' if len(d) > 1 else ''}" for kind, d in kinds if d]


def assign_roles(model: nn.Module, cat: Catalogue) -> dict[str, Role]:
    """Role of every named module (first name of shared modules)."""
    roles: dict[str, Role] = {}
    seen: dict[int, Role] = {}
    for name, mod in model.named_modules():
        if id(mod) in seen:
            roles[name] = seen[id(mod)]
            continue
        role = _role_of(mod, cat)
        seen[id(mod)] = roles[name] = role
    return roles


def _role_of(mod: nn.Module, cat: Catalogue) -> Role:
    act = cat.activation_kind(mod)
    if act is not None:
        return Role(RoleKind.ACTIVATION, act=act)
    entry = cat.norm_entry(mod)
    if entry is not None:
        found = identify_norm(mod, entry, cat.eps_of(mod))
        if isinstance(found, NormRole):
            return Role(RoleKind.NORM, norm=found)
        return Role(RoleKind.OTHER, problem=f"{class_key(mod)}: {found}")
    layout = cat.linear_layout(mod)
    if layout is not None:
        return Role(RoleKind.LINEAR, layout=layout)
    if quantized_linear(mod):  # traced as one node, so the planner sees the layer, not its dequantising ops
        return Role(RoleKind.QUANTIZED_LINEAR)
    lora = cat.lora_entry(mod)
    if lora is not None:
        base = getattr(mod, lora["base"], None)
        base_layout = cat.linear_layout(base) if base is not None else None
        if base_layout is not None:
            return Role(RoleKind.LINEAR, layout=base_layout, lora=lora)
        return Role(RoleKind.OTHER,
                    problem=f"{class_key(mod)}: LoRA over {class_key(base)} (not a Linear the fold knows)")
    p = cat.dropout_p(mod)
    if p is not None:
        return Role(RoleKind.DROPOUT, p=p)
    if cat.is_identity(mod):
        return Role(RoleKind.IDENTITY)
    return Role(RoleKind.OTHER)


def is_leaf_factory(model: nn.Module, roles: dict[str, Role]):
    """Leaf predicate for the tracer: modules with a role are seen as one node; all others are transparent
    (their ops are recorded, and their calls are scopes where an affine can be re-applied)."""
    other = Role(RoleKind.OTHER)
    ids = {id(mod) for name, mod in model.named_modules() if roles.get(name, other).kind is not RoleKind.OTHER}
    return lambda m: id(m) in ids
