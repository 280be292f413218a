import pytest
import torch
from transformers import AutoConfig, AutoModel

from lmbp_convert.hf_compat import dtype_kwargs


@pytest.mark.compat
def test_dtype_keyword_is_the_one_this_release_takes():
    """transformers renamed ``torch_dtype`` to ``dtype`` (4.56); models of earlier releases reject ``dtype``."""
    cfg = AutoConfig.for_model("gpt2", n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=16)
    model = AutoModel.from_config(cfg, **dtype_kwargs(torch.bfloat16))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert dtype_kwargs(None) == {}
