"""Decide which role each module plays (activation, norm, Linear-like, dropout).

Norms are found *by behaviour*, not by name: every leaf module whose parameters are at most a per-channel
``weight`` and ``bias`` is run (a copy, random γ, β) on a probe tensor and compared with LayerNorm / RMSNorm
over the last dim, with scale ``w``, ``1 + w`` or none; eps is read from an attribute or fitted from the output.
The catalogue only makes this faster (a listed class has a known kind) and names norm-like classes, whose
failure to behave as a norm is reported rather than silently ignored.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ..catalogue import Catalogue, LoraLayout, class_key
from ..fold import norm_scale
from ..deprecation import renamed_attribute
from ..enums import ConvertedModule, Layout, NormType, StrChoice, WeightParam
from ..reasons import Reason, ReasonCode


class ModuleRole(StrChoice):
    ACTIVATION = "activation"
    NORM = "norm"
    LINEAR = "linear"
    QUANTIZED_LINEAR = "quantized_linear"
    DROPOUT = "dropout"
    IDENTITY = "identity"
    OTHER = "other"


@dataclass(frozen=True)
class NormRole:
    norm_type: NormType
    param: WeightParam
    eps: float
    shape: tuple[int, ...]  # () for a norm without weight or size attribute: any size (taken from the trace)
    has_bias: bool
    affine: bool = True  # False: no weight and no bias (nothing to fold; the memory-sharing norm needs none)
    channel_dim: int = -1  # where the channels are: -1 (LayerNorm), 1 (channel-first: timm LayerNorm2d on NCHW)

    kind = renamed_attribute("kind", "norm_type")  # 0.1.0's name (DeprecationWarning)

    def __post_init__(self) -> None:
        object.__setattr__(self, "norm_type", NormType(self.norm_type))
        object.__setattr__(self, "param", WeightParam(self.param))


@dataclass(frozen=True)
class Role:
    plays: ModuleRole
    act: str | None = None  # activation kind (the ops layer's table)
    norm: NormRole | None = None
    layout: Layout | None = None  # linear weight layout
    p: float | None = None  # dropout probability
    lora: LoraLayout | None = None  # for LoRA-wrapped Linears: where its base layer and adapters are
    why: Reason | None = None  # why a would-be norm cannot be used
    probe_norm: bool = False  # acts as a norm on the probe but not beyond it: reported whatever its name

    def __post_init__(self) -> None:
        object.__setattr__(self, "plays", ModuleRole(self.plays))
        if self.layout is not None:
            object.__setattr__(self, "layout", Layout(self.layout))


def _reference(kind: NormType, param: WeightParam, x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """The norm's maths in fp64 (``w`` None: no scale)."""
    y = normalized(kind, x.double(), eps)
    y = y * norm_scale(w.double(), param) if w is not None else y
    return y + b.double() if b is not None else y


def normalized(kind: NormType, x: torch.Tensor, eps: float) -> torch.Tensor:
    return _centered(kind, x) * torch.rsqrt(_spread(kind, x) + eps)


