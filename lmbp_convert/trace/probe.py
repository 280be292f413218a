"""Build a small input the model accepts, from its forward signature, its config (HF) or pretrained_cfg and module
tree (timm).

Every input the signature names and the config can size is built (text ids, pixels, raw audio, audio features,
decoder ids), with the alternatives the config leaves open (2-D or multiple-choice 3-D ids, ids closing with
eos, channel-first or channel-last features, a short clip or the fixed window an encoder requires, a batch of one);
the first combination the model runs on, in eval mode and without grad, is the probe. `find_probe` runs the
caller's own work (the trace) as that check, so choosing the probe costs no extra forward. When none can be built or none runs, ProbeError names the
arguments to pass, with an example.
"""
from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, TypeVar

import torch
from torch import nn

from ..errors import ProbeError
from . import probe_inputs as pi
from .tracer import OUT_OF_MEMORY, call_model

T = TypeVar("T")


@dataclass(frozen=True)
class Candidate:
    """One possible probe: the input (a dict of keyword args, or one tensor for the first positional argument)
    and how many tokens/images/frames it holds (for per-unit figures)."""

    inputs: Any
    count: int
    unit: str


# (tensor, count, unit) alternatives for one argument, most likely first
Alternatives = list[tuple[torch.Tensor, int, str]]


def _device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    for p in model.parameters():
        if p.is_floating_point():
            return p.device, p.dtype
    for b in model.buffers():
        return b.device, torch.float32
    return torch.device("cpu"), torch.float32


def _signature(model: nn.Module) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return []


def _takes(params: list[inspect.Parameter], name: str, *, explicitly: bool = False) -> bool:
    return any(p.name == name for p in params) or (
        not explicitly and any(p.kind is p.VAR_KEYWORD for p in params))


