"""Export a converted model as a checkpoint that plain transformers / timm load, without this package.

A converted model's own ``state_dict()`` already has the original keys, and for most folds it is already a
plain checkpoint: the folded norm holds identity ``weight``/``bias`` buffers and the Linears hold W·diag(γ),
b + W·β, which a plain model computes identically. Two kinds of fold are not expressible that way:

* norms whose affine is re-applied on another branch (post-LN BERT/RoBERTa, a returned final norm): they keep
  γ, β as Parameters, so a plain model would apply γ, β *and* the folded Linear. Here the Linears are
  unfolded with the norm's current γ, β: W = W'·diag(1/γ), b = b' − W·β (exact up to rounding, also after
  training, since the converted function is W'·x̂ + b' on that branch and γ·x̂ + β on the others).
* folds that gave a bias-less Linear a bias for β (timm Swin's patch-merging ``reduction``; an untied LM
  head): the plain Linear has no bias. The identity norm gets a shift β* instead, solving W'·β* = b' for the
  bias-less targets (exact while that system is consistent: always for a Linear that reduces width, e.g.
  4C → 2C, and before training otherwise), and the norm's other targets compensate with b − W'·β*.
  When no β* reproduces the function, ``ExportError`` says so rather than writing a different model.

Where the converted state dict is not plain (the first kind above), ``model.save_pretrained`` — and so Trainer's
``save_model``, its checkpoints and ``push_to_hub`` — raises `ExportError` (`PlainSaveGuard`, set by
``convert()``); ``torch.save(model.state_dict())`` still writes the converted parametrisation, which is what
resuming *into a converted model* needs (``load_state_dict`` of the same keys); a checkpoint meant for plain
transformers/timm comes from ``save_pretrained`` / ``plain_state_dict`` here. Unfolding runs in float64 and
rounds once to each tensor's dtype (bf16 weights: bf16 rounding). Nothing here changes the model, and
``convert()`` needs no extra call: the fold record is ``model.lmbp_report`` (and ``.previous`` reports).
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import nn

from .apply.convert import REPORT_ATTR
from .errors import ConversionError
from .fold import UnfoldError, effective_scale, relative_residual, unfold_added_bias, unfold_affine
from .enums import AffineState, ConvertedModule
from .match.plan import NormFold
from .nn.norms import FOLD_MARKER
from .report import ConversionReport

__all__ = ["ExportError", "PlainSaveGuard", "plain_state_dict", "save_pretrained", "saves_plainly"]

#: relative residual ‖W'·β* − b'‖ / ‖b'‖ up to which a bias moved back into a norm's shift counts as exact
DEFAULT_RTOL = 1e-4


class ExportError(ConversionError):
    """The converted model cannot be written as a plain checkpoint with the same function."""


def _chain(report: ConversionReport) -> list[ConversionReport]:
    """A report and the reports of earlier ``convert()`` calls on the same model (``report.previous``)."""
    out: list[ConversionReport] = []
    while isinstance(report, ConversionReport) and all(report is not r for r in out):
        out.append(report)
        report = getattr(report, "previous", None)
    return out


def _find_reports(model: nn.Module, report: ConversionReport | None
                  ) -> list[tuple[ConversionReport, Callable[[str], str]]]:
    """Every conversion report that applies to ``model``, each with a map from its module names to ``model``'s:
    the given one, else those of ``model`` and of any submodule (convert, wrap, convert again)."""
    if report is not None:
        return [(r, _name_map(model, r)) for r in _chain(report)]
    found = []
    for name, mod in model.named_modules():
        for r in _chain(getattr(mod, REPORT_ATTR, None)):
            found.append((r, (lambda n, p=name: f"{p}.{n}" if p else n)))
    if not found:
        raise ExportError(f"{type(model).__name__} carries no conversion report (model.{REPORT_ATTR}): was it "
                          "converted with lmbp_convert.convert()? Pass report=... if it was converted under "
                          "another wrapper")
    return found


def _name_map(model: nn.Module, report: ConversionReport) -> Callable[[str], str]:
    """Map the report's module names onto ``model``: the same model, a wrapper of it, or a module it wraps
    (e.g. ``merge_and_unload()`` of a PeftModel that was converted)."""
    names = dict(model.named_modules())
    folds = _norm_folds(report)
    if not folds or folds[0].name in names:
        return lambda n: n
    probe = folds[0].name
    for cand in names:  # model wraps the converted module
        if cand and f"{cand}.{probe}" in names:
            return lambda n, p=cand: f"{p}.{n}"
    parts = probe.split(".")
    for k in range(1, len(parts)):  # the converted module wrapped model

        def strip(n: str, p: str = ".".join(parts[:k]) + ".") -> str:
            if not n.startswith(p):
                raise ExportError(f"{n!r} is outside the exported module (expected under {p[:-1]!r})")
            return n[len(p):]

        if strip(probe) in names:
            return strip
    raise ExportError(f"the report's norm {probe!r} is not a module of {type(model).__name__}")


def _norm_folds(report: ConversionReport) -> list:
    """Every norm fold of the report: plain ones and those into functional consumers (`ConsumerFold`)."""
    return [it for it in report.plan.items if isinstance(it, NormFold)]


def _buffer_shares(fold) -> list[str]:
    """Buffers that a state dict does not hold but that took a share of the norm's β (EVA's ``k_bias``)."""
    return fold.buffer_notes()


def _key(module_name: str, attr: str) -> str:
    return f"{module_name}.{attr}" if module_name else attr


def _require_finite(t: torch.Tensor, what: str) -> None:
    """A NaN or inf in what export divides by or writes is a diverged model, never a checkpoint to save."""
    if not bool(torch.isfinite(t).all()):
        raise ExportError(f"{what} holds NaN or inf values (a diverged or corrupted model): refusing to write a "
                          "checkpoint computed from it")


def plain_state_dict(model: nn.Module, *, report: ConversionReport | None = None,
                     rtol: float = DEFAULT_RTOL) -> dict[str, torch.Tensor]:
    """The state dict of the unconverted architecture that computes what the converted ``model`` computes.

    Keys are the original model's (a converted model drops none; the `FOLD_MARKER` entries its own state dict adds
    for folded post-LN norms are left out); untouched entries are the model's own tensors (detached), changed ones are new tensors in the original dtypes. Works after
    training. ``report`` defaults to the ``lmbp_report`` of ``model`` and of any submodule that was converted
    (and the reports they chain to through ``.previous``).
    Raises ``ExportError`` if a fold has no plain equivalent (see the module docstring).
    """
    sd = model.state_dict()
    for key in [k for k in sd if k.rpartition(".")[2] == FOLD_MARKER]:  # the converted model's own record
        del sd[key]
    modules = dict(model.named_modules())
    done: set[str] = set()
    for rep, rename in _find_reports(model, report):
        for fold in _norm_folds(rep):
            norm_name = rename(fold.name)
            if norm_name not in done:
                _export_fold(sd, modules, fold, norm_name, rename, rtol)
                done.add(norm_name)
    for name, mod in modules.items():  # never write a silently different model
        if name not in done and _is_ms_norm(mod) and isinstance(mod._parameters.get("weight"), nn.Parameter):
            raise ExportError(f"{name} is a converted norm whose affine is re-applied, but no conversion report "
                              "describes its folds (was the report replaced?); cannot unfold its Linears")
    return sd


def saves_plainly(model: nn.Module) -> bool:
    """Is ``model.state_dict()`` already a plain checkpoint (so plain ``save_pretrained`` / ``torch.save`` and a
    plain load give the same outputs)? True unless a converted norm keeps γ, β as parameters (its affine is
    re-applied on another branch) *and* is folded into Linears — post-LN models (BERT, RoBERTa). Those need
    ``save_pretrained`` / ``plain_state_dict`` from this module."""
    reports = [r for _, mod in model.named_modules() for r in _chain(getattr(mod, REPORT_ATTR, None))]
    if any((f.targets or getattr(f, "params", None)) and f.reapply or _buffer_shares(f)
           for r in reports for f in _norm_folds(r)):
        return False
    keeps_affine = any(_is_ms_norm(m) and isinstance(m._parameters.get("weight"), nn.Parameter)
                       for m in model.modules())
    return bool(reports) or not keeps_affine


def _is_ms_norm(mod: nn.Module) -> bool:
    """A memory-sharing norm this package put in whose weights may differ from a plain norm's (the converted
    modules that normalise; not those that apply their own γ, β: their state is a plain norm's)."""
    return (isinstance(mod, ConvertedModule) and hasattr(mod, "normalized_shape")
            and getattr(mod, "affine", None) is not AffineState.KEPT)


