"""Weights a conversion untied stay untied: the configs and maps transformers re-ties from say they are untied.

``convert(untie=True)`` gives a tied head its own (folded) weight. transformers re-ties from the config, not from
the tensors: ``tie_weights()`` (and so ``resize_token_embeddings``, ``post_init``, the meta-device recipe) ties
the output embedding back to the input one while ``config.tie_word_embeddings`` is True (4.x through
``get_text_config(decoder=True)``; 5.x through each ``PreTrainedModel``'s ``config`` and the precomputed
``all_tied_weights_keys``), which would put the unfolded embedding back under a head whose norm is folded.
`untie_configs` sets those flags to False and drops those map entries, for the pairs the conversion untied only,
as one reversible `Unit`.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from .rewrite import Unit

TIE_FLAG = "tie_word_embeddings"


def _embedding_weights(mod: nn.Module) -> tuple[Any, Any] | None:
    """(input, output) embedding weights of a transformers model (None for anything else)."""
    get_in, get_out = getattr(mod, "get_input_embeddings", None), getattr(mod, "get_output_embeddings", None)
    if getattr(mod, "config", None) is None or not callable(get_in) or not callable(get_out):
        return None
    try:
        emb_in, emb_out = get_in(), get_out()
    except Exception:  # noqa: BLE001 - a model without one of them (NotImplementedError, AttributeError, ...)
        return None
    w_in, w_out = getattr(emb_in, "weight", None), getattr(emb_out, "weight", None)
    return (w_in, w_out) if w_in is not None and w_out is not None else None


def _mapped_pairs(mod: nn.Module) -> dict[str, tuple[Any, Any]]:
    """transformers 5's ``all_tied_weights_keys`` (target → source names) as the tensors they name now."""
    keys = getattr(mod, "all_tied_weights_keys", None)
    if not isinstance(keys, dict):
        return {}
    pairs = {}
    for target, source in keys.items():
        try:
            pairs[target] = (mod.get_parameter(target), mod.get_parameter(source))
        except AttributeError:  # a buffer or a name this version resolves otherwise: not ours to judge
            continue
    return pairs


class TieRecord:
    """Which embedding pairs and tie-map entries are tied before the conversion changes anything."""

    def __init__(self, model: nn.Module) -> None:
        self.embeddings = {id(m): m for m in model.modules() if _tied(_embedding_weights(m))}
        self.mapped = [(m, tied) for m in model.modules()
                       for tied in [{k for k, p in _mapped_pairs(m).items() if _tied(p)}] if tied]

    def untie_unit(self) -> Unit:
        """The reversible changes that keep what the conversion untied untied (no steps when it untied nothing)."""
        unit = Unit("configs of untied weights")
        configs: dict[int, Any] = {}  # one config object may serve several modules (a model and its body)
        for mod in self.embeddings.values():
            if _tied(_embedding_weights(mod)):
                continue
            cfg = mod.config
            text = cfg.get_text_config(decoder=True) if callable(getattr(cfg, "get_text_config", None)) else None
            configs.update((id(c), c) for c in (cfg, text) if c is not None and getattr(c, TIE_FLAG, False))
        for c in configs.values():
            unit.steps.append((lambda c=c: setattr(c, TIE_FLAG, False), lambda c=c: setattr(c, TIE_FLAG, True)))
        for mod, was in self.mapped:
            keys = mod.all_tied_weights_keys
            for target, pair in _mapped_pairs(mod).items():
                if target in was and not _tied(pair):
                    source = keys[target]
                    unit.steps.append((lambda k=keys, t=target: k.pop(t, None),
                                       lambda k=keys, t=target, s=source: k.__setitem__(t, s)))
        return unit


def _tied(pair: tuple[Any, Any] | None) -> bool:
    return pair is not None and pair[0] is pair[1]
