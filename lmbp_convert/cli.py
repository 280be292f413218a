"""``lmbp-convert SRC DST``: fold norm affines into the following Linears of a saved checkpoint, on disk.

The result loads with plain transformers / timm (no lmbp_convert needed) and gives the same outputs; ``convert()``
on a model loaded from it then swaps the norms for memory-sharing ones without folding again.
"""
from __future__ import annotations

import argparse
import atexit
import errno
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Sequence

EPILOG = """\
SRC is a Hugging Face model directory (config.json plus model.safetensors, sharded safetensors with
model.safetensors.index.json, or pytorch_model*.bin, which is only read with torch.load(weights_only=True));
DST is a new directory with the same shards (always safetensors), config.json recording the conversion under
"lmbp_convert", and SRC's other top-level files (tokenizer, generation config, README...).
With --timm-model NAME, SRC is a timm checkpoint file (.safetensors, or .pth/.bin holding a state dict) and DST is
a .safetensors file: load it with timm.create_model(NAME, checkpoint_path=DST).

Folds that a plain checkpoint cannot express (the affine would have to be re-applied on another branch at run
time, e.g. post-LN encoders; a Linear without a bias to take the norm's shift; a tied head without --untie) are
skipped with their reason; convert() still handles them at load time. A norm whose scale or shift holds NaN or inf,
or whose fold would overflow the weight's dtype, stops the run (exit 1, nothing written; --exclude it to go on);
non-finite values that SRC's Linear weights already hold are kept as they are.

DST is written into a hidden sibling (.DST.lmbp-tmp-*), fsync'ed, and renamed into place only when complete. An
existing DST is never replaced without --force, also one that appears while the conversion runs (of two runs to
one new DST, one wins and the other exits 1). --force renames the old DST aside (.DST.lmbp-old-*), puts the new one
in place, then deletes the old one. If a run was killed midway, the next run on the same DST says so in one line,
restores the old DST if DST is missing, and removes stale temporary outputs (never those of a run still alive).

--include / --exclude are checked as convert() checks them: an --include that matches no module is an error that
names it (exit 1), an --exclude (or one of several --include) that matches none is a warning; an invalid regular
expression is a usage error.

Exit status: 0 done, 1 bad input or failed write (nothing written), 2 usage error, 130 interrupted, 141 stdout
closed (e.g. `--dry-run | head -1`: the run stops quietly, as `cp` and `head` do, and no DST is half-written).
"""

#: 128 + SIGPIPE: what a shell reports for a command that wrote into a pipe whose reader had gone
EXIT_STDOUT_CLOSED = 141


class _Terminated(BaseException):
    """SIGTERM, turned into an exception so that the temporary DST is removed on the way out."""


class _StdoutClosed(BaseException):
    """stdout's reader has gone (a closed pipe). A BaseException, as SIGPIPE would be: nothing catches it on the way
    out, so the temporary DST is removed and nothing more is written."""