def _required(params: list[inspect.Parameter]) -> list[str]:
    return [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                                        p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


# -- Hugging Face models: one builder per input name -------------------------------------------------------------
# Each takes (model, config, batch, seq, seed) and returns the alternatives for that argument (none: cannot size it).


def _text(model: nn.Module, cfg: Any, batch: int, seq: int, seed: int) -> Alternatives:
    vocab = pi.text_vocab(cfg)
    if not vocab:
        return []
    n = pi.text_length(cfg, seq)
    eos = pi.sub_first(cfg, pi.TEXT_SIDE, "eos_token_id")
    eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    alts = []
    # multiple-choice heads take (batch, choices, seq): tried when the model refuses (batch, seq); heads that pool
    # at the end-of-sequence token (BART's classifier) need one per row: tried next
    for shape in ((batch, n), (batch, 2, n)):
        ids = pi.token_ids(vocab, shape, seed)
        alts.append((ids, ids.numel(), "token"))
        if isinstance(eos, int) and 0 <= eos < vocab:
            alts.append((pi.ends_with(ids, eos, vocab), ids.numel(), "token"))
    return alts


def _decoder_text(model: nn.Module, cfg: Any, batch: int, seq: int, seed: int) -> Alternatives:
    vocab = pi.decoder_vocab(cfg)
    if not vocab:
        return []
    n = pi.decoder_length(cfg, seq)
    return [(pi.token_ids(vocab, (batch, n), seed + 1, start=pi.decoder_start(cfg)), 0, "token")]


def _pixels(model: nn.Module, cfg: Any, batch: int, seq: int, seed: int) -> Alternatives:
    image = pi.hf_image(cfg)
    return [(pi.pixels(batch, image[0], image[1], seed), batch, "image")] if image else []


def _raw_audio(model: nn.Module, cfg: Any, batch: int, seq: int, seed: int) -> Alternatives:
    frames = pi.audio_frames(cfg, seq)
    length = pi.input_length(pi.input_convs(model), frames)
    return [(pi.raw_audio(batch, length, seed), batch * frames, "frame")]


def _audio_features(model: nn.Module, cfg: Any, batch: int, seq: int, seed: int) -> Alternatives:
    return [(pi.features(batch, bins, n, first, seed), batch * n, "frame")
            for bins in pi.feature_bins(cfg, model) for n in pi.feature_lengths(cfg, model, seq)
            for first in (True, False)]


_BUILDERS = {"input_ids": _text, "pixel_values": _pixels, "input_values": _raw_audio,
             "input_features": _audio_features, "decoder_input_ids": _decoder_text}


def _hf_inputs(model: nn.Module, cfg: Any, name: str, batch: int, seq: int, seed: int) -> Alternatives:
    build = _BUILDERS.get(name)
    return build(model, cfg, batch, seq, seed) if build is not None else []


_EXTRA_INPUTS = ("input_ids", "pixel_values", "input_values", "input_features")  # dual encoders: text + pixels


def _hf_candidates(model: nn.Module, params: list[inspect.Parameter], main: str, batch: int, seq: int,
                   seed: int, meta: bool) -> Iterator[Candidate]:
    cfg = model.config
    mains = _hf_inputs(model, cfg, main, batch, seq, seed)
    if not mains:
        return
    extras = {n: alts for n in _EXTRA_INPUTS if n != main and _takes(params, n, explicitly=True)
              for alts in [_hf_inputs(model, cfg, n, batch, seq, seed)] if alts}
    # encoder-decoders that do not shift the encoder input into decoder inputs themselves (T5, Whisper, Marian)
    decoder = (_hf_inputs(model, cfg, "decoder_input_ids", batch, seq, seed)
               if _takes(params, "decoder_input_ids", explicitly=True) else [])
    fixed: dict[str, Any] = {}
    if meta and getattr(cfg, "use_cache", None) is False and _takes(params, "use_cache"):
        # Without a cache, transformers checks the position ids for packed sequences, a data-dependent test a
        # meta tensor cannot answer; a cache changes no module's consumers, so the meta trace asks for one.
        fixed["use_cache"] = True
    extra_sets = [extras, {}] if extras else [{}]
    for chosen in extra_sets:
        names = [main, *chosen, *(["decoder_input_ids"] if decoder else [])]
        options = [mains, *chosen.values(), *([decoder] if decoder else [])]
        for combo in itertools.product(*options):
            inputs = {n: alt[0] for n, alt in zip(names, combo)}
            yield Candidate({**inputs, **fixed}, combo[0][1], combo[0][2])


# -- timm and other image models: a tensor for the first argument -------------------------------------------------


def _image_candidates(model: nn.Module, batch: int, seed: int) -> Iterator[Candidate]:
    pcfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None)
    declared = tuple(pcfg["input_size"]) if isinstance(pcfg, dict) and pcfg.get("input_size") else None
    if declared is None and not pi.image_sizes(model):
        return  # nothing says this model takes images
    for chans in pi.image_channels(model, declared[0] if declared else None):
        for size in pi.image_sizes(model, declared[1:] if declared else None):
            yield Candidate(pi.pixels(batch, chans, size, seed), batch, "image")


# -- choosing and explaining --------------------------------------------------------------------------------------


def _to(inputs: Any, device: torch.device, dtype: torch.dtype) -> Any:
    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t.to(device, dtype) if t.is_floating_point() else t.to(device)

    return {k: move(v) for k, v in inputs.items()} if isinstance(inputs, dict) else move(inputs)


