"""A tokenizer and a text dataset for the trainer tests and the recipes, built here (no download).

    word_tokenizer()   a word-level tokenizer over a few words (<unk>, <s>, </s>, <pad> first)
    WORDS, TEXTS       its words, and sentences made of them (what TRL's SFTTrainer trains on in the tests)
"""
from __future__ import annotations

WORDS = "the sky is blue grass green".split()
TEXTS = ["the sky is blue", "the grass is green", "the sky is green grass", "blue is the sky"]


def word_tokenizer():
    """A ``PreTrainedTokenizerFast`` over `WORDS`: ids 0-3 are <unk>, <s>, </s>, <pad>, then the words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