def _say(text: str) -> None:
    """Print to stdout; a closed pipe ends the run (`_StdoutClosed`)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        raise _StdoutClosed() from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmbp-convert", description="Fold norm affines into the following Linear layers of a checkpoint.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="Hugging Face model directory, or a timm checkpoint file")
    p.add_argument("dst", metavar="DST", help="output directory (or .safetensors file with --timm-model)")
    p.add_argument("--timm-model", metavar="NAME", help="SRC is a checkpoint of this timm model")
    p.add_argument("--timm-arg", metavar="KEY=VALUE", action="append", default=[],
                   help="keyword for timm.create_model (VALUE parsed as JSON when it can be), e.g. num_classes=10")
    p.add_argument("--use-ema", action="store_true", help="timm: convert the EMA weights of a training checkpoint")
    p.add_argument("--untie", action="store_true",
                   help="fold into a head tied to the embeddings by writing it as its own tensor "
                        "(sets tie_word_embeddings=false)")
    p.add_argument("--include", metavar="REGEX", action="append", help="only these modules (full match)")
    p.add_argument("--exclude", metavar="REGEX", action="append", help="not these modules (full match)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    p.add_argument("--force", action="store_true", help="replace an existing DST (only once the new one is complete)")
    p.add_argument("--allow-empty", action="store_true", help="write DST even when no norm can be folded")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of text")
    p.add_argument("-q", "--quiet", action="store_true", help="print errors only")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it only shows on a terminal)")
    p.add_argument("--debug", action="store_true", help="show a traceback for unexpected errors")
    return p


def _timm_kwargs(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--timm-arg takes KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(val)
        except json.JSONDecodeError:
            out[key] = val
    return out


def _start_prefetch(src: Path) -> None:
    """Start reading SRC's weights into the page cache on a background thread (up to half the free
    memory), so that a checkpoint not yet in memory is read while torch and transformers are imported."""
    import threading

    from .checkpoint import fsops

    if src.is_dir():
        files = sorted(p for p in src.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    else:
        files = [src]
    budget = fsops.available_memory() // 2
    if files and budget:
        threading.Thread(target=fsops.prefetch, args=(files, budget), name="lmbp-prefetch", daemon=True).start()


def _stderr(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:  # a closed stderr: nothing can be said, and the outcome does not change for it
        pass


def _err(msg: str) -> None:
    _stderr(f"lmbp-convert: error: {msg}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        timm_kwargs = _timm_kwargs(args.timm_arg)
    except ValueError as exc:
        parser.error(str(exc))
    if (args.timm_arg or args.use_ema) and not args.timm_model:
        parser.error("--timm-arg and --use-ema need --timm-model")
    from .options import compile_patterns  # (torch-free)

    for attr in ("include", "exclude"):
        try:
            compile_patterns(attr, getattr(args, attr) or [])
        except ValueError as exc:
            parser.error(str(exc))
    try:
        return _main(args, timm_kwargs)
    except _StdoutClosed:
        return EXIT_STDOUT_CLOSED


def _main(args: argparse.Namespace, timm_kwargs: dict[str, Any]) -> int:

    def on_term(signum, frame):
        raise _Terminated()

    try:
        old_term = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        old_term = None
    t0 = time.perf_counter()
    try:
        from .checkpoint.commit import preflight
        from .checkpoint.errors import CheckpointError

        planned = []

        def show(plan) -> None:
            planned.append(plan)
            if args.json:
                _say(json.dumps(plan.to_dict(), indent=2))
            elif not args.quiet:
                _say(plan.describe())

        def note(line: str) -> None:  # shown even with -q: it says what was done to files beside DST
            _stderr(f"lmbp-convert: note: {line}")

        def warn(line: str) -> None:
            if not args.quiet:
                _stderr(f"lmbp-convert: warning: {line}")

        try:
            src, dst = Path(args.src), Path(args.dst)
            # fail fast, before the heavy imports (torch, transformers); convert_checkpoint checks again
            preflight("timm" if args.timm_model else "hf", src, dst, args.force, args.dry_run, note)
            if not args.dry_run:
                _start_prefetch(src)
            t_import = time.perf_counter()
            from .checkpoint.api import convert_checkpoint  # torch and the planner

            t_import = time.perf_counter() - t_import

            plan = convert_checkpoint(
                args.src, args.dst, timm_model=args.timm_model, timm_kwargs=timm_kwargs, use_ema=args.use_ema,
                untie=args.untie, include=args.include, exclude=args.exclude, force=args.force,
                dry_run=args.dry_run, allow_empty=args.allow_empty,
                progress=not (args.no_progress or args.quiet) and sys.stderr.isatty(), on_plan=show,
                on_note=None, on_warning=warn)  # (preflight above told the notes)
        except CheckpointError as exc:
            _err(str(exc))
            return 1
        except (KeyboardInterrupt, _Terminated) as exc:
            what = "interrupted" if isinstance(exc, KeyboardInterrupt) else "terminated"
            done = bool(planned) and planned[0].committed  # the signal came as DST was put in place
            _err(f"{what} after {args.dst} was complete" if done else f"{what}; SRC untouched, no DST written")
            return 130 if isinstance(exc, KeyboardInterrupt) else 143
        except OSError as exc:
            done = bool(planned) and planned[0].committed  # DST in place; its fsync or the cleanup failed
            outcome = (f"{args.dst} is complete and in place, but the step after failed (syncing it to disk or "
                       "removing the old copy, which the next run removes)" if done else "no DST written")
            if exc.errno == errno.ENOSPC:
                _err(f"no space left on device while writing {args.dst}; {outcome}")
            else:
                where = f" ({exc.filename})" if exc.filename else ""
                _err(f"I/O error while converting to {args.dst}: {exc.strerror or exc}{where}; {outcome}")
            return 1
        except MemoryError:
            done = bool(planned) and planned[0].committed
            _err(f"out of memory while converting to {args.dst}; "
                 + (f"{args.dst} is complete and in place" if done else "no DST written"))
            return 1
        except Exception as exc:  # a bug, not a bad input: still one line unless asked
            if args.debug:
                raise
            _err(f"internal error: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                 " (run with --debug for a traceback)")
            return 1
        if args.dry_run:
            if not args.quiet and not args.json:
                _say("dry run: nothing written")
            return 0
        if not args.quiet and not args.json:
            from .report import fmt_bytes

            rate = fmt_bytes(plan.total_bytes / max(plan.seconds_write, 1e-9))
            _say(f"wrote {args.dst}: {len(plan.folds)} norm(s) folded, {len(plan.shards)} shard(s), "
                 f"{fmt_bytes(plan.total_bytes)} in {time.perf_counter() - t0:.1f} s (torch import {t_import:.2f} s, "
                 f"plan {plan.seconds_plan:.2f} s, "
                 f"write {plan.seconds_write:.2f} s, {rate}/s)")
            if plan.plan_phases:
                _say("plan: " + ", ".join(f"{k} {v:.2f} s" for k, v in plan.plan_phases.items()))
        return 0
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def run() -> None:
    """The ``lmbp-convert`` command (and ``python -m lmbp_convert``): ``main()``, then exit without the
    interpreter's teardown. Freeing the modules of torch and transformers one by one takes longer than the whole
    plan (1.3 s of a 5 s run measured on a 2-core VM); by then DST is complete and fsync'ed and every file is
    closed, so the process only flushes its output and runs the exit handlers (a coverage tool's, logging's)
    before it ends. An exception not handled by ``main()`` (``--debug``) takes the normal way out, traceback
    included. A closed stdout ends the process by SIGPIPE, as it ends ``cp`` or ``head`` (a shell reports 141)."""
    try:
        code = main()
    except SystemExit as exc:  # argparse: --help, usage errors
        code = exc.code
    if code is None:
        code = 0
    elif not isinstance(code, int):  # SystemExit("message"): printed to stderr, exit status 1, as Python does
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    if code == EXIT_STDOUT_CLOSED and hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # (Python ignores it, to raise BrokenPipeError instead)
        os.kill(os.getpid(), signal.SIGPIPE)
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    run()