def _export_fold(sd: dict, modules: dict, fold, norm_name: str, rename: Callable[[str], str], rtol: float) -> None:
    norm = modules.get(norm_name)
    if norm is None:
        raise ExportError(f"norm {norm_name!r} of the report is not in the model")
    if not _is_ms_norm(norm):
        raise ExportError(f"{norm_name} is a {type(norm).__name__}, not a converted norm: the report does not "
                          "describe this model")
    targets = []
    for t in fold.targets:
        lname = rename(t.name)
        lin = modules.get(lname)
        if lin is None:
            raise ExportError(f"Linear {lname!r} of the report is not in the model")
        if hasattr(lin, "base_layer"):
            raise ExportError(f"{lname} is wrapped by a LoRA adapter; merge the adapters first "
                              "(merge_and_unload()) and pass report=<the converted model's report>")
        targets.append((t, lname, lin))
    if _buffer_shares(fold) and fold.has_bias:
        raise ExportError(f"{norm_name}: its β was folded partly into {', '.join(_buffer_shares(fold))}, a buffer no "
                          "state dict holds, so a plain checkpoint would lose that share; save the converted model "
                          "with its own state_dict (it loads into a converted model), or convert without this norm "
                          f"(exclude=[{norm_name!r}])")
    if fold.param_targets() and any(t.adds_bias for t in fold.targets) and fold.beta == "fold":
        raise ExportError(f"{norm_name}: a bias-less Linear took a share of its β and it also feeds functional "
                          "consumers, whose biases the move of that share back into the norm does not cover; save "
                          "the converted model with its own state_dict")
    if fold.param_targets() and fold.reapply:
        _unfold_params(sd, fold, norm, rename)
    if isinstance(norm._parameters.get("weight"), nn.Parameter):
        _unfold_reapplied(sd, fold, norm, targets, rtol)
    else:
        _move_added_bias(sd, fold, norm_name, norm, targets, rtol)


