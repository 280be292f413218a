"""Issue 36 item 4: where the model's own forward fails in the mode convert() traces in (eval, no grad) on every
input, and runs in train mode, the error says so and names the module, instead of asking for another probe."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lmbp_convert import ProbeError, TraceError, convert
from testsupport.families import hf


class InferenceOnlyFails(nn.Linear):
    """A Linear whose inference path (eval mode, no grad) refuses its width, as bitsandbytes' CPU 4-bit kernel does."""

    def forward(self, x):
        if not self.training and not torch.is_grad_enabled():
            raise AssertionError("N must be divisible by block_n")
        return super().forward(x)


def test_a_given_probe_and_a_model_whose_inference_forward_fails():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), InferenceOnlyFails(16, 8))
    with pytest.raises(TraceError) as info:
        convert(model, probe=torch.randn(2, 8))
    msg = str(info.value)
    assert not isinstance(info.value, ProbeError) and "pass probe=" not in msg, msg
    assert msg.startswith("Sequential's own forward fails in eval mode under torch.no_grad(), the mode convert() "
                          "traces and verifies in, on the probe given, and runs on the same input in train mode: no "
                          "probe would help. It raised AssertionError: N must be divisible by block_n in 2 "
                          f"({__name__}.InferenceOnlyFails)"), msg
    assert "quantized" not in msg  # its weight is a float one
    assert model.training and all(m.training for m in model.modules())  # left as it was


def test_every_automatic_probe_refused_for_the_same_reason():
    model = hf("llama")
    mlp = model.model.layers[1].mlp
    old = mlp.up_proj
    mlp.up_proj = InferenceOnlyFails(old.in_features, old.out_features, bias=False)
    with pytest.raises(TraceError) as info:
        convert(model)
    msg = str(info.value)
    assert "on every probe built from its config and signature (" in msg and "no probe would help" in msg, msg
    assert "in model.layers.1.mlp.up_proj (" in msg and "pass probe=" not in msg, msg


def test_a_model_that_refuses_the_input_in_training_too_still_asks_for_a_probe():
    class NeedsSix(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.act = nn.Linear(6, 6), nn.GELU()

        def forward(self, x):
            return self.act(self.lin(x))

    with pytest.raises(TraceError, match="pass probe="):
        convert(NeedsSix(), probe=torch.randn(2, 5))
