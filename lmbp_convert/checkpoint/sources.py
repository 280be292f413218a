"""What a source checkpoint holds, without loading it: tensor names, shards, dtypes, shapes; reads on demand.

Safetensors shards are read through their headers (``SafetensorsFile``); ``.bin``/``.pth`` files only ever go
through ``torch.load(weights_only=True)``, memory-mapped when the file allows it.
"""
from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .errors import CheckpointError
from .safetensors_io import FLOAT_CODES, TORCH_TO_CODE, SafetensorsFile, read_entry

ST_INDEX = "model.safetensors.index.json"
ST_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"


@dataclass
class TensorInfo:
    key: str  # name in the output (and the model-facing name: see raw_key)
    shard: str  # source shard, a file name relative to the source directory
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    nbytes: int
    raw_key: str  # name inside the source file
    start: int = -1  # absolute byte offset (safetensors sources only)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_CODES


class Source:
    """A checkpoint on disk. ``infos`` is in shard order, then data order."""

    fmt: str  # "safetensors" | "bin"

    def __init__(self, root: Path, shards: list[str], label: str) -> None:
        self.root = root
        self.shards = shards
        self.label = label
        self.infos: dict[str, TensorInfo] = {}
        self.index: dict | None = None  # the source index JSON, when sharded
        self.index_name: str | None = None
        self.unindexed: list[str] = []  # files that look like shards of this checkpoint but the index omits
        self.shard_metadata: dict[str, dict[str, str]] = {s: {} for s in shards}
        self._by_shard: dict[str, list[TensorInfo]] | None = None

    def shard_tensors(self, shard: str) -> list[TensorInfo]:
        if self._by_shard is None:
            self._by_shard = {s: [] for s in self.shards}
            for i in self.infos.values():
                self._by_shard[i.shard].append(i)
        return list(self._by_shard[shard])

    def tensor(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, key: str, r0: int, r1: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows r0:r1 of a tensor. With ``out`` (a uint8 buffer) the data may be read into it; the result is
        then a view of ``out`` (``owns_rows`` tells whether results may be modified in place)."""
        raise NotImplementedError

    owns_rows = False  # rows() results are private copies (True) or views of shared data (False)

    def close(self) -> None:
        pass

    def _add(self, info: TensorInfo) -> None:
        if info.key in self.infos:
            raise CheckpointError(f"tensor {info.key!r} is stored twice ({self.infos[info.key].shard} and "
                                  f"{info.shard})")
        self.infos[info.key] = info
        self._by_shard = None


class SafetensorsSource(Source):
    fmt = "safetensors"

    def __init__(self, root: Path, shards: list[str], label: str, rename: Callable[[str], str] | None = None):
        super().__init__(root, shards, label)
        self.files: dict[str, SafetensorsFile] = {}
        self._fds: dict[str, int] = {}
        try:
            for s in shards:
                # opened once, now: the data is read through the descriptor whose header was checked, also if the
                # file is replaced on disk (re-saved) while the conversion runs
                try:
                    self._fds[s] = os.open(root / s, os.O_RDONLY)
                except OSError as exc:
                    raise CheckpointError(f"cannot read {s}: {exc.strerror or exc}") from exc
                f = SafetensorsFile(root / s, label=s, fd=self._fds[s])
                self.files[s] = f
                self.shard_metadata[s] = dict(f.metadata)
                for e in f.entries.values():
                    key = rename(e.key) if rename else e.key
                    self._add(TensorInfo(key, s, e.dtype, e.shape, e.nbytes, e.key, e.start))
        except BaseException:
            self.close()
            raise

    def fd(self, shard: str) -> int:
        """The read-only descriptor of ``shard`` (shared: reads are positional, so threads may use it at once)."""
        return self._fds[shard]

    def tensor(self, key: str) -> torch.Tensor:
        i = self.infos[key]
        return read_entry(self.fd(i.shard), self.files[i.shard].entries[i.raw_key], i.shard)

    owns_rows = True

    def rows(self, key: str, r0: int, r1: int, out: torch.Tensor | None = None) -> torch.Tensor:
        i = self.infos[key]
        return read_entry(self.fd(i.shard), self.files[i.shard].entries[i.raw_key], i.shard, (r0, r1), out)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def torch_load(path: Path, label: str) -> Any:
    """``torch.load`` with ``weights_only=True`` only, memory-mapped when the file format allows it."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped; any other error recurs below
            return torch.load(path, map_location="cpu", weights_only=True)
    except OSError as exc:
        raise CheckpointError(f"cannot read {label}: {exc.strerror or exc}") from exc
    except Exception as exc:  # unpickling errors, corrupt zip, weights_only refusals: one line for the user
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot load {label} with torch.load(weights_only=True): {first}") from exc


class BinSource(Source):
    """``pytorch_model*.bin`` shards (HF) or a ``.pth`` file (timm). ``select`` turns the loaded object into a flat
    ``{key: tensor}`` (raising CheckpointError when it cannot)."""

    fmt = "bin"

    def __init__(self, root: Path, shards: list[str], label: str,
                 select: Callable[[Any, str], dict[str, torch.Tensor]]):
        super().__init__(root, shards, label)
        self._select = select
        self._cache: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self._fds: dict[str, int] = {}
        try:
            for s in shards:
                if os.path.isdir("/proc/self/fd"):  # later loads read this very file, also if SRC is re-saved
                    try:
                        self._fds[s] = os.open(root / s, os.O_RDONLY)
                    except OSError as exc:
                        raise CheckpointError(f"cannot read {s}: {exc.strerror or exc}") from exc
                sd = self._load(s)
                for key, t in sd.items():
                    code = TORCH_TO_CODE.get(t.dtype)
                    if code is None:
                        raise CheckpointError(f"{s}: tensor {key!r} has dtype {t.dtype}, which safetensors cannot "
                                              "store")
                    self._add(TensorInfo(key, s, code, tuple(t.shape), t.numel() * t.element_size(), key))
                self._cache.clear()  # keep one shard mapped at a time while cataloguing
        except BaseException:
            self.close()
            raise

    def _load(self, shard: str) -> dict[str, torch.Tensor]:
        if shard not in self._cache:
            fd = self._fds.get(shard)
            obj = torch_load(Path(f"/proc/self/fd/{fd}") if fd is not None else self.root / shard, shard)
            self._cache[shard] = self._select(obj, shard)
            while len(self._cache) > 2:  # the shard being written plus one being read from
                self._cache.popitem(last=False)
        self._cache.move_to_end(shard)
        return self._cache[shard]

    def tensor(self, key: str) -> torch.Tensor:
        i = self.infos[key]
        return self._load(i.shard)[i.raw_key]

    def rows(self, key: str, r0: int, r1: int, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.tensor(key)[r0:r1]  # a view of the memory-mapped file: no copy

    def close(self) -> None:
        self._cache.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _flat_state_dict(obj: Any, label: str) -> dict[str, torch.Tensor]:
    if not isinstance(obj, dict) or not obj:
        raise CheckpointError(f"{label} does not hold a state dict (got {type(obj).__name__})")
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{label} is not a flat state dict ({bad[0]!r} is not a named tensor)")
    return obj


def _json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CheckpointError(f"cannot read {what}: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{what} is not valid JSON ({exc})") from exc


def _shards_from_index(root: Path, index_name: str) -> tuple[dict, list[str]]:
    index = _json(root / index_name, index_name)
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"{index_name} has no valid weight_map")
    shards = sorted(set(wm.values()))
    for s in shards:
        p = root / s
        if os.sep in s or (os.altsep and os.altsep in s) or s in ("", ".", ".."):
            raise CheckpointError(f"{index_name} names a shard outside the checkpoint directory: {s!r}")
        if not p.is_file():
            raise CheckpointError(f"shard {s} named in {index_name} is missing from {root}")
    return index, shards


def _check_index(src: Source, index_name: str) -> None:
    for key, shard in src.index["weight_map"].items():
        i = src.infos.get(key)
        if i is None or i.shard != shard:
            where = "is not in any shard" if i is None else f"is in {i.shard}"
            raise CheckpointError(f"{index_name} places tensor {key!r} in {shard}, but it {where} (corrupt index "
                                  "or shard)")


def _unindexed(root: Path, shards: list[str], looks_like: Callable[[str], bool]) -> list[str]:
    named = set(shards)
    return sorted(p.name for p in root.iterdir() if p.name not in named and looks_like(p.name) and p.is_file())


def unindexed_key(src: Source, key: str) -> str | None:
    """The unindexed safetensors file of ``src`` that holds tensor ``key``, if any (headers only)."""
    for name in src.unindexed:
        if name.endswith(".safetensors"):
            try:
                if key in SafetensorsFile(src.root / name, label=name).entries:
                    return name
            except CheckpointError:
                continue
    return None


def open_hf_source(root: Path) -> Source:
    """Find the weights of a Hugging Face model directory (safetensors preferred, like transformers)."""
    if (root / ST_INDEX).is_file():
        index, shards = _shards_from_index(root, ST_INDEX)
        src: Source = SafetensorsSource(root, shards, str(root))
        src.index, src.index_name = index, ST_INDEX
        _check_index(src, ST_INDEX)
        src.unindexed = _unindexed(root, shards, lambda n: n.endswith(".safetensors"))
        return src
    if (root / ST_SINGLE).is_file():
        return SafetensorsSource(root, [ST_SINGLE], str(root))
    if (root / BIN_INDEX).is_file():
        index, shards = _shards_from_index(root, BIN_INDEX)
        src = BinSource(root, shards, str(root), _flat_state_dict)
        src.index, src.index_name = index, BIN_INDEX
        _check_index(src, BIN_INDEX)
        src.unindexed = _unindexed(root, shards, lambda n: n.startswith("pytorch_model") and n.endswith(".bin"))
        return src
    if (root / BIN_SINGLE).is_file():
        return BinSource(root, [BIN_SINGLE], str(root), _flat_state_dict)
    raise CheckpointError(f"no weights in {root}: expected {ST_SINGLE}, {ST_INDEX}, {BIN_SINGLE} or {BIN_INDEX}")


def bin_to_safetensors_name(name: str) -> str:
    """pytorch_model-00001-of-00002.bin → model-00001-of-00002.safetensors (the names transformers looks for)."""
    m = re.fullmatch(r"pytorch_model(.*)\.bin", name)
    return f"model{m.group(1)}.safetensors" if m else re.sub(r"\.bin$", "", name) + ".safetensors"


# -- timm -------------------------------------------------------------------------------------------------------
_TIMM_CONTAINERS = ("state_dict", "model", "module")
_TIMM_EMA = ("state_dict_ema", "model_ema")  # where timm's training script saves them


def _clean_timm_key(k: str) -> str:
    return k[len("module."):] if k.startswith("module.") else k  # DataParallel/DDP wrappers, as timm strips them


def _timm_select(use_ema: bool) -> Callable[[Any, str], dict[str, torch.Tensor]]:
    def select(obj: Any, label: str) -> dict[str, torch.Tensor]:
        if use_ema:  # asked for EMA weights: never fall back to the regular ones
            ema = next((n for n in _TIMM_EMA if isinstance(obj, dict) and isinstance(obj.get(n), dict)), None)
            if ema is None:
                held = (f"it holds {', '.join(repr(k) for k in list(obj)[:5])}" if isinstance(obj, dict) and obj
                        else f"it holds a {type(obj).__name__}")
                raise CheckpointError(f"{label} has no EMA weights (no {' or '.join(_TIMM_EMA)}; {held}); drop "
                                      "--use-ema to convert the regular weights")
            obj = obj[ema]
        elif isinstance(obj, dict):
            for name in _TIMM_CONTAINERS:
                if isinstance(obj.get(name), dict):
                    obj = obj[name]
                    break
        sd = _flat_state_dict(obj, label)
        out = {}
        for k, v in sd.items():
            ck = _clean_timm_key(k)
            if ck in out:
                raise CheckpointError(f"{label}: {k!r} and another tensor both map to {ck!r}")
            out[ck] = v
        return out

    return select


def open_timm_source(path: Path, use_ema: bool = False) -> Source:
    """A timm checkpoint file: safetensors, or a torch.save'd (training) checkpoint holding a state dict."""
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file")
    if path.suffix == ".safetensors":
        if use_ema:
            raise CheckpointError("--use-ema needs a .pth training checkpoint, not safetensors")
        return SafetensorsSource(path.parent, [path.name], str(path), rename=_clean_timm_key)
    return BinSource(path.parent, [path.name], str(path), _timm_select(use_ema))

