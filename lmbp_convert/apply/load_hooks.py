"""Fold a norm's original affine into its Linears as the weights are loaded (``model.load_state_dict``).

A converted model keeps the original state-dict keys, so ``load_state_dict`` accepts the *original*
(unfolded) checkpoint without complaint — the natural way to fill a model converted on the ``meta`` device
(``convert()``, ``to_empty()``, ``load_state_dict(original)``). Without this hook the folded norm would take
γ, β into identity buffers that its forward never reads and the Linears would run unfolded: a different model.

One ``FoldOnLoad`` per folded norm, registered as a load_state_dict pre-hook on the converted model. It reads
the arriving entries and rewrites them (or, for pieces that arrived in an earlier call, the live tensors) so
that the model ends with the parameters ``convert()`` would have made from that checkpoint:

* a norm whose affine is folded away holds the identity. An arriving non-identity γ (or a non-zero β, where β is
  folded into biases) is therefore an original checkpoint: W ← W·diag(γ), b ← b + W·β, the norm's entries
  become the identity (or β/γ where the norm keeps the shift for bias-less Linears, see ``hooks.AddShift``).
  Identity entries — the converted model's own state dict, a checkpoint written by ``lmbp-convert`` — load as
  they are.
* a norm whose affine is also re-applied elsewhere (post-LN) keeps γ, β as parameters, so its entries look the
  same in an original checkpoint and in the converted model's own state dict. The own one says so: it carries
  ``<norm>.lmbp_folded`` (`FOLD_MARKER`, written by the norm once its Linears hold the fold; not by a model
  converted on ``meta`` before its first load), which an original lacks. A checkpoint whose marker arrives loads
  as it is; one without is folded like any original — also into a real converted model, also twice. The norm
  drops the marker on load (no unexpected key, and no missing one for an original). The marker may arrive in a
  call after the norm's γ, β (a shard boundary between them): γ, β are taken for an original's until then, and the
  checkpoint becomes the own one if nothing was folded yet (its Linears come later, as in state-dict order);
  otherwise, and for a marker arriving alone right after an original was folded, the load fails with that reason
  (`RuntimeError` from ``load_state_dict``) instead of leaving a model folded twice.
* entries may arrive in separate calls, in any order (``strict=False`` per shard, as in transformers'
  ``load_sharded_checkpoint`` and Trainer resume): the norm's γ, β are kept until every entry of the fold has
  arrived; a weight that arrives before its norm waits unfolded and is folded in place when the norm arrives,
  and a bias is kept equal to its original value plus W·β whichever of b, W, β comes last.

Not covered: a load of *only* a norm's γ, β, followed later by a separate load of the converted model's own
Linears (the kept γ would fold them again), loaders that bypass ``Module.load_state_dict`` and set tensors one by
one (accelerate's ``set_module_tensor_to_device`` with a ``device_map``): load those weights before ``convert()``;
and loaders that compare the checkpoint's keys with ``model.state_dict()`` themselves (transformers'
``load_sharded_checkpoint(strict=True)`` reports the markers of a marked model missing from an original: pass
``strict=False``).
"""
from __future__ import annotations

import torch
from torch import nn

from ..fold import (effective_scale, fold_bias, fold_lora_a, fold_scale, identity_weight_value, remove_shift,
                    shift_is_expressible, shift_through_scale, unfold_scale)
from ..enums import ConvertedHook
from ..match.plan import NormFold
from ..nn.norms import FOLD_MARKER


def _key(prefix: str, module: str, attr: str) -> str:
    return f"{prefix}{module}.{attr}" if module else f"{prefix}{attr}"


