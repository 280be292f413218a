"""Tensors for a probe, one builder per input modality, sized from the model's config and module tree.

Each builder returns the alternatives worth trying, most likely first (a layout or a length the config does not
pin down); ``probe.make_probe`` keeps the first one the model accepts. Tensors are drawn on the CPU from a
seeded generator, then moved: an ambient default device (``with torch.device("meta"):``) must not decide where
the probe of a CPU model lives.
"""
from __future__ import annotations

import math
from typing import Any, Iterator

import torch
from torch import nn

Size2 = tuple[int, int]


def first(cfg: Any, *names: str, default=None):
    """The first of ``names`` set on ``cfg`` (None-safe)."""
    for n in names:
        v = getattr(cfg, n, None) if cfg is not None else None
        if v is not None:
            return v
    return default


# Where composite configs keep the fields of each side: dual encoders (text_config, vision_config) and
# encoder-decoders assembled from two configs (encoder, decoder).
TEXT_SIDE = ("text_config", "encoder")
DECODER_SIDE = ("decoder", "text_config")
VISION_SIDE = ("vision_config", "encoder")


def sub_first(cfg: Any, subs: tuple[str, ...], *names: str, default=None):
    """A field of the config itself, else of the first of its ``subs`` configs that sets it."""
    for c in (cfg, *(getattr(cfg, s, None) for s in subs)):
        v = first(c, *names)
        if v:
            return v
    return default


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pair(size: Any) -> Size2 | None:
    if isinstance(size, int) and size > 0:
        return size, size
    if isinstance(size, (list, tuple)) and len(size) >= 2 and all(isinstance(s, int) for s in size[-2:]):
        return int(size[-2]), int(size[-1])
    return None


# -- token ids ---------------------------------------------------------------------------------------------------


def token_ids(vocab: int, shape: tuple[int, ...], seed: int, start: int | None = None) -> torch.Tensor:
    """Random ids in ``[0, vocab)``; ``start`` (a decoder's start token, when within the vocabulary) opens each row."""
    ids = torch.randint(0, vocab, shape, generator=_gen(seed), device="cpu")
    if start is not None and 0 <= start < vocab:
        ids[..., 0] = start
    return ids


def ends_with(ids: torch.Tensor, token: int, vocab: int) -> torch.Tensor:
    """``ids`` with ``token`` closing each row and nowhere else (drawn ids equal to it take the next id)."""
    out = torch.where(ids == token, (token + 1) % vocab, ids)
    out[..., -1] = token
    return out


def text_length(cfg: Any, seq: int) -> int:
    max_pos = sub_first(cfg, TEXT_SIDE, "max_position_embeddings", "n_positions", default=seq)
    return max(2, min(seq, max_pos))


def text_vocab(cfg: Any) -> int | None:
    return sub_first(cfg, TEXT_SIDE, "vocab_size")


def decoder_length(cfg: Any, seq: int) -> int:
    max_pos = sub_first(cfg, DECODER_SIDE, "max_target_positions", "max_position_embeddings", "n_positions",
                        default=seq)
    return max(2, min(seq, max_pos))


def decoder_vocab(cfg: Any) -> int | None:
    """The decoder's vocabulary (Marian may give it its own size: ids must fit both embeddings it could use)."""
    sizes = [v for v in (first(cfg, "decoder_vocab_size"), sub_first(cfg, DECODER_SIDE, "vocab_size")) if v]
    return min(sizes) if sizes else None


def decoder_start(cfg: Any) -> int | None:
    return first(cfg, "decoder_start_token_id", "pad_token_id", "bos_token_id")


# -- pixels ------------------------------------------------------------------------------------------------------


def module_attrs(model: nn.Module, attr: str) -> Iterator[Any]:
    """The values of ``attr`` on the model and its modules (module order), where set and not a method."""
    for mod in model.modules():
        v = getattr(mod, attr, None)
        if v is not None and not callable(v):
            yield v


def _stem_stride(model: nn.Module) -> Size2 | None:
    """Stride of the first 2-D convolution (the patch embedding or stem): one token per stride² pixels."""
    for mod in model.modules():
        if isinstance(mod, nn.Conv2d):
            return _pair(tuple(mod.stride))
    return None


def _grid_sizes(model: nn.Module) -> Iterator[Size2]:
    """Image sizes implied by learned absolute position embeddings (N = g² tokens after any prefix tokens, or an
    explicit g×g grid) times the stem's stride: models built at a size without recording it (Hiera)."""
    stride = _stem_stride(model)
    if stride is None:
        return
    prefixes = sorted({0, *(p for p in module_attrs(model, "num_prefix_tokens") if isinstance(p, int))})
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        leaf = name.rpartition(".")[2]
        if not ("pos_embed" in leaf or "position_embedding" in leaf) or t.dim() < 2:
            continue
        if t.dim() == 4:  # (1, C, H, W)
            yield t.shape[-2] * stride[0], t.shape[-1] * stride[1]
            continue
        n = t.shape[-2]
        for p in prefixes:
            g = math.isqrt(max(0, n - p))
            if g > 1 and g * g == n - p:
                yield g * stride[0], g * stride[1]


