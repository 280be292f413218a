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
* a norm whose affine is also re-applied elsewhere keeps γ, β as parameters, so its entries look the same
  folded or not; its Linears are folded on load only while they hold unfolded weights (converted on ``meta``).
* pieces may arrive in separate calls, in any order (``strict=False`` per shard, as in transformers'
  ``load_sharded_checkpoint`` and Trainer resume): the norm's γ, β are kept until every Linear of the fold has
  arrived; a Linear that arrives before its norm waits unfolded and is folded in place when the norm arrives.

Not covered: a load of *only* a norm's γ, β followed by a separate load of converted-form Linears (the kept γ
would fold them again), and loaders that bypass ``Module.load_state_dict`` and set tensors one by one
(accelerate's ``set_module_tensor_to_device`` with a ``device_map``): load those weights before ``convert()``.
"""
from __future__ import annotations

import torch
from torch import nn

from ..fold import (effective_scale, fold_affine, identity_weight_value, shift_is_expressible, shift_of,
                    shift_through_scale)
from ..match.plan import NormFold


def _key(prefix: str, module: str, attr: str) -> str:
    return f"{prefix}{module}.{attr}" if module else f"{prefix}{attr}"


def _copy_into(live: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        live.copy_(value)


class _Target:
    """One Linear of the fold (names relative to the converted model) and the state of its live tensors."""

    def __init__(self, name: str, layout: str, base: str | None, lora_a: list[str], has_bias: bool, plain: bool):
        self.layout = layout
        self.linear = f"{name}.{base}" if base else name
        self.lora_a = lora_a  # module names of lora_A adapters (they take γ only)
        self.has_bias = has_bias
        self.plain = plain  # live W (and b) hold original values not yet folded with the kept γ, β
        self.seen: set[str] = set()  # pieces ("weight", "bias") that arrived since γ, β were kept
        self.beta_done = False  # the kept β is folded into the live bias


class FoldOnLoad:
    """load_state_dict pre-hook of a converted model for one folded norm (see the module docstring)."""

    def __init__(self, fold: NormFold, targets: list[_Target], awaiting: bool):
        self.norm = fold.name
        self.param = fold.param
        self.beta_mode = getattr(fold, "beta", "fold") if fold.has_bias else "none"
        self.reapplied = bool(fold.reapply)
        self.targets = targets
        self.awaiting = awaiting  # converted on meta: the Linears have never held folded weights
        self.gamma: torch.Tensor | None = None  # the original γ (effective scale) of the checkpoint being loaded
        self.beta: torch.Tensor | None = None  # its β, where β folds into biases

    @classmethod
    def for_fold(cls, modules: dict[str, nn.Module], fold: NormFold) -> "FoldOnLoad":
        targets, meta = [], False
        for t in fold.targets:
            lin = modules[t.name]
            base = getattr(lin, t.base) if t.base else lin
            meta = meta or base.weight.device.type == "meta"
            lora_a = [f"{t.name}.{t.lora_a_attr}.{a}" for a in t.lora_adapters] if t.base else []
            targets.append(_Target(t.name, t.layout, t.base, lora_a, getattr(base, "bias", None) is not None,
                                   plain=False))
        awaiting = meta and not fold.prefolded
        for t in targets:
            t.plain = awaiting
        return cls(fold, targets, awaiting)

    # -- the hook ----------------------------------------------------------------------------------------
    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                 missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        new_gamma, new_beta = self._take_norm(module, state_dict, prefix, error_msgs)
        for t in self.targets:
            self._take_target(module, state_dict, prefix, t, new_gamma, new_beta, error_msgs)
        if self.gamma is not None and all(t.seen >= self._pieces(t) for t in self.targets):
            self._forget()  # every piece of this checkpoint's fold has arrived: the Linears hold folded weights
            self.awaiting = False

    def _pieces(self, t: _Target) -> set[str]:
        return {"weight", "bias"} if t.has_bias else {"weight"}

    def _forget(self) -> None:
        self.gamma = self.beta = None
        for t in self.targets:
            t.seen.clear()
            t.beta_done = False

    def _take_norm(self, module: nn.Module, sd: dict, prefix: str, errors: list[str]) -> tuple[bool, bool]:
        """Keep the arriving original γ, β (and put what the converted norm holds in their place).
        Returns (γ arrived, β arrived)."""
        gk, bk = _key(prefix, self.norm, "weight"), _key(prefix, self.norm, "bias")
        g_in, b_in = sd.get(gk), sd.get(bk)
        if g_in is None and b_in is None:
            return False, False
        if self.reapplied:  # γ, β stay the norm's parameters; fold only into Linears still unfolded
            if not self.awaiting:
                return False, False
            norm = module.get_submodule(self.norm)
            g = g_in if g_in is not None else norm.weight
            b = b_in if b_in is not None else getattr(norm, "bias", None)
            self._keep(effective_scale(g, self.param), b.detach() if self.beta_mode == "fold" and b is not None
                       else None)
            return True, self.beta is not None
        ident = identity_weight_value(self.param)
        new_gamma = new_beta = False
        if g_in is not None:
            if bool(torch.all(g_in == ident)) and not (self.beta_mode == "fold" and b_in is not None
                                                         and bool(torch.any(b_in != 0))):
                self._converted_form()  # identity: the converted parametrisation, loaded as it is
                return False, False
            self._keep(effective_scale(g_in, self.param), self.beta)
            sd[gk] = torch.full_like(g_in, ident)
            new_gamma = True
        if self.beta_mode == "fold" and b_in is not None:
            if bool(torch.any(b_in != 0)):
                if self.gamma is None:
                    self._keep(torch.ones(b_in.shape, dtype=torch.float32, device=b_in.device), None)
                self.beta = b_in.detach()
                new_beta = True
            sd[bk] = torch.zeros_like(b_in)
        if self.beta_mode == "shift" and self.gamma is not None and (new_gamma or b_in is not None):
            self._shift_behind_scale(module, sd, bk, errors)
        return new_gamma, new_beta

    def _keep(self, gamma: torch.Tensor, beta: torch.Tensor | None) -> None:
        if self.gamma is None:  # a new checkpoint starts: Linears not re-sent hold what gets folded in place
            for t in self.targets:
                t.seen.clear()
                t.beta_done = False
        self.gamma, self.beta = gamma, beta

    def _converted_form(self) -> None:
        self.awaiting = False
        self._forget()
        for t in self.targets:
            t.plain = False

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
        wk, bk = _key(prefix, t.linear, "weight"), _key(prefix, t.linear, "bias")
        w_in, b_in = sd.get(wk), sd.get(bk)
        t.seen.update(k for k, v in (("weight", w_in), ("bias", b_in)) if v is not None)
        if self.gamma is None:  # no original affine known: arriving tensors are what the model holds
            if w_in is not None and not self.awaiting:
                t.plain = False
            return
        lin = module.get_submodule(t.linear)
        if new_beta:
            t.beta_done = False
        beta = self.beta if self.beta_mode == "fold" and t.has_bias else None
        if beta is not None and (b_in is not None or not t.beta_done):
            # b + W·β needs the original W: the arriving one, the live one while unfolded, else W'/γ
            w_plain = w_in if w_in is not None else (
                lin.weight if (t.plain or new_gamma) else self._unfolded(lin.weight, t, errors))
            b_src = b_in if b_in is not None else lin.bias
            if w_plain is not None and b_src.device.type != "meta" and w_plain.device.type != "meta":
                shift = shift_of(w_plain.detach().double(), beta.double().to(w_plain.device), t.layout)
                b_new = (b_src.detach().double() + shift.to(b_src.device)).to(b_src.dtype)
                if b_in is not None:
                    sd[bk] = b_new
                else:
                    _copy_into(b_src, b_new)
            t.beta_done = True
        if w_in is not None:  # an arriving weight is the original one
            sd[wk], _ = fold_affine(w_in, None, self.gamma, None, t.layout)
            for a in t.lora_a:
                ak = _key(prefix, a, "weight")
                if ak in sd:
                    sd[ak], _ = fold_affine(sd[ak], None, self.gamma, None, "out_in")
            t.plain = False
        elif new_gamma and (t.plain or not self.reapplied) and lin.weight.device.type != "meta":
            _copy_into(lin.weight, fold_affine(lin.weight, None, self.gamma, None, t.layout)[0])
            for a in t.lora_a:
                a_w = module.get_submodule(a).weight
                _copy_into(a_w, fold_affine(a_w, None, self.gamma, None, "out_in")[0])
            t.plain = False

    def _unfolded(self, w: torch.Tensor, t: _Target, errors: list[str]) -> torch.Tensor | None:
        g = self.gamma.to(device=w.device, dtype=torch.float64)
        if bool((g == 0).any()):
            errors.append(f"{self.norm}: β arrived after {t.linear}.weight was folded with a γ that is 0 on some "
                          "channel; load the norm together with its Linears")
            return None
        wd = w.detach().double()
        return wd / g if t.layout == "out_in" else wd / g[:, None]