def _module_tensor(modules: dict[str, nn.Module], name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    return getattr(modules[owner], attr)


def _copy_into(live: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        live.copy_(value)


class _Target:
    """One Linear of the fold (names relative to the converted model) and the state of its live tensors."""

    def __init__(self, name: str, layout: str, base: str | None, lora_a: list[str], has_bias: bool, state: str,
                 weight: str = "weight"):
        self.layout = layout
        self.weight = weight  # the attribute folded into ("weight", or an expert parameter such as "gate_up_proj")
        self.linear = f"{name}.{base}" if base else name
        self.lora_a = lora_a  # module names of lora_A adapters (they take γ only)
        self.has_bias = has_bias
        # live W: "unset" (converted on meta, nothing loaded), "plain" (an original W, γ not folded in yet),
        # "folded" (holds W·diag(γ) for the γ being loaded, or the converted model's own weight)
        self.state = state
        self.added: torch.Tensor | None = None  # the W·β the live bias holds on top of its original value


class FoldOnLoad(ConvertedHook):
    """load_state_dict pre-hook of a converted model for one folded norm (see the module docstring)."""

    def __init__(self, fold: NormFold, targets: list[_Target], awaiting: bool):
        self.norm = fold.name
        self.param = fold.param
        self.beta_mode = fold.beta if fold.has_bias else "none"
        self.reapplied = bool(fold.reapply)
        self.targets = targets
        #: a fold into parameters that functional ops apply (`ConsumerFold`): their own hook takes the affine
        self.other_targets = bool(fold.param_targets())
        self.awaiting = awaiting  # converted on meta: the Linears have never held folded weights
        self.gamma: torch.Tensor | None = None  # the original γ (effective scale) of the checkpoint being loaded
        self.beta: torch.Tensor | None = None  # its β, where β folds into biases
        self.seen: set[str] = set()  # entries of this fold that arrived since a checkpoint was last complete
        #: a re-applied norm's own state dict carries `FOLD_MARKER` (an original lacks it): these decide by it
        self.marks = self.reapplied and bool(targets or self.other_targets) and not fold.prefolded
        self.marked = False  # the marker arrived for the checkpoint being loaded: its entries load as they are
        self.changed = False  # a tensor was folded for the checkpoint being loaded (taken as an original)
        self.suspect = False  # the last complete checkpoint was folded as an original and nothing arrived since

    @classmethod
    def for_fold(cls, modules: dict[str, nn.Module], fold: NormFold) -> "FoldOnLoad":
        found = []
        for t in fold.targets:
            lin = modules[t.name]
            base = getattr(lin, t.base) if t.base else lin
            lora_a = [f"{t.name}.{t.lora_a_attr}.{a}" for a in t.lora_adapters] if t.base else []
            found.append((t, base, lora_a))
        params = [p.weight for p in fold.param_targets()]
        awaiting = (any(getattr(b, t.weight).device.type == "meta" for t, b, _ in found)
                    or any(_module_tensor(modules, n).device.type == "meta" for n in params)) and not fold.prefolded
        targets = [_Target(t.name, t.layout, t.base, lora_a,
                           t.weight == "weight" and getattr(b, "bias", None) is not None,
                           "unset" if awaiting else "folded", t.weight) for t, b, lora_a in found]
        return cls(fold, targets, awaiting)

    @property
    def _open(self) -> bool:
        return self.gamma is not None or self.beta is not None

    # -- the hook ----------------------------------------------------------------------------------------
    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                 missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        pieces = self._pieces()
        arrived = {name for name, key in pieces.items() if _key(prefix, *key) in state_dict}
        if self.marks:
            self._read_marker(_key(prefix, self.norm, FOLD_MARKER) in state_dict, bool(arrived), error_msgs)
            if arrived:
                self.suspect = False
        self.seen.update(arrived)
        was_open = self._open
        new_gamma, new_beta = self._take_norm(module, state_dict, prefix, error_msgs)
        if self._open and not was_open:  # an original checkpoint starts arriving
            for t in self.targets:  # the converted weight is what the plain model (identity norm) holds; not
                if t.state == "folded" and not self.reapplied:  # where γ is kept: the arriving W replaces it
                    t.state = "plain"
                t.added = None
        for t in self.targets:
            self._take_target(module, state_dict, prefix, t, new_gamma, new_beta, error_msgs)
        if self.seen >= set(pieces):  # every entry of the fold has arrived: the checkpoint is complete
            self.suspect = self.marks and self._open
            self._converted_form()
            self.seen.clear()
            if self.marks:  # the Linears hold the fold now: the model's own state dict says so
                module.get_submodule(self.norm).marks_fold = True

    def _read_marker(self, marker: bool, pieces: bool, errors: list[str]) -> None:
        """A re-applied norm: `FOLD_MARKER` arriving says the checkpoint is the converted model's own. It may
        arrive in a call apart from the norm's γ, β (a shard boundary between them): taken as an original until
        then, the checkpoint becomes the own one if nothing was folded yet; otherwise the load fails."""
        if not marker:
            return
        late = self._open or (self.suspect and not pieces)
        if late and (self.changed or not self._open):
            errors.append(f"{self.norm}: its {FOLD_MARKER} entry (the converted model's own state dict) arrived in a "
                          "call after its γ, β had been loaded as an original checkpoint's and folded into its "
                          "Linears; load the norm's entries and its marker in one call")
            return
        self.gamma = self.beta = None  # the γ, β taken for an original's are this checkpoint's own
        self.marked = True
        for t in self.targets:
            if t.state == "plain":
                t.state = "folded"

    def _pieces(self) -> dict[str, tuple[str, str]]:
        """Every state-dict entry of this fold: name → (module, attribute)."""
        out = {"norm.weight": (self.norm, "weight")}
        if self.beta_mode != "none":
            out["norm.bias"] = (self.norm, "bias")
        for t in self.targets:
            out[f"{t.linear}.{t.weight}"] = (t.linear, t.weight)
            if t.has_bias:
                out[f"{t.linear}.bias"] = (t.linear, "bias")
        return out

    def _converted_form(self) -> None:
        """From here the Linears hold what the converted model holds."""
        self.awaiting = False
        self.gamma = self.beta = None
        self.marked = self.changed = False
        for t in self.targets:
            if t.state == "plain":
                t.state = "folded"
            t.added = None

    def _take_norm(self, module: nn.Module, sd: dict, prefix: str, errors: list[str]) -> tuple[bool, bool]:
        """Keep the arriving original γ, β (and put what the converted norm holds in their place).
        Returns (γ arrived, β arrived)."""
        gk, bk = _key(prefix, self.norm, "weight"), _key(prefix, self.norm, "bias")
        g_in, b_in = sd.get(gk), sd.get(bk)
        if g_in is None and b_in is None:
            return False, False
        if self.reapplied:  # γ, β stay the norm's parameters; fold into the Linears unless the checkpoint is own
            if self.marked or not (self.marks or self.awaiting):
                return False, False
            if g_in is not None:
                self.gamma = effective_scale(g_in, self.param)
            if b_in is not None and self.beta_mode == "fold":
                self.beta = b_in.detach()
            return g_in is not None, b_in is not None and self.beta_mode == "fold"
        ident = identity_weight_value(self.param)
        if not self.targets and not self.other_targets and self._affine_arrives(g_in, b_in, ident):
            errors.append(f"{self.norm}: the checkpoint holds this norm's affine, but the converted model has no Linear "
                          "to fold it into (its consumers' weights are quantized); load a checkpoint folded by "
                          "lmbp-convert, or load this one before convert()")
            if g_in is not None:  # the model keeps what it holds (load_state_dict copies the rest, then raises)
                sd[gk] = torch.full_like(g_in, ident)
            if b_in is not None and self.beta_mode == "fold":
                sd[bk] = torch.zeros_like(b_in)
            return False, False
        new_gamma = new_beta = False
        if g_in is not None:
            if bool(torch.all(g_in == ident)) and not (self.beta_mode == "fold" and b_in is not None
                                                         and bool(torch.any(b_in != 0))):
                self._converted_form()  # identity: the converted parametrisation, loaded as it is
                return False, False
            self.gamma = effective_scale(g_in, self.param)
            sd[gk] = torch.full_like(g_in, ident)
            new_gamma = True
        if self.beta_mode == "fold" and b_in is not None:
            if bool(torch.any(b_in != 0)):
                self.beta = b_in.detach()
                new_beta = True
            sd[bk] = torch.zeros_like(b_in)
        if self.beta_mode == "shift" and self.gamma is not None and (new_gamma or b_in is not None):
            self._shift_behind_scale(module, sd, bk, errors)
        return new_gamma, new_beta

    def _affine_arrives(self, g_in: torch.Tensor | None, b_in: torch.Tensor | None, ident: float) -> bool:
        """Whether the arriving entries hold an affine that is not the identity (an unfolded checkpoint)."""
        return ((g_in is not None and not bool(torch.all(g_in == ident)))
                or (self.beta_mode == "fold" and b_in is not None and bool(torch.any(b_in != 0))))

    def _shift_behind_scale(self, module: nn.Module, sd: dict, bk: str, errors: list[str]) -> None:
        """The norm keeps β/γ (see hooks.AddShift): the arriving β, or the live one when only γ arrived."""
        beta = sd[bk] if bk in sd else module.get_submodule(self.norm).bias
        if beta.device.type == "meta":
            return
        if not shift_is_expressible(beta, self.gamma):
            errors.append(f"{self.norm}: γ = 0 on a channel where β ≠ 0, which the converted norm cannot hold "
                          "(its Linear has no bias); load this checkpoint before convert()")
            return
        new = shift_through_scale(beta, self.gamma)
        if bk in sd:
            sd[bk] = new
        else:
            _copy_into(beta, new)

    def _take_target(self, module: nn.Module, sd: dict, prefix: str, t: _Target, new_gamma: bool,
                     new_beta: bool, errors: list[str]) -> None:
        wk, bk = _key(prefix, t.linear, t.weight), _key(prefix, t.linear, "bias")
        w_in, b_in = sd.get(wk), sd.get(bk)
        if not self._open:  # no original affine arriving: tensors are what the model holds
            if w_in is not None:  # a re-applied norm's: an original's until its marker says otherwise
                t.state = "plain" if self.awaiting or (self.marks and not self.marked) else "folded"
            return
        lin = module.get_submodule(t.linear)
        beta = self.beta if self.beta_mode == "fold" and t.has_bias else None
        # a re-applied norm's Linear that has not arrived yet holds the model's own fold: left to its arrival
        live = new_beta and not (self.reapplied and not {f"{t.linear}.{t.weight}", f"{t.linear}.bias"} & self.seen)
        if beta is not None and (b_in is not None or w_in is not None or live):
            self._fold_beta(lin, sd, bk, t, w_in, b_in, beta, errors)
        if self.gamma is None:  # β came first: γ folds into the weight when it arrives
            if w_in is not None:
                t.state = "plain"
            return
        if w_in is not None:  # an arriving weight is an original one
            sd[wk] = fold_scale(w_in, self.gamma, t.layout)
            self.changed = True
            for a in t.lora_a:
                ak = _key(prefix, a, "weight")
                if ak in sd:
                    sd[ak] = fold_lora_a(sd[ak], self.gamma)
            t.state = "folded"
        elif new_gamma and t.state == "plain" and getattr(lin, t.weight).device.type != "meta":
            _copy_into(getattr(lin, t.weight), fold_scale(getattr(lin, t.weight), self.gamma, t.layout))
            self.changed = True
            for a in t.lora_a:
                a_w = module.get_submodule(a).weight
                _copy_into(a_w, fold_lora_a(a_w, self.gamma))
            t.state = "folded"

    def _fold_beta(self, lin: nn.Module, sd: dict, bk: str, t: _Target, w_in, b_in, beta: torch.Tensor,
                   errors: list[str]) -> None:
        """bias = original b + W·β, with the original W: arriving, live while plain, else W'/γ."""
        if w_in is not None:
            w_plain = w_in.detach().double()
        elif t.state == "plain":
            w_plain = lin.weight.detach().double()
        elif t.state == "folded":
            w_plain = self._unfolded(lin.weight, t, errors)
        else:  # "unset": the weight has not arrived; the bias is folded when it does
            w_plain = None
        if b_in is not None:
            base = b_in.detach().double()
        else:
            if lin.bias.device.type == "meta":
                return
            base = remove_shift(lin.bias, t.added)
        if w_plain is None or w_plain.device.type == "meta":
            t.added = None
            if b_in is not None:
                sd[bk] = b_in
            else:
                _copy_into(lin.bias, base)
            return
        new, shift = fold_bias(base, w_plain, beta, t.layout)
        new = new.to(b_in.dtype if b_in is not None else lin.bias.dtype)
        t.added = shift
        self.changed = True
        if b_in is not None:
            sd[bk] = new
        else:
            _copy_into(lin.bias, new)

    def _unfolded(self, w: torch.Tensor, t: _Target, errors: list[str]) -> torch.Tensor | None:
        if self.gamma is None:
            return w.detach().double()
        if bool((self.gamma == 0).any()):
            errors.append(f"{self.norm}: β arrived after {t.linear}.weight was folded with a γ that is 0 on some "
                          "channel; load the norm together with its Linears")
            return None
        return unfold_scale(w, self.gamma, t.layout)


class FoldParamsOnLoad(ConvertedHook):
    """load_state_dict pre-hook for a norm folded into parameters used by functional ops (`ConsumerFold`). An
    original checkpoint (the norm's weight is not the identity; for a norm whose affine is re-applied elsewhere, no
    `FOLD_MARKER` beside it) is folded as it arrives: those parameters' entries become what
    ``convert()`` makes of them. The norm's own entries are left to its `FoldOnLoad`, which runs after this hook.
    Every tensor of the fold must arrive in the same call (one state dict, not shards in separate calls); otherwise
    the load fails with that reason rather than load a different model. Pieces of β that go into buffers the state
    dict does not hold (EVA's ``k_bias``) are added to the live buffer."""

    def __init__(self, fold):
        self.norm = fold.name
        self.param = fold.param
        self.has_bias = fold.has_bias
        self.reapplied = bool(fold.reapply)
        self.targets = list(fold.params)

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                 missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        from .param_fold import param_folds

        g = state_dict.get(_key(prefix, self.norm, "weight"))
        if not isinstance(g, torch.Tensor):
            return
        marker = _key(prefix, self.norm, FOLD_MARKER) in state_dict  # a re-applied norm's own state dict
        original = not marker if self.reapplied else bool(g.ne(identity_weight_value(self.param)).any())
        if not original:
            return
        stored = {n for t in self.targets for n in [t.weight] + [b.tensor for b in t.bias if b.persistent]}
        missing = sorted(n for n in stored if _key(prefix, "", n) not in state_dict)
        if missing:
            error_msgs.append(f"{self.norm}: this checkpoint holds the norm's original affine, which the converted "
                              f"model folds into {', '.join(sorted(stored))}, but {', '.join(missing)} did not "
                              "arrive with it; load the whole checkpoint in one call")
            return
        live = dict(module.named_parameters()) | dict(module.named_buffers())

        def get(name: str) -> torch.Tensor:
            key = _key(prefix, "", name)
            return state_dict[key] if key in state_dict else live[name]

        b = state_dict.get(_key(prefix, self.norm, "bias")) if self.has_bias else None
        for name, new in param_folds(self.targets, get, effective_scale(g, self.param), b).items():
            key = _key(prefix, "", name)
            if key in state_dict:
                state_dict[key] = new
            else:
                _copy_into(live[name], new)
