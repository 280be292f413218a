"""Greedy generation with the KV cache on: a converted causal LM produces the original's tokens.

Generation runs the converted modules on one new token at a time against cached keys/values, a shape the
conversion probe never saw; the converted norms and swapped MLPs must still compute the same function there.
"""
import copy

import pytest
import torch

from lmbp_convert import convert
from lmbp_convert.match.norm_exact import NormExact
from testsupport.families import hf

NEW = 8


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma"])
def test_greedy_generate_matches_original(arch):
    original = hf(arch).eval()
    converted = copy.deepcopy(original)
    report = convert(converted).lmbp_report
    assert report.plan.of(NormExact) and not report.plan.norm_folds, str(report)  # the exact default
    converted.eval()
    prompt = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompt)
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, use_cache=True, pad_token_id=0,
              attention_mask=mask, return_dict_in_generate=True, output_scores=True)
    lengths = []
    hook = converted.get_output_embeddings().register_forward_pre_hook(lambda m, a: lengths.append(a[0].shape[1]))
    with torch.no_grad():
        ref = original.generate(prompt, **kw)
        got = converted.generate(prompt, **kw)
    hook.remove()
    assert ref.sequences.shape == (2, 5 + NEW)
    assert torch.equal(got.sequences, ref.sequences)
    # the per-step scores agree too (not only their argmax): every cached step computes the same function
    for s_got, s_ref in zip(got.scores, ref.scores):
        torch.testing.assert_close(s_got, s_ref, rtol=1e-4, atol=1e-5)
    # the KV cache was used: after the prompt, the converted model ran on one new token per step
    assert lengths[1:] == [1] * (NEW - 1), lengths