def _unfold_params(sd: dict, fold, norm: nn.Module, rename: Callable[[str], str]) -> None:
    """Norm keeps γ, β (re-applied elsewhere): unfold them out of the parameters functional ops apply to its output
    (the inverse of `apply.param_fold.param_folds`, with the norm's current γ, β)."""
    from .apply.param_fold import param_unfolds

    gamma = effective_scale(norm.weight, fold.param).to(torch.float64)
    _require_finite(gamma, f"the scale γ of {fold.name}")
    beta = norm.bias if fold.has_bias and isinstance(getattr(norm, "bias", None), torch.Tensor) else None

    def get(name: str) -> torch.Tensor:
        return sd[rename(name)]

    try:
        for name, new in param_unfolds(fold.params, get, gamma, beta).items():
            sd[rename(name)] = _finite_as(new, sd[rename(name)], f"{rename(name)} (unfolded)")
    except UnfoldError as exc:
        raise ExportError(str(exc)) from exc


def _unfold_reapplied(sd: dict, fold, norm: nn.Module, targets: list, rtol: float) -> None:
    """Norm keeps γ, β (re-applied elsewhere): unfold them out of its Linears."""
    gamma = effective_scale(norm.weight, fold.param).to(torch.float64)
    _require_finite(gamma, f"the scale γ of {fold.name}")
    beta = norm.bias.detach().to(torch.float64) if isinstance(getattr(norm, "bias", None), torch.Tensor) else None
    if beta is not None:
        _require_finite(beta, f"the shift β of {fold.name}")
    for t, lname, lin in targets:
        wk, bk = _key(lname, t.weight), _key(lname, "bias")
        weight = getattr(lin, t.weight)
        bias = lin.bias if t.weight == "weight" and isinstance(getattr(lin, "bias", None), torch.Tensor) else None
        try:
            w, b = unfold_affine(weight, bias, gamma, beta if fold.beta == "fold" else None,
                                 t.layout)
        except UnfoldError as exc:
            raise ExportError(str(exc)) from exc
        sd[wk] = _finite_as(w, weight, f"{wk} (unfolded: W'/γ)")
        if t.adds_bias and fold.beta == "fold":  # the plain Linear has no bias: what is left of b' must be nothing
            if b is not None:
                _require_small(b, bias, rtol, lname)
            sd.pop(bk, None)
        elif b is not None:
            sd[bk] = _finite_as(b, lin.bias, f"{bk} (unfolded: b' − W·β)")


