"""The model a checkpoint is for, built on the meta device (no weights), and how checkpoint keys map onto it."""
from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import re
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..enums import StrChoice
from .errors import CheckpointError
from ..hf_compat import dtype_kwargs


class ModelSource(StrChoice):
    """Which library builds the model a checkpoint holds."""

    HF = "hf"  # Hugging Face transformers, from config.json
    TIMM = "timm"  # timm, by model name


@dataclass
class ModelView:
    """A meta-device model plus what the converter needs to know about its tensors."""

    model: nn.Module
    kind: ModelSource
    arch: str  # class name (HF: the class that loads the checkpoint) or timm model name
    state: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)  # name → (shape, dtype)
    groups: dict[str, frozenset[str]] = field(default_factory=dict)  # parameter name → names sharing it
    linear_like: set[str] = field(default_factory=set)  # modules that hold both a weight and a bias
    named_arch: bool = True  # HF: the class came from config.json's architectures (not the AutoModel default)

    def __post_init__(self) -> None:
        self.kind = ModelSource(self.kind)

    @classmethod
    def of(cls, model: nn.Module, kind: ModelSource | str, arch: str) -> "ModelView":
        v = cls(model, kind, arch)
        v.state = {k: (tuple(t.shape), t.dtype) for k, t in model.state_dict(keep_vars=True).items()}
        owners: dict[int, list[str]] = defaultdict(list)
        for n, p in model.named_parameters(remove_duplicate=False):
            owners[id(p)].append(n)
        for names in owners.values():
            g = frozenset(names)
            for n in names:
                v.groups[n] = g
        for mname, mod in model.named_modules():
            own = dict(mod.named_parameters(recurse=False))
            if "weight" in own and "bias" in own:
                v.linear_like.add(mname)
        return v

    def group(self, name: str) -> frozenset[str]:
        return self.groups.get(name, frozenset([name]))


