"""Plan and write a folded checkpoint: the library side of ``lmbp-convert``.

Nothing is ever written into SRC. DST is assembled in a hidden temporary directory beside it and renamed into
place only when complete, so an error, Ctrl-C or a full disk leaves no partial DST.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
import warnings
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..apply.convert import CONFIG_KEY, plan_conversion
from ..errors import NothingToConvertError
from ..fold import Scratch, effective_scale, fold_affine, fold_rows, identity_weight_value
from ..match.doors import fold_past_doors
from ..options import ConvertOptions
from ..reasons import cli_spelling
from . import fsops
from .commit import check_paths, commit, make_workspace, preflight  # noqa: F401  (check_paths: public here)
from .diskplan import Action, DiskPlan, OutShard, plan_disk, record_json
from .errors import CheckpointError
from .models import build_hf, build_timm, import_model_code, quiet_loggers, read_config_json
from .safetensors_io import DTYPES, SafetensorsWriter
from .sources import Source, SafetensorsSource, bin_to_safetensors_name, open_hf_source, open_timm_source

#: elements per chunk when folding a weight (4 MiB of fp32 scratch): keeps memory flat; measured on a 3 GiB
#: LLaMA checkpoint, 256Ki-1Mi elements stream fastest, 4Mi about 2x slower
CHUNK_ELEMS = 1 << 20
_COPY_PIECE = 256 << 20  # bytes per kernel copy call: how soon the copying thread notices a stop request
_WEIGHT_FILE = re.compile(
    r".*\.(safetensors|gguf|onnx|h5|msgpack|ckpt|pth|pt|tflite|ot)$|.*\.(safetensors|bin)\.index\.json$"
    r"|^(pytorch_model|consolidated).*\.bin$")


@dataclass
class Prepared:
    """A planned conversion: the opened source and the disk plan."""

    kind: str  # "hf" | "timm"
    src_path: Path
    source: Source
    plan: DiskPlan

    def close(self) -> None:
        self.source.close()


def _dominant_float_dtype(source: Source) -> torch.dtype | None:
    by = defaultdict(int)
    for i in source.infos.values():
        if i.is_float:
            by[i.dtype] += i.nbytes
    return DTYPES[max(by, key=by.get)][0] if by else None


def _other_files(root: Path) -> tuple[list[str], list[tuple[str, str]]]:
    """Top-level files of an HF directory to copy (tokenizer, generation config, README...) and what is left."""
    copies, skipped = [], []
    for p in sorted(root.iterdir(), key=lambda p: p.name):
        if p.name == "config.json":
            continue
        if p.is_dir():
            skipped.append((p.name + "/", "directory"))
        elif _WEIGHT_FILE.match(p.name):
            skipped.append((p.name, "weights in another format, not converted"))
        elif p.is_file():
            copies.append(p.name)
        else:  # a FIFO, socket, device or dangling link: never read (a FIFO would block), but said
            skipped.append((p.name, "not a regular file"))
    return copies, skipped


def _warn(msg: str) -> None:
    warnings.warn(msg, UserWarning, stacklevel=4)


def prepare(src: str | os.PathLike, *, timm_model: str | None = None, timm_kwargs: dict[str, Any] | None = None,
            use_ema: bool = False, untie: bool = False, include: list[str] | None = None,
            exclude: list[str] | None = None, dst_name: str | None = None,
            on_warning: Callable[[str], None] | None = None) -> Prepared:
    """Read SRC's config and headers (no tensor data), plan on the meta device, decide the on-disk folds.
    include / exclude patterns that match no module are checked as ``convert()`` checks them (an error, or a line
    to ``on_warning``; default: a UserWarning)."""
    t0 = time.perf_counter()
    src_path = Path(src)
    if not src_path.exists():
        raise CheckpointError(f"SRC {src_path} does not exist")
    try:
        # only norm folds rewrite stored weights; the loss is an attribute convert() sets on the loaded model
        opts = ConvertOptions(activations=False, gated_mlp=False, loss=False, fold_norms=True, lora_inputs=False,
                              untie=untie, include=include, exclude=exclude, verify=False, measure=False,
                              progress=False)  # (a meta model has nothing to measure; the CLI has its own bar)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc
    raw: dict | None = None
    if timm_model:
        if src_path.is_dir():
            raise CheckpointError("with --timm-model, SRC is a timm checkpoint file, not a directory")
        source = open_timm_source(src_path, use_ema)
        out = dst_name or (src_path.stem + ".safetensors")
        out_name: Callable[[str], str] = lambda s: out  # noqa: E731
    else:
        if not src_path.is_dir():
            raise CheckpointError(f"SRC {src_path} is a file: a Hugging Face checkpoint is a directory; for a timm "
                                  "checkpoint pass --timm-model NAME")
        raw = read_config_json(src_path)
        source = open_hf_source(src_path)
        out_name = (lambda s: s) if isinstance(source, SafetensorsSource) else bin_to_safetensors_name
    try:
        dtype = _dominant_float_dtype(source)  # plan in the checkpoint's dtype: per-token figures match it
        phases = {"disk": time.perf_counter() - t0}
        t = time.perf_counter()
        import_model_code(timm_model, raw, src_path)
        phases["imports"] = time.perf_counter() - t
        t = time.perf_counter()
        make_view = None if timm_model else (lambda r: build_hf(r, src_path, dtype))
        view = build_timm(timm_model, dict(timm_kwargs or {}), dtype) if timm_model else make_view(raw)
        phases["model"] = time.perf_counter() - t
        names = [n for n, _ in view.model.named_modules(remove_duplicate=False) if n]
        try:
            opts.check_patterns(names, view.arch, on_warning or _warn)
        except NothingToConvertError as exc:
            raise CheckpointError(str(exc)) from exc
        t = time.perf_counter()
        try:
            # reasons name --untie, not untie=True; every fold it can is made on disk (doors: match/doors.py)
            with quiet_loggers(), cli_spelling(), fold_past_doors():
                plan = plan_conversion(view.model, opts)
        except Exception as exc:
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(f"cannot trace {view.arch} on the meta device: {msg}") from exc
        summary = opts.summary()
        options = {k: summary[k] for k in ("untie", "include", "exclude")}
        phases["trace"] = time.perf_counter() - t
        t = time.perf_counter()
        dp = plan_disk(source, view, plan, untie=untie, raw_config=raw, make_view=make_view, out_name=out_name,
                       options=options)
        phases["disk"] += time.perf_counter() - t
        dp.plan_phases = phases
        if not timm_model:
            used = {*source.shards, source.index_name}
            dp.copies, left = _other_files(src_path)
            why_not = {n: f"a weights file that {source.index_name} does not name, not converted"
                       for n in source.unindexed}
            dp.not_copied = [f"{n} ({why_not.get(n, why)})" for n, why in left if n not in used]
        return Prepared("timm" if timm_model else "hf", src_path, source, dp)
    except BaseException:
        source.close()
        raise


# -- writing ----------------------------------------------------------------------------------------------------
def _finite_affine(t: torch.Tensor, a: Action, key: str) -> torch.Tensor:
    """A norm's scale or shift must be finite to be folded: a NaN or inf there would be spread over whole rows or
    columns of the following Linears (the source model's outputs are then non-finite anyway: a damaged
    checkpoint, which the fold must not pass on as converted)."""
    bad = int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0
    if bad:
        raise CheckpointError(f"{key} holds {bad} non-finite value(s) (NaN or inf): the checkpoint is damaged, and "
                              f"folding norm {a.norm} would spread them into the following Linear layers; nothing "
                              f"written (leave this norm unfolded with --exclude '{re.escape(a.norm)}')")
    return t


def _no_new_nonfinite(out: torch.Tensor, was_finite: torch.Tensor, a: Action, key: str) -> None:
    """A fold may keep a non-finite value of the source weight, never make one from finite values (W·γ past the
    largest value of the weight's dtype)."""
    new = int((~torch.isfinite(out) & was_finite).sum())
    if new:
        raise CheckpointError(f"folding norm {a.norm} into {key} overflows {str(out.dtype).replace('torch.', '')}: "
                              f"{new} value(s) would become inf or NaN; nothing written (leave this norm unfolded "
                              f"with --exclude '{re.escape(a.norm)}')")


class _Done:
    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value

    def cancel(self) -> bool:
        return False


class _Folder:
    """Computes the changed tensors. Weights are folded a chunk of rows at a time; with a worker thread, the next
    chunk is read and folded while the previous one is written."""

    def __init__(self, source: Source, pool: Any = None) -> None:
        self.source = source
        self.pool = pool
        self._gamma: dict[tuple[str, str], torch.Tensor] = {}
        self._scratch = [Scratch(), Scratch()]  # chunk i uses set i % 2: at most one folding, one writing

    def gamma(self, a: Action) -> torch.Tensor:
        k = (a.gamma, a.param)
        if k not in self._gamma:
            self._gamma[k] = _finite_affine(effective_scale(self.source.tensor(a.gamma), a.param), a, a.gamma)
        return self._gamma[k]

    def _may_overflow(self, a: Action) -> bool:
        """Whether W·γ can leave the weight's range: not when every |γ| <= 1 (γ is finite, checked above)."""
        g = self.gamma(a)
        return bool(g.numel()) and bool(g.abs().max() > 1)

    def write(self, w: SafetensorsWriter, out_key: str, key: str, a: Action, on_bytes: Callable[[int], None]) -> None:
        """Write DST tensor ``out_key``, made from source tensor ``key`` by ``a``."""
        info = self.source.infos[key]
        dtype = DTYPES[info.dtype][0]
        if a.kind in ("identity", "zero"):
            value = identity_weight_value(a.param) if a.kind == "identity" else 0.0
            on_bytes(w.append(out_key, torch.full(info.shape, value, dtype=dtype)))
        elif a.kind == "fold_w":
            self._fold_weight(w, out_key, key, a, on_bytes)
        elif a.kind == "fold_b":  # b' = b + W·β, over the whole W: bit-identical to convert()'s fold (a
            # matrix-vector product split into row blocks may round differently), at the cost of one fp32 W
            weight = self.source.tensor(a.weight)
            bias = self.source.tensor(key)
            beta = _finite_affine(self.source.tensor(a.beta), a, a.beta)
            new_b = fold_affine(weight, bias, self.gamma(a), beta, a.layout)[1].to(dtype)
            rows_ok = torch.isfinite(weight).all(dim=1 if a.layout == "out_in" else 0)
            _no_new_nonfinite(new_b, torch.isfinite(bias) & rows_ok, a, key)
            del weight
            on_bytes(w.append(out_key, new_b))
        else:  # pragma: no cover - plan_disk only makes the kinds above
            raise RuntimeError(f"internal error: unknown action {a.kind!r}")

    def _fold_weight(self, w: SafetensorsWriter, out_key: str, key: str, a: Action,
                     on_bytes: Callable[[int], None]) -> None:
        info = self.source.infos[key]
        g = self.gamma(a)
        rows = info.shape[0]
        row_bytes = info.nbytes // rows if rows else 0
        per_row = max(1, row_bytes // DTYPES[info.dtype][1])
        step = max(1, CHUNK_ELEMS // per_row)
        owns = self.source.owns_rows
        check = self._may_overflow(a)
        limit = torch.finfo(DTYPES[info.dtype][0]).max

        def job(i: int, r0: int, r1: int) -> torch.Tensor:
            scratch = self._scratch[i % 2]
            raw = scratch.get("raw", (r1 - r0) * row_bytes, torch.uint8) if owns else None
            x = self.source.rows(key, r0, r1, out=raw)
            out = fold_rows(x, g, a.layout, r0, scratch, in_place=owns)
            if check and out.numel():  # a cheap bound first (NaN fails it too), the exact test only past it
                lo, hi = torch.aminmax(out if out.dtype in (torch.float32, torch.float64) else
                                       scratch.accumulator(out.shape))
                if not (-limit <= float(lo) and float(hi) <= limit):
                    _no_new_nonfinite(out, torch.isfinite(self.source.rows(key, r0, r1)), a, key)
            return out

        pending: deque = deque()
        try:
            for i, r0 in enumerate(range(0, rows, step)):
                r1 = min(rows, r0 + step)
                pending.append(self.pool.submit(job, i, r0, r1) if self.pool is not None else _Done(job(i, r0, r1)))
                if len(pending) == 2:
                    on_bytes(w.append(out_key, pending.popleft().result()))
            while pending:
                on_bytes(w.append(out_key, pending.popleft().result()))
        except BaseException:
            for f in pending:
                f.cancel()
            raise


def _write_shard(prep: Prepared, shard: OutShard, path: Path, folder: _Folder, on_bytes: Callable[[int], None],
                 copier: ThreadPoolExecutor | None) -> None:
    """Write one DST shard. Unchanged tensors go file to file in the kernel — on the ``copier`` thread when
    there is one, meanwhile this thread writes the folded ones (every tensor has its own region of the file)."""
    src, dp = prep.source, prep.plan
    meta = dict(src.shard_metadata.get(shard.source, {}))
    meta.setdefault("format", "pt")
    meta[CONFIG_KEY] = record_json(dp.record)
    entries = []
    for t in shard.tensors:
        info = src.infos[t.source]
        entries.append((t.key, info.dtype, info.shape, info.nbytes))
    w = SafetensorsWriter(path, entries, meta)
    raw_copy = isinstance(src, SafetensorsSource)
    copies = [t for t in shard.tensors if t.action is None and raw_copy]
    stop = threading.Event()

    def copy_all() -> None:
        for t in copies:
            info = src.infos[t.source]
            for off in range(0, info.nbytes, _COPY_PIECE):  # pieces: a stop request is seen within one
                if stop.is_set():
                    return
                n = min(_COPY_PIECE, info.nbytes - off)
                w.copy_into(t.key, src.fd(info.shard), info.start + off, n, info.shard)
                on_bytes(n)

    copying = copier.submit(copy_all) if copier is not None and copies else None
    try:
        if copying is None:
            copy_all()
        for t in shard.tensors:
            if t.action is not None:
                folder.write(w, t.key, t.source, t.action, on_bytes)
            elif not raw_copy:
                on_bytes(w.append(t.key, src.tensor(t.source)))
        if copying is not None:
            copying.result()
    except BaseException:
        stop.set()
        if copying is not None:
            try:
                copying.result()
            except BaseException:
                pass
        w.abort()
        raise
    w.close(sync=False)  # write_into fsyncs it while the next shard is written


def write_into(prep: Prepared, out_dir: Path, progress: bool = False) -> None:
    """Write every DST file of ``prep`` into the (empty, temporary) directory ``out_dir``."""
    dp = prep.plan
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=dp.total_bytes, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True,
                   desc="lmbp-convert", leave=False)
    lock = threading.Lock()

    def on_bytes(n: int) -> None:  # called from the writing and the copying thread
        if bar is not None:
            with lock:
                bar.update(n)

    # torch ops on one thread: the folds are small memory-bound chunks between I/O calls, where waking an OpenMP
    # pool for each op costs more than it saves (~10x slower with 2 threads on a 2-core VM). Instead, with more
    # than one core, a worker folds the next chunk while this thread writes the last one, and another copies the
    # unchanged tensors in the kernel meanwhile (torch ops and file I/O release the GIL).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pool = copier = None
    if (os.cpu_count() or 1) > 1:  # (the OpenMP thread count is per thread: set it in the worker too)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmbp-fold", initializer=torch.set_num_threads,
                                  initargs=(1,))
        copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmbp-copy")
    folder = _Folder(prep.source, pool)
    syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmbp-fsync")  # a shard is flushed to disk
    synced = []  # while the next one is written: the fsync waits on the device, not on this process
    try:
        for shard in dp.shards:
            if bar is not None:
                bar.set_postfix_str(shard.name, refresh=False)
            _write_shard(prep, shard, out_dir / shard.name, folder, on_bytes, copier)
            synced.append(syncer.submit(fsops.fsync_file, out_dir / shard.name))
        for f in synced:
            f.result()
        if dp.index is not None:
            fsops.write_file(out_dir / dp.index_name, (json.dumps(dp.index, indent=2, sort_keys=True) + "\n").encode())
        if dp.config is not None:
            fsops.write_file(out_dir / "config.json", (json.dumps(dp.config, indent=2) + "\n").encode())
        for name in dp.copies:
            fsops.copy_file(prep.src_path / name, out_dir / name)
    finally:
        for p in (pool, copier, syncer):
            if p is not None:
                p.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(threads)
        if bar is not None:
            bar.close()


@contextlib.contextmanager
def _signals_deferred():
    """Hold SIGINT/SIGTERM while DST is swapped into place, so that an interrupt cannot fall between the renames;
    one that arrives meanwhile is re-raised right after, to the handler that was in place. (Swapping the Python
    handlers, not the thread's signal mask: a process-directed signal may land on any other thread.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    sigs = [signal.SIGINT, signal.SIGTERM]
    old = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        if held:
            signal.raise_signal(held[0])


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, timm_model: str | None = None,
                       timm_kwargs: dict[str, Any] | None = None, use_ema: bool = False, untie: bool = False,
                       include: list[str] | None = None, exclude: list[str] | None = None, force: bool = False,
                       dry_run: bool = False, allow_empty: bool = False, progress: bool = False,
                       on_plan: Callable[[DiskPlan], None] | None = None,
                       on_note: Callable[[str], None] | None = None,
                       on_warning: Callable[[str], None] | None = None) -> DiskPlan:
    """Fold norm affines into the following Linears of checkpoint SRC and write the result to DST.

    SRC: a Hugging Face model directory, or (with ``timm_model``) a timm checkpoint file; DST: a directory, or a
    ``.safetensors`` file for timm. Raises CheckpointError (one-line message) for bad inputs; SRC is never
    modified and DST only appears when complete; an existing DST is only replaced with ``force`` (also one that
    appears while converting). Leftovers of an interrupted earlier run on DST are mended first and told to
    ``on_note`` in one line; include / exclude patterns that match no module are an error or a line to
    ``on_warning``, as in ``convert()``. With ``dry_run`` only the plan is made. Returns the plan.
    """
    src_p, dst_p = Path(src), Path(dst)
    kind = "timm" if timm_model else "hf"
    if src_p.exists():
        preflight(kind, src_p, dst_p, force, dry_run, on_note)
    t0 = time.perf_counter()
    prep = prepare(src_p, timm_model=timm_model, timm_kwargs=timm_kwargs, use_ema=use_ema, untie=untie,
                   include=include, exclude=exclude, dst_name=dst_p.name, on_warning=on_warning)
    prep.plan.seconds_plan = time.perf_counter() - t0
    try:
        if on_plan is not None:
            on_plan(prep.plan)
        if not prep.plan.folds and not allow_empty and not dry_run:
            raise CheckpointError(f"nothing to fold in {prep.plan.view.arch} (see the plan above); "
                                  "DST not written")
        if dry_run:
            return prep.plan
        t0 = time.perf_counter()
        ws = make_workspace(dst_p)
        try:
            write_into(prep, ws.tmp, progress)
            with _signals_deferred():
                try:
                    commit(ws, kind, force)
                finally:
                    prep.plan.committed = ws.committed
        except BaseException:
            if os.path.lexists(ws.tmp):  # (once committed, only a timm run's emptied directory is left)
                fsops.remove_tree(ws.tmp)
            raise
        finally:
            ws.release()
        prep.plan.seconds_write = time.perf_counter() - t0
        return prep.plan
    finally:
        prep.close()


def read_record(path: str | os.PathLike) -> dict | None:
    """The conversion record of a DST: from config.json (HF directory) or the safetensors metadata (file)."""
    p = Path(path)
    if p.is_dir():
        cfg = p / "config.json"
        rec = json.loads(cfg.read_text()).get(CONFIG_KEY) if cfg.is_file() else None
        return rec if isinstance(rec, dict) else None
    from .safetensors_io import SafetensorsFile

    meta = SafetensorsFile(p).metadata.get(CONFIG_KEY)
    return json.loads(meta) if meta else None


def mark_prefolded(model: torch.nn.Module, record: dict) -> torch.nn.Module:
    """Tell ``convert()`` which norms of ``model`` are folded on disk (HF models loaded from DST already know it
    from their config; a timm model gets a small ``config`` namespace holding the record)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        from types import SimpleNamespace

        cfg = SimpleNamespace()
        model.config = cfg
    setattr(cfg, CONFIG_KEY, dict(record))
    return model
