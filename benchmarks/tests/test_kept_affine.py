"""benchmarks.kept_affine and benchmarks.kept_affine_error: parsers, the guard's error table on one case, and one
model's byte rows (slow)."""
from __future__ import annotations

import pytest
import torch

from benchmarks import kept_affine as K
from benchmarks import kept_affine_error as E


def test_help_names_the_module(capsys):
    with pytest.raises(SystemExit) as exc:
        K.parse_args(["--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m benchmarks.kept_affine")


def test_guarded_gradients_as_accurate_as_torch_where_a_clamp_is_not():
    """Hostile γ in bf16: the guarded op errs no more than torch's own bf16 LayerNorm (dx) and far less in dγ than
    inverting every channel with a clamped γ (Apex's route)."""
    r = E.measure("layer", torch.bfloat16, "hostile", seeds=1)
    assert r["kept"][0] > 0
    assert r["guarded"][0] <= 1.5 * r["torch"][0]
    assert r["guarded"][1] < 0.01 < r["clamped"][1]


@pytest.mark.slow
def test_distilbert_rows_show_the_kept_affine_saving_bytes():
    (fp32, bf16, autocast) = K.main(["--models", "distilbert", "--seq", "16"])
    for r in (fp32, bf16, autocast):
        assert r["new_kept"] > 0 and r["new"] < r["old"] < r["original"]
    assert fp32["new_grad_err"] < 1e-5
