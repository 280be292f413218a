"""Streaming safetensors reading and writing, a tensor (or a slice of rows) at a time.

The ``safetensors`` package reads whole files or mmaps them, and ``save_file`` builds the whole file in memory
(a second copy of every tensor); neither keeps memory at one tensor. The format is simple (8-byte little-endian
header length, JSON header, raw little-endian data), so headers are parsed and validated here, unchanged tensors
are copied byte range to byte range by the kernel (``copy_file_range``/``sendfile``), and changed tensors are
written as they are computed.
"""
from __future__ import annotations

import errno
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from . import fsops
from .errors import CheckpointError

#: safetensors dtype code → (torch dtype or None when this torch lacks it, bytes per element)
DTYPES: dict[str, tuple[torch.dtype | None, int]] = {}
for _code, _name, _size in [
    ("F64", "float64", 8), ("F32", "float32", 4), ("F16", "float16", 2), ("BF16", "bfloat16", 2),
    ("I64", "int64", 8), ("I32", "int32", 4), ("I16", "int16", 2), ("I8", "int8", 1), ("U8", "uint8", 1),
    ("U16", "uint16", 2), ("U32", "uint32", 4), ("U64", "uint64", 8), ("BOOL", "bool", 1),
    ("F8_E4M3", "float8_e4m3fn", 1), ("F8_E5M2", "float8_e5m2", 1), ("C64", "complex64", 8),
]:
    DTYPES[_code] = (getattr(torch, _name, None), _size)
