"""The second verification input derived from a user's probe: data varies, structure (masks, non-tensors) stays."""
import pytest
import torch

from lmbp_convert import Probes
from lmbp_convert.trace.second_probe import derived_inputs


def _probe():
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(5, 50, (2, 8), generator=g), "attention_mask": torch.ones(2, 8, dtype=torch.long),
            "pixel_values": torch.randn(2, 3, 4, 4, generator=g) * 2 + 1, "flag": True, "none": None}


def test_resampled_first_then_shuffled_and_structure_is_kept():
    probe = _probe()
    (first, how1), (second, how2) = list(derived_inputs(probe))
    assert "re-sampled" in how1 and "shuffled" in how2
    for new in (first, second):
        assert new["attention_mask"] is probe["attention_mask"] and new["flag"] is True and new["none"] is None
        assert new["input_ids"].shape == probe["input_ids"].shape and not torch.equal(new["input_ids"],
                                                                                       probe["input_ids"])
        assert new["pixel_values"].dtype == probe["pixel_values"].dtype
    ids = first["input_ids"]
    assert int(ids.min()) >= int(probe["input_ids"].min()) and int(ids.max()) <= int(probe["input_ids"].max())
    px = first["pixel_values"]
    assert abs(float(px.mean()) - float(probe["pixel_values"].mean())) < 0.5
    assert torch.equal(second["input_ids"].sort(-1).values, probe["input_ids"].sort(-1).values)  # rows keep values


def test_deterministic_and_nothing_to_vary_gives_nothing():
    a, b = list(derived_inputs(_probe())), list(derived_inputs(_probe()))
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for (x, _), (y, _) in zip(a, b))
    assert list(derived_inputs({"mask": torch.ones(2, 3), "n": 3})) == []
    assert list(derived_inputs(torch.zeros(2, 4, dtype=torch.long))) == []


def test_probes_validates():
    with pytest.raises(ValueError):
        Probes()
    with pytest.raises(TypeError):
        Probes(Probes(torch.zeros(1)))
    assert len(Probes(torch.zeros(1), torch.ones(1))) == 2
