"""Issue 36 item 6: convert() prints no transformers warning a plain forward of the model would not print, and it
says what it is doing on a progress line once it runs long (tqdm; tested with the delay forced to 0)."""
from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch
import transformers

from lmbp_convert import convert
from lmbp_convert.trace.probe import make_probe
from testsupport.families import FAMILIES, lora_on_every_linear

_TRANSFORMERS = str(Path(transformers.__file__).parent)


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _transformers_says(fn) -> set[str]:
    """The transformers log lines (warning and up) and Python warnings raised from its files while ``fn`` runs,
    its ``warning_once`` memory cleared first (a line said once in the process would hide a second time)."""
    logger = logging.getLogger("transformers")
    said, level = _Said(), logger.level
    logging.Logger.warning_once.cache_clear()
    logger.addHandler(said)
    logger.setLevel(logging.WARNING)  # (testsupport.families quiets it to ERROR)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)
    return set(said.messages) | {str(w.message) for w in caught if w.filename.startswith(_TRANSFORMERS)}


def _plain_forwards(model, probe) -> None:
    """What a user's own loop runs: an eval forward, and a training one with labels where its head is a per-token
    one (an LM: labels = the input ids), as training runs it."""
    with torch.no_grad():
        out = model.eval()(**probe)
    logits = getattr(out, "logits", None)
    per_token = isinstance(logits, torch.Tensor) and logits.dim() == 3 and "input_ids" in probe
    model.train()(**probe, **({"labels": probe["input_ids"]} if per_token else {}))


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "vit", "lora_llama"])
def test_convert_says_nothing_a_plain_forward_does_not(family):
    model = lora_on_every_linear(FAMILIES["llama"]()) if family == "lora_llama" else FAMILIES[family]()
    probe = make_probe(model)[0]
    plain = _transformers_says(lambda: _plain_forwards(model, probe))
    ours = _transformers_says(lambda: convert(model))
    assert ours <= plain, ours - plain
    if family != "gpt2":  # (GPT2LMHeadModel has no loss type: its own labelled forward says so too)
        assert not any("loss_type" in line for line in ours), ours


def test_progress_line_names_the_phases(capsys):
    convert(FAMILIES["llama"](), progress=True)  # delay 0: shown from the start, deterministic
    err = capsys.readouterr().err
    assert "lmbp-convert: convert()" in err
    for phase in ("probe…", "plan…", "verify…", "measure…", "verify: the traced probe…"):
        assert phase in err, (phase, err)


def test_no_progress_line_when_asked_or_when_quick(capsys, monkeypatch):
    from lmbp_convert.apply import progress

    convert(FAMILIES["llama"](), progress=False)
    assert "lmbp-convert:" not in capsys.readouterr().err
    monkeypatch.setattr(progress, "DELAY", 3600.0)  # the default's delay, made longer than any run
    convert(FAMILIES["llama"]())
    assert "lmbp-convert:" not in capsys.readouterr().err
    with pytest.raises(ValueError, match="progress must be None, True or False"):
        convert(FAMILIES["llama"](), progress="yes")


def test_plan_conversion_has_a_progress_line_too(capsys):
    from lmbp_convert import plan_conversion

    plan_conversion(FAMILIES["llama"](), progress=True)
    err = capsys.readouterr().err
    assert "lmbp-convert: plan_conversion()" in err and "measure…" in err