TORCH_TO_CODE = {v[0]: k for k, v in DTYPES.items() if v[0] is not None}
FLOAT_CODES = ("F64", "F32", "F16", "BF16")
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: where its bytes are (absolute offsets)."""

    key: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return DTYPES.get(self.dtype, (None, 0))[0]


class SafetensorsFile:
    """The validated header of one safetensors file. Reading opens the file read-only; nothing is mapped."""

    def __init__(self, path: Path, label: str | None = None, fd: int | None = None) -> None:
        """``fd``: an open descriptor of the file to read the header from (the one the data will be read through,
        so that a file replaced on disk after planning cannot pair this header with another file's bytes)."""
        self.path = Path(path)
        self.label = label or self.path.name
        try:
            own = fd is None
            if own:
                fd = os.open(self.path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                head = os.pread(fd, 8, 0)
                if len(head) < 8:
                    raise CheckpointError(f"{self.label} is truncated or not a safetensors file ({size} bytes)")
                n = int.from_bytes(head, "little")
                if n > _MAX_HEADER or 8 + n > size:
                    raise CheckpointError(f"{self.label} is truncated or corrupt (header of {n} bytes in a file "
                                          f"of {size} bytes)")
                raw = os.pread(fd, n, 8)
                if len(raw) < n:
                    raise CheckpointError(f"{self.label} is truncated (unexpected end of file)")
            finally:
                if own:
                    os.close(fd)
        except OSError as exc:
            raise CheckpointError(f"cannot read {self.label}: {exc.strerror or exc}") from exc
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{self.label} is corrupt (its header is not valid JSON: {exc})") from exc
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.label} is corrupt (its header is not a JSON object)")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise CheckpointError(f"{self.label} is corrupt (__metadata__ is not an object)")
        self.metadata: dict[str, str] = {str(k): str(v) for k, v in meta.items()}
        self.data_start = 8 + n
        data_len = size - self.data_start
        spans = []
        for key, info in header.items():
            try:
                dtype, shape, (b, e) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
                b, e = int(b), int(e)
            except (TypeError, KeyError, ValueError) as exc:
                raise CheckpointError(f"{self.label} is corrupt (bad header entry for {key!r})") from exc
            if not isinstance(dtype, str):
                raise CheckpointError(f"{self.label} is corrupt (dtype of {key!r} is not a string: {dtype!r})")
            if any(s < 0 for s in shape) or not 0 <= b <= e:
                raise CheckpointError(f"{self.label} is corrupt (bad shape or offsets for {key!r})")
            if dtype in DTYPES and e - b != math.prod(shape) * DTYPES[dtype][1]:
                raise CheckpointError(f"{self.label} is corrupt ({key!r}: {e - b} bytes for a {dtype} tensor of "
                                      f"shape {list(shape)})")
            spans.append((b, e, key, dtype, shape))
        spans.sort()
        pos = 0
        for b, e, key, *_ in spans:
            if b != pos:
                raise CheckpointError(f"{self.label} is corrupt (tensor data of {key!r} overlaps or leaves a gap)")
            pos = e
        if pos != data_len:
            what = "truncated" if pos > data_len else "corrupt (trailing bytes after the tensor data)"
            raise CheckpointError(f"{self.label} is {what}: the header describes {pos} bytes of tensor data, the "
                                  f"file holds {data_len}")
        self.entries: dict[str, Entry] = {
            key: Entry(key, dtype, shape, self.data_start + b, e - b) for b, e, key, dtype, shape in spans}


def _pread_into(fd: int, buf: memoryview, offset: int, label: str) -> None:
    done = 0
    while done < len(buf):
        k = os.preadv(fd, [buf[done:]], offset + done)
        if k == 0:
            raise CheckpointError(f"{label} is truncated (unexpected end of file)")
        done += k


def read_entry(fd: int, entry: Entry, label: str, rows: tuple[int, int] | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Read one tensor (or rows r0:r1 of its first dimension) into a fresh CPU tensor, or into the first bytes of
    ``out`` (a uint8 buffer, reused across reads to avoid fresh allocations)."""
    dtype = entry.torch_dtype
    if dtype is None:
        raise CheckpointError(f"{label}: tensor {entry.key!r} has dtype {entry.dtype}, which this torch cannot read")
    shape = entry.shape
    offset, nbytes = entry.start, entry.nbytes
    if rows is not None:
        r0, r1 = rows
        row_bytes = entry.nbytes // shape[0] if shape and shape[0] else 0
        offset, nbytes, shape = offset + r0 * row_bytes, (r1 - r0) * row_bytes, (r1 - r0, *shape[1:])
    buf = torch.empty(nbytes, dtype=torch.uint8) if out is None else out[:nbytes]
    if nbytes:
        _pread_into(fd, memoryview(buf.numpy()), offset, label)
    return buf.view(dtype).reshape(shape)


def _write_all(fd: int, data, offset: int) -> None:
    mv = memoryview(data).cast("B")
    while len(mv):
        k = os.pwrite(fd, mv, offset)
        mv = mv[k:]
        offset += k


def _copy_range(src_fd: int, dst_fd: int, src_offset: int, dst_offset: int, n: int, label: str) -> None:
    """Copy n bytes from ``src_offset`` of src to ``dst_offset`` of dst, in the kernel when it can."""
    use_cfr = hasattr(os, "copy_file_range")
    while n > 0:
        k = -1
        if use_cfr:
            try:
                k = os.copy_file_range(src_fd, dst_fd, n, src_offset, dst_offset)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF,
                                     errno.EPERM):
                    raise
                use_cfr = False
                k = -1
        if k < 0:
            chunk = os.pread(src_fd, min(n, 64 << 20), src_offset)
            k = len(chunk)
            _write_all(dst_fd, chunk, dst_offset)
        if k == 0:
            raise CheckpointError(f"{label} is truncated (unexpected end of file)")
        src_offset += k
        dst_offset += k
        n -= k


class SafetensorsWriter:
    """Write a safetensors file whose header is known up front. Each tensor's bytes are appended to its own
    region (positional writes), so different tensors may be written in any order and from different threads."""

    def __init__(self, path: Path, entries: Iterable[tuple[str, str, tuple[int, ...], int]],
                 metadata: dict[str, str] | None = None) -> None:
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        off = 0
        spans: dict[str, tuple[int, int]] = {}
        for key, code, shape, nbytes in entries:
            header[key] = {"dtype": code, "shape": list(shape), "data_offsets": [off, off + nbytes]}
            spans[key] = (off, nbytes)
            off += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        blob += b" " * ((-len(blob)) % 8)
        self.path = Path(path)
        self.total = off
        start = 8 + len(blob)
        self._span = {k: (start + o, n) for k, (o, n) in spans.items()}  # key → (absolute offset, bytes)
        self._done = dict.fromkeys(spans, 0)  # key → bytes written so far (each key has one writer)
        fsops.at("write", self.path)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        _write_all(self.fd, len(blob).to_bytes(8, "little") + blob, 0)

    def _claim(self, key: str, nbytes: int) -> int:
        at, size = self._span[key]
        done = self._done[key]
        if done + nbytes > size:
            raise RuntimeError(f"internal error: {done + nbytes} bytes for {key!r}, which holds {size}")
        self._done[key] = done + nbytes
        return at + done

    def append(self, key: str, t: torch.Tensor) -> int:
        """Append ``t``'s bytes to tensor ``key``; returns how many."""
        t = t.detach().contiguous().reshape(-1)
        n = t.numel() * t.element_size()
        if n:
            fsops.at("write", self.path)
            _write_all(self.fd, t.view(torch.uint8).numpy(), self._claim(key, n))
        return n

    def copy_into(self, key: str, src_fd: int, offset: int, nbytes: int, label: str) -> None:
        """Append ``nbytes`` of src (from ``offset``) to tensor ``key``, file to file."""
        fsops.at("copy", self.path)
        _copy_range(src_fd, self.fd, offset, self._claim(key, nbytes), nbytes, label)

    def close(self, sync: bool = True) -> None:
        """Check that every tensor is complete, make the file durable (fsync; the caller's job with
        ``sync=False``) and close it."""
        try:
            short = [k for k, n in self._done.items() if n != self._span[k][1]]
            if short:
                raise RuntimeError(f"internal error: {short[0]!r} incomplete in {self.path}")
            if sync:
                fsops.fsync_fd(self.fd, self.path)
        finally:
            os.close(self.fd)

    def abort(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