def _finite_as(value: torch.Tensor, like: torch.Tensor, what: str) -> torch.Tensor:
    """``value`` rounded to ``like``'s dtype; an error where that is non-finite (overflow of W'/γ in fp16, or a
    non-finite input) unless the model's own tensor is non-finite at the same place."""
    out = value.to(like.dtype)
    if bool((~torch.isfinite(out) & torch.isfinite(like.detach())).any()):
        raise ExportError(f"{what} is NaN or inf in {str(like.dtype).replace('torch.', '')} (a tiny γ makes W'/γ "
                          "overflow, or the model holds non-finite values): a plain checkpoint cannot hold this "
                          "model's function")
    return out


def _require_small(residual: torch.Tensor, reference: torch.Tensor, rtol: float, what: str) -> None:
    rel = relative_residual(residual, reference)
    if not rel <= rtol:  # NaN (a non-finite bias or weight) is never small
        raise ExportError(f"{what}: the fold gave this bias-less Linear a bias that no plain checkpoint can hold "
                          f"(relative residual {rel:.1e} > {rtol:.0e}); the converted model has drifted from "
                          "the plain architecture during training. Save it with its own state_dict and rebuild "
                          "with lmbp_convert instead")


def _move_added_bias(sd: dict, fold, norm_name: str, norm: nn.Module, targets: list, rtol: float) -> None:
    """Identity norm: move the biases a fold added to bias-less Linears back into the norm's shift."""
    added = [(t, n, lin) for t, n, lin in targets if t.adds_bias]
    if not added or fold.beta != "fold":  # "shift": β is the norm's own entry already
        return
    bias_key = _key(norm_name, "bias")
    if bias_key not in sd:
        raise ExportError(f"{norm_name} has no bias entry to take the shift that {added[0][1]} needs")
    others = [(t, lname, lin) for t, lname, lin in targets if not t.adds_bias]
    move = unfold_added_bias(
        norm.bias, [(lin.weight, lin.bias, t.layout) for t, _, lin in added],
        [(lin.weight, lin.bias if isinstance(getattr(lin, "bias", None), torch.Tensor) else None, t.layout)
         for t, _, lin in others])
    _require_small(move.residual, move.added, rtol, ", ".join(n for _, n, _ in added))
    sd[bias_key] = _finite_as(move.shift, norm.bias, bias_key)
    for (t, lname, lin), b in zip(others, move.biases):
        if b is not None:
            sd[_key(lname, "bias")] = _finite_as(b, lin.bias, _key(lname, "bias"))
    for t, lname, lin in added:
        sd.pop(_key(lname, "bias"), None)