def _refusal(model: nn.Module, inputs: Any, device: torch.device, outputs: list | None = None) -> Exception | None:
    """Run the model on ``inputs`` (eval mode, no grad, RNG state kept); the exception it raises, if any (else
    the output goes into ``outputs``, when given)."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            out = call_model(model, inputs)
        if outputs is not None:
            outputs.append(out)
    except OUT_OF_MEMORY:  # not this probe's fault: a smaller one would only hide it
        raise
    except Exception as exc:  # a probe the model cannot take: try the next one
        return exc
    finally:
        for m, t in flags:
            m.training = t
    return None


def _describe(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t)
    shape = tuple(t.shape)
    return f"torch.randn{shape}" if t.is_floating_point() else f"torch.zeros({shape}, dtype=torch.long)"


def example(inputs: dict[str, Any]) -> str:
    """``convert(model, probe={...})`` with the shapes of ``inputs`` (``...`` for an argument with no tensor)."""
    body = ", ".join(f"{k!r}: {_describe(v) if v is not None else '...'}" for k, v in inputs.items())
    return f"convert(model, probe={{{body}}})"


def _leaf_hint(model: nn.Module) -> str:
    """An example tensor for a model we know nothing about, from its first layer."""
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return f"torch.randint(0, {m.num_embeddings}, (2, 8))"
        if isinstance(m, nn.Linear):
            return f"torch.randn(2, {m.in_features})"
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            return f"torch.randn(2, {m.in_channels}, {', '.join(['32'] * (m.weight.dim() - 2))})"
    return "<tensor>"


def _missing_error(model: nn.Module, missing: list[str], built: dict[str, Any]) -> ProbeError:
    """Name the arguments no builder can make, with an example probe holding what could be built."""
    what = ("argument " if len(missing) == 1 else "arguments ") + ", ".join(f"`{n}`" for n in missing)
    hint = {**built, **{n: None for n in missing}}
    ex = example(hint)
    if not built and len(missing) == 1:
        ex = f"convert(model, probe={_leaf_hint(model)})  # or probe={{{missing[0]!r}: ...}}"
    return ProbeError(f"cannot build a probe input for {type(model).__name__}: nothing in its config or modules "
                      f"describes its {what}; pass probe=... "
                      f"(a tensor, a tuple of positional args or a dict of keyword args), e.g. {ex}")


def make_probe(model: nn.Module, batch: int = 2, seq: int = 8, *, seed: int = 0) -> tuple[Any, int, str]:
    """Return (probe, count, unit): the input, and how many tokens/images/frames it holds (for per-unit figures).
    ``seed`` draws another input of the same shapes."""
    probe, count, unit, _ = find_probe(model, None, batch, seq, seed=seed)
    return probe, count, unit


def make_probe_with_output(model: nn.Module, batch: int = 2, seq: int = 8, *, seed: int = 0, first: int = 0
                           ) -> tuple[Any, int, str, Any]:
    """`make_probe` plus the model's output on the probe (eval mode, no grad) from the forward that checked the
    model accepts it, so a caller that needs both pays one forward. On the meta device the output is None.
    ``first``: the candidate to try first (`Found.index` of an earlier search with another seed)."""
    return search_probe(model, None, batch, seq, seed=seed, first=first)[:4]


def find_probe(model: nn.Module, accept: Callable[[Any], T] | None, batch: int = 2, seq: int = 8, *,
               seed: int = 0) -> tuple[Any, int, str, T | Any]:
    """Return (probe, count, unit, result): the first candidate the model takes, and ``accept(probe)``
    (`search_probe` without the candidate's index)."""
    return search_probe(model, accept, batch, seq, seed=seed)[:4]


class Found(NamedTuple):
    """The chosen probe, ``accept``'s result on it, and its place in the candidate order (``index``): the order
    and the shapes do not depend on the seed, so a search with another seed can start where this one ended."""

    probe: Any
    count: int
    unit: str
    result: Any
    index: int


def search_probe(model: nn.Module, accept: Callable[[Any], T] | None, batch: int = 2, seq: int = 8, *,
                 seed: int = 0, first: int = 0) -> Found:
    """The first candidate the model takes, and ``accept(probe)``.

    ``accept`` is the work the caller wants done on the probe (the trace), run as the acceptance check itself,
    so the model runs once on the winning candidate instead of once to check it and once more to use it. When
    it raises, a plain forward (eval mode, no grad) decides whose failure that was: the model refuses the
    candidate, so the next one is tried; or the model takes it, so ``accept``'s own error is raised. With
    ``accept=None`` the result is the plain forward's output (None on the meta device).

    ``first``: the index of the candidate tried first (the one that won an earlier search with another seed);
    should the model refuse it with this seed's data, the others follow in their usual order."""
    device, dtype = _device_dtype(model)
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # PEFT
    params = _signature(base)
    main = getattr(base, "main_input_name", None)

    def candidates(b: int) -> Iterator[Candidate]:
        if getattr(base, "config", None) is not None and isinstance(main, str):
            return _hf_candidates(base, params, main, b, seq, seed, device.type == "meta")
        return _image_candidates(base, b, seed)

    # a batch of one last: heads that find each row's last token through a pad token the config lacks refuse more
    more = itertools.chain.from_iterable(candidates(b) for b in dict.fromkeys((batch, 1)))
    head = next(more, None)
    required = _required(params)
    if head is None:
        names = [main] if isinstance(main, str) else required[:1] or ["input"]
        raise _missing_error(base, names, {})
    covered = set(head.inputs) if isinstance(head.inputs, dict) else set(required[:1])
    missing = [n for n in required if n not in covered]
    if missing:
        built = head.inputs if isinstance(head.inputs, dict) else {required[0]: head.inputs}
        raise _missing_error(base, missing, built)
    tried: list[tuple[int, Candidate, Exception]] = []
    for i, cand in _first_at(itertools.chain([head], more), first):
        cand = Candidate(_to(cand.inputs, device, dtype), cand.count, cand.unit)
        result = _accepted(model, cand.inputs, device, accept)
        if not isinstance(result, _Refused):
            return Found(cand.inputs, cand.count, cand.unit, result, i)
        tried.append((i, cand, result.error))
    i, cand, err = tried[0]
    if device.type == "meta":  # a meta forward cannot answer data-dependent checks: the trace will tell
        return Found(cand.inputs, cand.count, cand.unit, accept(cand.inputs) if accept is not None else None, i)
    from .own_forward import own_forward_failure  # (it imports the tracer, as this module does)

    own = own_forward_failure(model, cand.inputs, err, f"every probe built from its config and signature "
                                                       f"({len(tried)} tried)")
    if own is not None:
        raise own from err
    shown = cand.inputs if isinstance(cand.inputs, dict) else {(required[:1] or ["input"])[0]: cand.inputs}
    raise ProbeError(
        f"{type(model).__name__} refused every probe built from its config and signature ({len(tried)} tried); "
        f"the first failed with {type(err).__name__}: {err}; pass probe=... (a tensor, a tuple of positional "
        f"args or a dict of keyword args the model accepts), e.g. {example(shown)}") from err


def _first_at(cands: Iterator[Candidate], first: int) -> Iterator[tuple[int, Candidate]]:
    """(index, candidate) in the usual order, but the one at ``first`` ahead of the rest (nothing skipped: the
    candidates before it are kept and follow it)."""
    before = []
    for i, cand in enumerate(cands):
        if i < first:
            before.append((i, cand))
        elif i == first:
            yield i, cand
            yield from before
            before = []
        else:
            yield i, cand
    yield from before  # ``first`` beyond the end: the usual order


@dataclass(frozen=True)
class _Refused:
    error: Exception


def _accepted(model: nn.Module, inputs: Any, device: torch.device, accept: Callable[[Any], T] | None
              ) -> T | Any | _Refused:
    """``accept(inputs)``, or the plain forward's output without one; `_Refused` when the model refuses
    ``inputs``. An ``accept`` failure on an input the model takes is ``accept``'s own, and is raised."""
    if accept is None:
        outputs: list = []
        err = _refusal(model, inputs, device, outputs)
        return _Refused(err) if err is not None else (outputs[0] if outputs else None)
    try:
        return accept(inputs)
    except OUT_OF_MEMORY:
        raise
    except Exception:
        err = _refusal(model, inputs, device)
        if err is None:
            raise
        return _Refused(err)