def _centered(kind: NormType, x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(-1, keepdim=True) if kind is NormType.LAYER else x


def _spread(kind: NormType, x: torch.Tensor) -> torch.Tensor:
    """What the norm divides by (before eps): the variance (LayerNorm) or the mean square (RMSNorm)."""
    return x.var(-1, unbiased=False, keepdim=True) if kind is NormType.LAYER else x.pow(2).mean(-1, keepdim=True)


#: attributes that may hold the normalised size of a norm without weight (else: any size)
SIZE_ATTRIBUTES = ("normalized_shape", "hidden_size", "dim", "d_model", "embed_dim", "num_features")
_PROBE_D = 24  # channels a size-agnostic norm is probed with
#: row scales of the probe: ordinary rows, and rows small enough that eps decides the output (to fit it)
_ROW_SCALES = (3.0, 1.0, 1e-2, 1e-4, 1e-6, 1e-8)


def norm_size(module: nn.Module) -> tuple[int, ...] | str:
    """The normalised size of a norm: its weight's shape, else a size attribute, else () (any size)."""
    w = getattr(module, "weight", None)
    if isinstance(w, torch.Tensor):
        return tuple(w.shape)
    for attr in SIZE_ATTRIBUTES:
        v = getattr(module, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return (v,)
        if isinstance(v, (tuple, list, torch.Size)) and all(isinstance(i, int) for i in v):
            return tuple(v)
    return ()


def fit_eps(kind: NormType, x: torch.Tensor, z: torch.Tensor) -> list[float]:
    """Values of eps that explain ``z`` = normalised ``x`` (affine removed), one per row, smallest-scale rows
    first (there eps matters most; z = c·(v + eps)^-1/2, so eps = mean(c²)/mean(z²) − v). Rows where a bias
    swamps the normalised part give wrong values: the caller checks each against every row."""
    x, z = x.double(), z.double()
    c2, v = _centered(kind, x).pow(2).mean(-1).flatten(), _spread(kind, x).flatten()
    z2 = z.pow(2).mean(-1).flatten()
    fits = []
    for i in torch.argsort(v).tolist():
        if float(z2[i]) > 0 and torch.isfinite(z2[i]):
            eps = max(float(c2[i] / z2[i] - v[i]), 0.0)
            fits.append(float(f"{eps:.3g}"))  # eps values are round numbers; the check confirms it
    raw = [max(float(c2[i] / z2[i] - v[i]), 0.0) for i in torch.argsort(v).tolist()[:1] if float(z2[i]) > 0]
    return list(dict.fromkeys(fits + raw))  # a value that is not round: as fitted


def _rows_match(y: torch.Tensor, ref: torch.Tensor, rtol: float) -> bool:
    """Every row within ``rtol`` of the reference, relative to that row's size (rows differ by 10^8 in scale)."""
    y, ref = y.double().flatten(0, -2), ref.flatten(0, -2)
    err = (y - ref).norm(dim=-1)
    return bool(torch.all(err <= rtol * ref.norm(dim=-1) + 1e-30))


def _probe_input(d: int, gen: torch.Generator) -> torch.Tensor:
    """(2, rows, d): rows at every scale of `_ROW_SCALES`; a 3-D input so that a norm over another axis
    (GroupNorm, a channel-first norm) fails or differs."""
    rows = [(torch.randn(2, 1, d, generator=gen) * 3 + 1) * s for s in _ROW_SCALES]
    return torch.cat(rows, dim=1)


#: rows beyond the probe: magnitudes at the ends of the fp32 range a norm's maths still holds in (squares stay
#: finite), one outlier among ordinary values, and rows holding NaN, +inf or -inf (the norm gives NaN there)
_EXTREME_SCALES = (1e15, 1e-15)


def _beyond_inputs(d: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The inputs of `_beyond_problem`, (2, rows, d) each, by what they exercise."""
    extreme = [(torch.randn(2, 1, d, generator=gen) * 3 + 1) * s for s in _EXTREME_SCALES]
    outlier = torch.randn(2, 1, d, generator=gen)
    outlier[:, :, 0] = 1e12
    special = torch.randn(2, 3, d, generator=gen)
    special[:, 0, 0], special[:, 1, d // 2], special[:, 2, -1] = float("nan"), float("inf"), float("-inf")
    return {"extreme": torch.cat([*extreme, outlier], dim=1), "non-finite": special}


def _same_values(y: torch.Tensor, ref: torch.Tensor, rtol: float) -> bool:
    """NaN and ±inf at the same places, finite values row by row within ``rtol`` (`_rows_match`)."""
    y = y.double()
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        if not torch.equal(test(y), test(ref)):
            return False
    fin = torch.isfinite(ref)
    return _rows_match(torch.where(fin, y, 0.0), torch.where(fin, ref, 0.0), rtol)


def _beyond_problem(probe: nn.Module, x: torch.Tensor, gen: torch.Generator, reference, channel_dim: int,
                    what: str) -> Reason | None:
    """Why ``probe`` (eval mode), which matched the norm ``reference(x)`` on the probe ``x``, is not that norm
    beyond it: on non-finite rows, on extreme rows (eval mode), or on all of them in train mode (a noise term, a
    dropout, a branch on ``self.training``). The train-mode forward draws from its own RNG stream."""
    rows = _beyond_inputs(x.shape[-1], gen)
    cases = [(f"at input shape {tuple(t.shape[:-1])} + (C,)", t, False)  # batch- or length-dependent code
             for t in (x.reshape(-1, 1, x.shape[-1]), x.reshape(1, -1, x.shape[-1]))]
    cases += [(f"on {name} input", t, False) for name, t in rows.items()]
    cases.append(("in train mode", torch.cat([x, *rows.values()], dim=1), True))
    for where, t, train in cases:
        probe.train(train)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                y = _run_probe(probe, t, channel_dim)
        finally:
            probe.eval()
        if isinstance(y, str) or not _same_values(y, reference(t), 1e-4):
            return Reason(ReasonCode.BEYOND_PROBE, f"acts as {what} on the probe but not {where} (its forward "
                          "runs code the probe does not reach)")
    if not _same_gradient(probe, x[:, :2], gen, reference, channel_dim):
        return Reason(ReasonCode.BEYOND_PROBE, f"acts as {what} on the probe but its input gradient is not that "
                      "norm's (its forward changes the backward: a hook on a tensor, a custom autograd function)")
    return None


def _same_gradient(probe: nn.Module, x: torch.Tensor, gen: torch.Generator, reference, channel_dim: int) -> bool:
    """The module's input gradient for a random output gradient, against the fp64 norm's, on ordinary rows (the
    memory-sharing norm computes the norm's own backward, whatever the module's forward did to it)."""
    g = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    x32 = x.detach().clone().requires_grad_(True)
    x64 = x.detach().double().requires_grad_(True)
    try:
        with torch.enable_grad():
            y = probe(x32 if channel_dim == -1 else channels_first(x32))
            y = y if channel_dim == -1 else y.squeeze(-1).movedim(1, -1)
            (gx,) = torch.autograd.grad(y, x32, g.to(y.dtype))
            (want,) = torch.autograd.grad(reference(x64), x64, g)
    except Exception:  # noqa: BLE001 - no gradient at all (a detaching forward) is not the norm's either
        return False
    return _rows_match(gx, want, 1e-4)


def _probe_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    probe = copy.deepcopy(module)
    if any(t.device.type == "meta" for t in list(probe.parameters()) + list(probe.buffers())):
        probe = probe.to_empty(device="cpu")
    return probe.to(device="cpu", dtype=dtype).eval()


def identify_norm(module: nn.Module, entry: dict | None, eps: float | None, beyond: bool = True
                  ) -> NormRole | Reason:
    """Return the norm's role, or why it is not a usable norm (code ``BEYOND_PROBE``: it acts as one on the probe
    only; ``BEHAVIOUR``: it does not).

    By behaviour: a copy of the module, with random γ, β, runs on a probe tensor and must match LayerNorm or
    RMSNorm over the last dim, with scale w, 1 + w or none (no weight), ± bias. ``entry`` (a catalogue entry)
    may fix the kind and parameterisation; ``eps`` (an attribute value) is tried first, then eps is fitted from
    the output. The module must also return bf16 for bf16 input, as the memory-sharing norm does, and (unless
    ``beyond`` is False) act as that norm beyond the probe too: in train mode, on non-finite and on extreme
    input (a ``BEYOND_PROBE`` reason otherwise)."""
    found = _identify(module, entry, eps, beyond)
    return Reason(ReasonCode.BEHAVIOUR, found) if isinstance(found, str) else found


def _identify(module: nn.Module, entry: dict | None, eps: float | None, beyond: bool) -> NormRole | Reason | str:
    w = getattr(module, "weight", None)
    b = getattr(module, "bias", None)
    w = w if isinstance(w, torch.Tensor) else None
    b = b if isinstance(b, torch.Tensor) else None
    shape = norm_size(module)
    if len(shape) > 1:
        return f"normalised shape {shape} is not a single channel dim"
    if w is None and b is not None:
        return "norm has a bias but no weight"
    for t, what in ((w, "weight"), (b, "bias")):
        if t is not None and (t.dim() != 1 or not t.is_floating_point() or (shape and t.shape != shape)):
            return f"{what} of shape {tuple(t.shape)} and dtype {t.dtype} is not a per-channel float vector"
    for name, buf in module.named_buffers(recurse=False):
        if buf.is_floating_point() and buf.numel() and name not in ("weight", "bias"):
            return f"norm has buffer {name!r}; not a plain LayerNorm/RMSNorm"
    d = shape[0] if shape else _PROBE_D
    if d < 2:
        return f"normalises {d} channel"
    gen = torch.Generator().manual_seed(1234)
    try:
        probe = _probe_copy(module, torch.float32)
    except Exception as exc:  # a module that cannot be copied (holds a handle, a lock ...) is not checked
        return f"cannot be copied for the behaviour check ({type(exc).__name__}: {exc})"
    with torch.no_grad():
        if w is not None:
            probe.weight.copy_(torch.rand(d, generator=gen) + 0.5)
        if b is not None:
            probe.bias.copy_(torch.randn(d, generator=gen))
        x = _probe_input(d, gen)
    pw = probe.weight.detach() if w is not None else None
    pb = probe.bias.detach() if b is not None else None
    kinds = [NormType(entry["kind"])] if entry and entry.get("kind") else [NormType.RMS, NormType.LAYER]
    params = [WeightParam(entry["param"])] if entry and entry.get("param") else [WeightParam.W, WeightParam.ONE_PLUS_W]
    if w is None:
        params = [WeightParam.W]
    first = None
    for channel_dim in (-1, 1):  # channels last (LayerNorm), then channels first (timm LayerNorm2d, NCHW)
        y = _run_probe(probe, x, channel_dim)
        if isinstance(y, str):
            first = y if channel_dim == -1 else first  # the reason given: the last-dim check's
            continue
        for kind in kinds:
            for param in params:
                scale = norm_scale(pw.double(), param) if pw is not None else None
                z = y.double() - (pb.double() if pb is not None else 0.0)
                z = z / scale if scale is not None else z
                for e in dict.fromkeys(v for v in (eps, *fit_eps(kind, x, z)) if v is not None):
                    if _rows_match(y, _reference(kind, param, x, pw, pb, e), 1e-4):
                        role = NormRole(kind, param, e, shape, b is not None, affine=w is not None,
                                        channel_dim=channel_dim)
                        problem: Reason | str | None = _dtype_problem(module, x, channel_dim)
                        if problem is None and beyond:
                            problem = _beyond_problem(
                                probe, x, gen, lambda t, k=kind, p=param, e=e: _reference(k, p, t, pw, pb, e),
                                channel_dim, f"{kind}({param})")
                        return problem if problem else role
    if first is not None:
        return first
    expected = "/".join(f"{k}({p})" for k in kinds for p in params)
    return f"behaviour does not match {expected} norm over the last dim"


def channels_first(x: torch.Tensor) -> torch.Tensor:
    """The behaviour probe (2, rows, C) as a channel-first image (2, C, rows, 1)."""
    return x.movedim(-1, 1).unsqueeze(-1)


def _run_probe(probe: nn.Module, x: torch.Tensor, channel_dim: int) -> torch.Tensor | str:
    """The module's output on the probe laid out with channels at ``channel_dim``, back in (2, rows, C) layout, or
    why it is not a norm over that dim."""
    shown = x if channel_dim == -1 else channels_first(x)
    with torch.no_grad():
        try:
            y = probe(shown)
        except Exception as exc:
            return f"behaviour check failed to run ({type(exc).__name__}: {exc})"
    if not isinstance(y, torch.Tensor) or y.shape != shown.shape or not y.is_floating_point():
        return "does not map a (..., C) tensor to one of the same shape"
    return y if channel_dim == -1 else y.squeeze(-1).movedim(1, -1)


def _dtype_problem(module: nn.Module, x: torch.Tensor, channel_dim: int = -1) -> str | None:
    """A memory-sharing norm returns its input's dtype: a norm that returns another one is not replaced."""
    x = x[:, :2].to(torch.bfloat16)
    with torch.no_grad():
        try:
            y = _probe_copy(module, torch.bfloat16)(x if channel_dim == -1 else channels_first(x))
        except Exception as exc:
            return f"fails on bfloat16 input ({type(exc).__name__}: {exc})"
    if not isinstance(y, torch.Tensor) or y.dtype != torch.bfloat16:
        return f"returns {getattr(y, 'dtype', type(y).__name__)} for bfloat16 input (a memory-sharing norm keeps " \
               "the input dtype)"
    return None


def could_be_norm(module: nn.Module) -> bool:
    """Cheap structural filter before the behaviour check: a leaf (no child modules) whose parameters are
    at most a per-channel ``weight`` and ``bias``. Containers are never norms, whatever their name."""
    if next(module.children(), None) is not None:
        return False
    params = dict(module.named_parameters(recurse=False))
    if set(params) - {"weight", "bias"}:
        return False
    return all(p.dim() == 1 for p in params.values())


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


SCRIPTED_WHY = ("a torch.jit.script-ed module: TorchScript code can be neither traced nor hooked, so it is left as "
                "it is (convert the Python module before scripting it to convert it too)")


def is_scripted(mod: nn.Module) -> bool:
    """A TorchScript module (``torch.jit.script``): opaque to the trace, and it refuses forward hooks."""
    return isinstance(mod, torch.jit.ScriptModule)


def assign_roles(model: nn.Module, cat: Catalogue, accept: Sequence[str] = ()) -> dict[str, Role]:
    """Role of every named module (first name of shared modules). ``accept``: norm classes (``module:QualName``
    or the class name) taken on the probe's word alone, without the checks beyond it (a ``BEYOND_PROBE`` reason)."""
    roles: dict[str, Role] = {}
    seen: dict[int, Role] = {}
    checked: dict[tuple, Role] = {}  # behaviour checks, by what decides them (one per kind of norm, not per layer)
    scripted: list[str] = []
    accepted = frozenset(accept)
    for name, mod in model.named_modules():
        if id(mod) in seen:
            roles[name] = seen[id(mod)]
            continue
        if is_scripted(mod):  # said once, for the outermost one
            inside = any(not p or name.startswith(p + ".") for p in scripted)
            scripted.append(name)
            role = Role(ModuleRole.OTHER, why=None if inside else Reason(ReasonCode.SCRIPTED, SCRIPTED_WHY))
        else:
            role = _role_of(mod, cat, checked, accepted)
        seen[id(mod)] = roles[name] = role
    return roles


def _role_of(mod: nn.Module, cat: Catalogue, checked: dict[tuple, Role], accepted: frozenset = frozenset()
             ) -> Role:
    if isinstance(mod, ConvertedModule):  # already converted (listed as such): never a candidate again, even
        return Role(ModuleRole.OTHER)  # where it behaves as a plain norm (the memory-sharing norm that keeps γ, β)
    act = cat.activation_kind(mod)
    if act is not None:
        return Role(ModuleRole.ACTIVATION, act=act)
    entry = cat.norm_entry(mod)
    leaf = next(mod.children(), None) is None  # containers are never norms, whatever their name
    if entry is not None and entry.get("kind") and leaf:  # listed: kind and param are known
        return _norm_role(mod, entry, cat, checked, accepted)
    layout = cat.linear_layout(mod)
    if layout is not None:
        return Role(ModuleRole.LINEAR, layout=layout)
    if quantized_linear(mod):  # traced as one node, so the planner sees the layer, not its dequantising ops
        return Role(ModuleRole.QUANTIZED_LINEAR)
    lora = cat.lora_entry(mod)
    if lora is not None:
        base = getattr(mod, lora.base, None)
        base_layout = cat.linear_layout(base) if base is not None else None
        if base_layout is not None:
            return Role(ModuleRole.LINEAR, layout=base_layout, lora=lora)
        return Role(ModuleRole.OTHER, why=Reason(ReasonCode.LORA_STATE, f"{class_key(mod)}: LoRA over {class_key(base)} "
                                                                      "(not a Linear the fold knows)"))
    p = cat.dropout_p(mod)
    if p is not None:
        return Role(ModuleRole.DROPOUT, p=p)
    if cat.is_identity(mod):
        return Role(ModuleRole.IDENTITY)
    if could_be_norm(mod) or (entry is not None and leaf):  # by behaviour: whatever acts as a norm is one
        role = _norm_role(mod, entry, cat, checked, accepted)
        if role.plays is ModuleRole.NORM or entry is not None or role.probe_norm:  # say why it is not one
            return role
    return Role(ModuleRole.OTHER)


def _norm_role(mod: nn.Module, entry: dict | None, cat: Catalogue, checked: dict[tuple, Role],
               accepted: frozenset = frozenset()) -> Role:
    """``checked``: the roles behaviour checks found, by `behaviour_key` (shared by the modules of one model)."""
    eps = cat.eps_of(mod)
    key = behaviour_key(mod, entry, eps)
    if key is not None and key in checked:
        return checked[key]
    cls = class_key(mod)
    found = identify_norm(mod, entry, eps, beyond=not accepted & {cls, type(mod).__name__})
    if isinstance(found, NormRole):
        role = Role(ModuleRole.NORM, norm=found)
    elif found.code is ReasonCode.BEYOND_PROBE:
        role = Role(ModuleRole.OTHER, why=Reason(found.code, f"{cls}: {found}; not swapped (accept_norms=[{cls!r}] "
                                                           "swaps it anyway)"), probe_norm=True)
    else:
        role = Role(ModuleRole.OTHER, why=Reason(found.code, f"{cls}: {found}"))
    if key is not None:
        checked[key] = role
    return role


_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.Size)


def behaviour_key(mod: nn.Module, entry: dict | None, eps: float | None) -> tuple | None:
    """What decides the behaviour check's answer: the class, its plain attributes, its tensors' names, shapes and
    dtypes (the check draws its own γ, β, so their values do not matter), the catalogue entry and eps. Modules with
    equal keys get one check (a 32-layer model's 65 norms, one). None, so no sharing, when the module holds state
    of another kind (an object whose contents could change its forward)."""
    if mod._forward_hooks or mod._forward_pre_hooks:  # the check runs them too: each module its own
        return None
    attrs = []
    for k, v in sorted(vars(mod).items()):
        if k.startswith("_") or k == "training":
            continue
        if isinstance(v, _PLAIN) or (isinstance(v, (tuple, list)) and all(isinstance(i, _PLAIN) for i in v)):
            attrs.append((k, repr(v)))
        else:
            return None
    tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in (*mod.named_parameters(recurse=False),
                                                               *mod.named_buffers(recurse=False)))
    return type(mod), tuple(attrs), tensors, repr(sorted(entry.items())) if entry else None, eps


def is_leaf_factory(model: nn.Module, roles: dict[str, Role]):
    """Leaf predicate for the tracer: modules with a role are seen as one node; all others are transparent
    (their ops are recorded, and their calls are scopes where an affine can be re-applied)."""
    other = Role(ModuleRole.OTHER)
    ids = {id(mod) for name, mod in model.named_modules() if roles.get(name, other).plays is not ModuleRole.OTHER}
    return lambda m: id(m) in ids