@contextlib.contextmanager
def quiet_loggers():
    """transformers and timm log warnings while building and running models (older transformers warn about
    output dtypes on the first forward of the meta trace); the CLI speaks for itself."""
    loggers = [logging.getLogger(n) for n in ("transformers", "timm")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        yield
    finally:
        for lg, lvl in zip(loggers, levels):
            lg.setLevel(lvl)


@contextlib.contextmanager
def _quiet():
    """``quiet_loggers``, and no Python warnings nor stdout while building models from configs."""
    with quiet_loggers(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """The whole message on one line (a first line alone may be a bare heading, e.g. "Validation error for field
    'x':"), cut at ``limit`` characters."""
    text = " ".join(str(exc).split())
    if not text:
        return type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


# -- Hugging Face -----------------------------------------------------------------------------------------------
def read_config_json(root: Path) -> dict:
    path = root / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{root} has no config.json (a Hugging Face model directory needs one; for a timm "
                              "checkpoint file pass --timm-model NAME)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is invalid: it holds a JSON {type(raw).__name__}, not an object")
    if raw.get("quantization_config"):
        raise CheckpointError(f"{root} is quantized (config.json has quantization_config): fold the "
                              "full-precision checkpoint, then quantize")
    return raw


def hf_config(raw: dict, root: Path):
    """A transformers config from the raw config.json dict (offline, no remote code)."""
    from transformers import CONFIG_MAPPING

    if not isinstance(raw.get("model_type"), str):
        raise CheckpointError(f"{root / 'config.json'} is invalid: it has no model_type")
    try:
        config_cls = CONFIG_MAPPING[raw["model_type"]]
    except (ValueError, KeyError) as exc:
        import transformers

        if raw.get("auto_map"):
            raise CheckpointError(f"unknown architecture: model_type {raw['model_type']!r} needs custom code "
                                  "(auto_map), which lmbp-convert does not run") from exc
        raise CheckpointError(f"unknown architecture: model_type {raw['model_type']!r} is not known to "
                              f"transformers {transformers.__version__}") from exc
    try:
        with _quiet():
            return config_cls.from_dict(copy.deepcopy(raw))
    except Exception as exc:
        raise CheckpointError(f"{root / 'config.json'} is invalid: {_one_line(exc)}") from exc


def hf_model_class(raw: dict, cfg) -> tuple[Callable[..., nn.Module], str]:
    """The class that loads this checkpoint: ``architectures[0]`` when given, else the AutoModel class."""
    import transformers

    archs = raw.get("architectures")
    if archs is not None and not isinstance(archs, list):
        raise CheckpointError(f"config.json is invalid: \"architectures\" is a JSON {type(archs).__name__}, not a list "
                              f"of model class names (got {archs!r})")
    if archs:
        name = archs[0]
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if cls is None or not isinstance(cls, type) or not issubclass(cls, nn.Module):
            hint = " (custom code via auto_map is not run)" if raw.get("auto_map") else ""
            raise CheckpointError(f"unknown architecture: transformers {transformers.__version__} has no model "
                                  f"class {name!r}{hint}")
        return (lambda c, **kw: cls._from_config(c, **kw)), name
    from transformers import AutoModel

    try:
        arch_cls = AutoModel._model_mapping[type(cfg)]
    except KeyError as exc:
        raise CheckpointError(f"unknown architecture: no AutoModel class for model_type "
                              f"{raw.get('model_type')!r} and config.json names no architectures") from exc
    return (lambda c, **kw: AutoModel.from_config(c, **kw)), arch_cls.__name__


def import_model_code(timm_model: str | None, raw: dict | None, root: Path) -> None:
    """Import the library code the meta model is built from (timm, or the transformers config and model classes),
    so that the CLI can say how long imports took apart from building and tracing. Errors are left to the build,
    which reports them."""
    try:
        if timm_model:
            import timm  # noqa: F401
        elif raw is not None:
            hf_model_class(raw, hf_config(raw, root))
    except Exception:
        pass


def build_hf(raw: dict, root: Path, dtype: torch.dtype | None) -> ModelView:
    cfg = hf_config(raw, root)
    if getattr(cfg, "_experts_implementation", None) is not None or hasattr(cfg, "_experts_implementation_internal"):
        # MoE experts held as parameters (transformers ≥ 5): the grouped-matmul kernel has no meta implementation
        # for fp32 and the per-expert loop reads routing values; the batched one traces on meta, and the plan
        # (which parameters the norm folds into) is the same whichever way the experts run
        cfg._experts_implementation = "batched_mm"
    make, arch = hf_model_class(raw, cfg)
    kw = dtype_kwargs(dtype)
    try:
        with _quiet(), torch.device("meta"):
            model = make(cfg, **kw)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot build {arch} from config.json: {_one_line(exc)}") from exc
    model.eval()
    view = ModelView.of(model, ModelSource.HF, arch)
    view.named_arch = bool(raw.get("architectures"))
    return view


def build_timm(name: str, kwargs: dict[str, Any], dtype: torch.dtype | None) -> ModelView:
    import timm

    if not timm.is_model(name):
        raise CheckpointError(f"unknown architecture: timm {timm.__version__} has no model {name!r}")
    try:
        with _quiet(), torch.device("meta"):
            model = timm.create_model(name, pretrained=False, **kwargs)
            if dtype is not None and dtype != torch.float32:
                model = model.to(dtype)
    except Exception as exc:
        raise CheckpointError(f"cannot build timm model {name!r} with {kwargs}: {_one_line(exc)}") from exc
    model.eval()
    return ModelView.of(model, ModelSource.TIMM, name)


# -- checkpoint key → model name -----------------------------------------------------------------------------
@dataclass
class KeyMap:
    """How each checkpoint key reaches the model."""

    plain: dict[str, str] = field(default_factory=dict)  # ckpt key → model name (a 1:1 rename at most)
    converted: dict[str, str] = field(default_factory=dict)  # ckpt key → model name, through a load-time converter
    ignored: list[str] = field(default_factory=list)  # keys the model class itself ignores on load
    #: converted keys → the converter's operations, (class name, dim) each (MergeModulelist 0, Concatenate 1)
    operations: dict[str, list[tuple[str, int | None]]] = field(default_factory=dict)

    def stored(self) -> dict[str, str]:
        """model name → ckpt key, for plainly stored tensors."""
        return {m: k for k, m in self.plain.items()}


def _ignore_regex(view: ModelView) -> re.Pattern | None:
    pats = set(getattr(view.model, "_keys_to_ignore_on_load_unexpected", None) or [])
    buffers = [n for n, _ in view.model.named_buffers()]
    if any(b.endswith("rotary_emb.inv_freq") for b in buffers):  # transformers drops these old buffers too
        pats.add(r"rotary_emb\.inv_freq")
    if any(b.endswith("position_ids") for b in buffers):
        pats.add(r"(^|\.)position_ids$")
    return re.compile("|".join(f"({p})" for p in sorted(pats))) if pats else None


def map_keys(view: ModelView, keys: list[str], where: Callable[[str], str]) -> KeyMap:
    """Map checkpoint keys to model names the way the loader does; a key the model does not expect is an error."""
    km = KeyMap()
    meta = view.state
    renamings: list = []
    converters: list = []
    rename = None
    order = sorted(keys)
    if view.kind is ModelSource.HF:
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import (WeightConverter, WeightRenaming, dot_natural_key,
                                                         rename_source_key)

            mapping = get_model_conversion_mapping(view.model)
            renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
            converters = [m for m in mapping if isinstance(m, WeightConverter)]
            rename = rename_source_key
            order = sorted(keys, key=dot_natural_key)
        except ImportError:  # older transformers: exact names and the base-model prefix only
            rename = None
    prefix = getattr(view.model, "base_model_prefix", "") if view.kind is ModelSource.HF else ""

    def fallback(k: str) -> str:
        if k in meta or not prefix:
            return k
        if k.startswith(prefix + ".") and k[len(prefix) + 1:] in meta:
            return k[len(prefix) + 1:]
        if f"{prefix}.{k}" in meta:
            return f"{prefix}.{k}"
        return k

    ignore = _ignore_regex(view) if view.kind is ModelSource.HF else None
    seen: dict[str, str] = {}
    for k in order:
        pattern = None
        if rename is not None:
            m, pattern = rename(k, renamings, converters, prefix or None, meta)
            if m not in meta and k in meta:
                m, pattern = rename(k, [], [], prefix or None, meta)
        else:
            m = fallback(k)
        if m in meta and pattern is not None:
            km.converted[k] = m
            conv = next((c for c in converters if pattern in getattr(c, "source_patterns", ())), None)
            if conv is not None:
                km.operations[k] = [(type(o).__name__, getattr(o, "dim", None))
                                    for o in getattr(conv, "operations", [])]
            continue
        if m in meta:
            if m in seen:
                raise CheckpointError(f"checkpoint tensors {seen[m]!r} and {k!r} both load into {m!r}")
            seen[m] = k
            km.plain[k] = m
            continue
        if ignore is not None and (ignore.search(k) or ignore.search(m)):
            km.ignored.append(k)
            continue
        hint = ("config.json names no architectures, so the checkpoint was read as the base model; add "
                "\"architectures\" to it" if view.kind is ModelSource.HF and not view.named_arch else
                "is config.json from another model?")
        raise CheckpointError(f"tensor {k!r} in {where(k)} is not expected by the config ({view.arch} has no "
                              f"{m!r}); {hint}")
    return km