def _untied_tie_flags(model: nn.Module) -> list[Any]:
    """Configs that say "tie word embeddings" although a fold (untie=True) gave the head its own weight."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    cfg = getattr(model, "config", None)
    if cfg is None or get_in is None or get_out is None:
        return []
    try:
        emb_in, emb_out = get_in(), get_out()
    except NotImplementedError:  # transformers 5: a model without token embeddings (speech encoders)
        return []
    if emb_in is None or emb_out is None or getattr(emb_out, "weight", None) is None:
        return []
    if emb_out.weight is emb_in.weight:
        return []
    cfgs = [cfg]
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else None
    if text is not None and text is not cfg:
        cfgs.append(text)
    return [c for c in cfgs if getattr(c, "tie_word_embeddings", False)]


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, *,
                    report: ConversionReport | None = None, rtol: float = DEFAULT_RTOL, **kwargs: Any) -> None:
    """``model.save_pretrained(save_directory)`` with the plain state dict: a checkpoint that plain
    ``from_pretrained`` loads, without lmbp_convert, with this model's outputs. When a fold untied the LM
    head (``convert(untie=True)``), the saved config says ``tie_word_embeddings=False`` so that loading does
    not tie it back. Extra keyword arguments go to ``save_pretrained``.
    """
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"{type(model).__name__} has no save_pretrained; use torch.save(plain_state_dict(model))")
    if "state_dict" in kwargs:
        raise TypeError("save_pretrained() computes the state dict itself; do not pass state_dict=")
    sd = plain_state_dict(model, report=report, rtol=rtol)
    flags = _untied_tie_flags(model)
    for c in flags:
        c.tie_word_embeddings = False
    try:
        type(model).save_pretrained(model, save_directory, state_dict=sd, **kwargs)  # past a `PlainSaveGuard`
    finally:
        for c in flags:
            c.tie_word_embeddings = True


class PlainSaveGuard:
    """A converted transformers model's ``save_pretrained`` (an instance attribute `convert()` sets): the class's
    own method while ``saves_plainly(model)``, else `ExportError`, since that checkpoint would load into plain
    transformers as a different model (folded Linears next to the γ, β their norm keeps: post-LN folds). Trainer's
    ``save_model`` and checkpoints, and ``push_to_hub``, call it too, so none of them writes such a file silently."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not saves_plainly(self.model):
            raise ExportError(
                f"save_pretrained() of this converted {type(self.model).__name__} would write folded Linears next to "
                "the γ, β their norms keep (a fold_norms=True conversion whose norm affine is re-applied on other "
                "branches, e.g. post-LN), which plain from_pretrained loads as a different model. Write a plain "
                "checkpoint with lmbp_convert.export.save_pretrained(model, path); to resume a converted model, "
                "torch.save(model.state_dict()) and load_state_dict it; or convert with fold_norms=False (the "
                "default: exact norms, the same saving, a plain state dict).")
        return type(self.model).save_pretrained(self.model, *args, **kwargs)


def guard_plain_save(model: nn.Module) -> tuple[Callable[[], None], Callable[[], None]] | None:
    """The (do, undo) step that sets `PlainSaveGuard` on a transformers model whose state dict is not plain
    (None otherwise: nothing to guard)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency of every HF model
        return None
    if not isinstance(model, PreTrainedModel) or saves_plainly(model):
        return None
    had = "save_pretrained" in model.__dict__
    old = model.__dict__.get("save_pretrained")

    def do() -> None:
        model.__dict__["save_pretrained"] = PlainSaveGuard(model)

    def undo() -> None:
        if had:
            model.__dict__["save_pretrained"] = old
        else:
            model.__dict__.pop("save_pretrained", None)

    return do, undo