def _token_grid_sizes(model: nn.Module) -> Iterator[Size2]:
    """The image size implied by the first token grid a module records it was built for (``resolution``, as
    LeViT's attention keeps it: its biases are sized by it, so another input size fails) times the strides of
    every 2-D convolution before it in module order (the stem): models that turn ``img_size`` into a grid when
    built and keep only the grid."""
    stride = (1, 1)
    for mod in model.modules():
        if isinstance(mod, nn.Conv2d):
            step = _pair(tuple(mod.stride)) or (1, 1)
            stride = (stride[0] * step[0], stride[1] * step[1])
            continue
        res = getattr(mod, "resolution", None)
        grid = None if isinstance(res, bool) else _pair(res)
        if grid is not None:
            if stride != (1, 1):
                yield grid[0] * stride[0], grid[1] * stride[1]
            return


def image_sizes(model: nn.Module, declared: Any = None) -> list[Size2]:
    """Sizes to try, in order: what a module records it was built for (``img_size``: patch embedding, stem,
    the model), what position embeddings imply, what a recorded token grid implies, then the declared default
    (``pretrained_cfg['input_size']``, which timm keeps at the architecture's default when a model is built at
    another size: the modules decide)."""
    found = [s for s in map(_pair, (*module_attrs(model, "img_size"), *_grid_sizes(model),
                                    *_token_grid_sizes(model), declared)) if s]
    return list(dict.fromkeys(found))


def image_channels(model: nn.Module, declared: Any = None) -> list[int]:
    """Channel counts to try, most likely first: what the model was built with (an ``in_chans`` attribute, the
    first 2-D convolution's ``in_channels``), then the declared default. timm keeps ``pretrained_cfg`` at the
    architecture's default (3 channels) when a model is built with ``in_chans=1``: the modules decide."""
    chans = [c for c in module_attrs(model, "in_chans") if isinstance(c, int) and not isinstance(c, bool)][:1]
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    chans += [conv.in_channels] if conv is not None else []
    chans += [int(declared)] if declared else []
    return list(dict.fromkeys(c for c in chans if c > 0)) or [3]


def pixels(batch: int, chans: int, size: Size2, seed: int) -> torch.Tensor:
    return torch.randn(batch, chans, *size, generator=_gen(seed), device="cpu")


def hf_image(cfg: Any) -> tuple[int, Size2] | None:
    """(channels, size) from the config that sets ``image_size``: the model's own or its vision side."""
    for vcfg in (cfg, *(getattr(cfg, s, None) for s in VISION_SIDE)):
        size = _pair(first(vcfg, "image_size"))
        if size is not None:
            return int(first(vcfg, "num_channels", default=3)), size
    return None


# -- audio -------------------------------------------------------------------------------------------------------


def input_convs(model: nn.Module) -> list[nn.Conv1d]:
    """The leading run of 1-D convolutions (a feature encoder over samples or frames), up to the first Linear or
    Embedding in module order: what sets the input length an output of T frames needs."""
    convs: list[nn.Conv1d] = []
    for mod in model.modules():
        if isinstance(mod, nn.Conv1d):
            convs.append(mod)
        elif isinstance(mod, (nn.Linear, nn.Embedding)):
            break
    return convs


def input_length(convs: list[nn.Conv1d], frames: int) -> int:
    """The shortest input that gives ``frames`` outputs through ``convs`` (inverting L_out = (L + 2p − k)/s + 1)."""
    length = frames
    for c in reversed(convs):
        pad = c.padding[0] if isinstance(c.padding, tuple) else 0
        length = (length - 1) * c.stride[0] + c.dilation[0] * (c.kernel_size[0] - 1) + 1 - 2 * pad
    return max(length, 1)


def audio_frames(cfg: Any, seq: int) -> int:
    # SpecAugment in training masks spans of mask_time_length frames: a shorter input cannot be trained on
    return max(seq, int(first(cfg, "mask_time_length", default=0) or 0))


def raw_audio(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, length, generator=_gen(seed), device="cpu")


def feature_bins(cfg: Any, model: nn.Module) -> list[int]:
    """Feature sizes to try: the config's, then what the first convolution or Linear takes (encoders that stack
    frames, such as Wav2Vec2-BERT's 2 × 80 bins, say so only through their first layer)."""
    bins = [first(cfg, "num_mel_bins", "feature_size")]
    if first(cfg, "input_feat_per_channel") is not None:
        bins.append(cfg.input_feat_per_channel * first(cfg, "input_channels", default=1))
    convs = input_convs(model)
    bins.append(convs[0].in_channels if convs else None)
    bins.append(next((m.in_features for m in model.modules() if isinstance(m, nn.Linear)), None))
    return list(dict.fromkeys(b for b in bins if b))


def feature_lengths(cfg: Any, model: nn.Module, seq: int) -> list[int]:
    """Frame counts to try: a short clip, then the fixed length some encoders require (max_source_positions
    times the stride of their input convolutions: Whisper's 30 s window)."""
    stride = math.prod(c.stride[0] for c in input_convs(model))
    lengths = [audio_frames(cfg, seq) * stride]
    max_src = first(cfg, "max_source_positions")
    if max_src:
        lengths.append(max_src * stride)
    return list(dict.fromkeys(lengths))


def features(batch: int, bins: int, frames: int, channels_first: bool, seed: int) -> torch.Tensor:
    shape = (batch, bins, frames) if channels_first else (batch, frames, bins)
    return torch.randn(*shape, generator=_gen(seed), device="cpu")
