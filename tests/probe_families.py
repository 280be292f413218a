"""Tiny random-init models whose input the automatic probe must build from config and signature alone:
encoder-decoders, speech encoders, dual encoders, multiple-choice heads, timm models built at a non-default
image size. No network: built from configs."""
from __future__ import annotations

import torch
from torch import nn

from tiny_models import randomize_norms

# ids kept within the tiny vocabularies (the defaults of Marian/Whisper point beyond them)
_SPECIAL = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=1)
_SEQ2SEQ = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=96, max_position_embeddings=32, **_SPECIAL)
_T5 = dict(d_model=32, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2, d_kv=16, vocab_size=96)
_ENCODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
_SPEECH = dict(_ENCODER, conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=16,
               num_conv_pos_embedding_groups=2, vocab_size=32)


def _hf(auto: str, arch: str, **kw) -> nn.Module:
    import transformers

    cfg = transformers.AutoConfig.for_model(arch, **kw)
    torch.manual_seed(0)
    return randomize_norms(getattr(transformers, auto).from_config(cfg))


def _composite(encoder: str, decoder: str, composite: str, enc_kw: dict, dec_kw: dict) -> nn.Module:
    """An encoder-decoder assembled from two configs: sizes live in config.encoder / config.decoder."""
    import transformers

    enc = transformers.AutoConfig.for_model(encoder, **enc_kw)
    dec = transformers.AutoConfig.for_model(decoder, is_decoder=True, add_cross_attention=True, **dec_kw)
    cfg = getattr(transformers, composite + "Config").from_encoder_decoder_configs(enc, dec)
    torch.manual_seed(0)
    return randomize_norms(getattr(transformers, composite + "Model")(cfg))


def _timm_mixer() -> nn.Module:
    # mixer_s16_224's entry point fixes the width; the builder it calls sets pretrained_cfg the same way
    from timm.models import build_model_with_cfg
    from timm.models.mlp_mixer import MlpMixer

    torch.manual_seed(0)
    return randomize_norms(build_model_with_cfg(MlpMixer, "mixer_s16_224", pretrained=False, img_size=160,
                                                patch_size=16, embed_dim=32, num_blocks=1, num_classes=10))


def _timm(name: str, **kw) -> nn.Module:
    import timm

    torch.manual_seed(0)
    return randomize_norms(timm.create_model(name, pretrained=False, img_size=160, num_classes=10, **kw))


PROBE_FAMILIES = {
    "t5": lambda: _hf("AutoModelForSeq2SeqLM", "t5", **_T5),
    "umt5": lambda: _hf("AutoModelForSeq2SeqLM", "umt5", **_T5),
    "bart": lambda: _hf("AutoModelForSeq2SeqLM", "bart", **_SEQ2SEQ),
    "bart_classifier": lambda: _hf("AutoModelForSequenceClassification", "bart", **_SEQ2SEQ),
    "mbart": lambda: _hf("AutoModelForSeq2SeqLM", "mbart", **_SEQ2SEQ),
    "marian": lambda: _hf("AutoModelForSeq2SeqLM", "marian", **_SEQ2SEQ),
    "pegasus": lambda: _hf("AutoModelForSeq2SeqLM", "pegasus", **_SEQ2SEQ),
    "whisper": lambda: _hf("AutoModelForSpeechSeq2Seq", "whisper", **_SEQ2SEQ, num_mel_bins=8,
                           max_source_positions=16, max_target_positions=16),
    "wav2vec2_bert": lambda: _hf("AutoModel", "wav2vec2-bert", **_ENCODER, output_hidden_size=32),
    "speech_to_text": lambda: _hf("AutoModelForSpeechSeq2Seq", "speech_to_text", **_SEQ2SEQ, input_feat_per_channel=16,
                                  conv_channels=32, max_source_positions=64, max_target_positions=32),
    "wav2vec2": lambda: _hf("AutoModel", "wav2vec2", **_SPEECH),
    "hubert": lambda: _hf("AutoModel", "hubert", **_SPEECH),
    "clip": lambda: _hf("AutoModel", "clip", projection_dim=16,
                        text_config=dict(_ENCODER, vocab_size=96, max_position_embeddings=16),
                        vision_config=dict(_ENCODER, image_size=32, patch_size=8)),
    "siglip": lambda: _hf("AutoModel", "siglip", text_config=dict(_ENCODER, vocab_size=96, max_position_embeddings=16),
                          vision_config=dict(_ENCODER, image_size=32, patch_size=8)),
    # no pad_token_id: the head can find the last token of a batch of one only
    "gpt2_classifier": lambda: _hf("AutoModelForSequenceClassification", "gpt2", n_embd=32, n_layer=1, n_head=2,
                                   vocab_size=96, n_positions=32),
    "bert_multiple_choice": lambda: _hf("AutoModelForMultipleChoice", "bert", **_ENCODER, vocab_size=96),
    "bert2bert": lambda: _composite("bert", "bert", "EncoderDecoder", dict(_ENCODER, vocab_size=96),
                                    dict(_ENCODER, vocab_size=80)),
    "vit_gpt2": lambda: _composite("vit", "gpt2", "VisionEncoderDecoder", dict(_ENCODER, image_size=32, patch_size=8),
                                   dict(n_embd=32, n_layer=1, n_head=2, vocab_size=80)),
    "timm_hiera_160": lambda: _timm("hiera_tiny_224", embed_dim=16, num_heads=1, stages=(1, 1, 1, 1)),
    "timm_mixer_160": _timm_mixer,
    "timm_vit_160": lambda: _timm("vit_tiny_patch16_224", embed_dim=64, depth=2, num_heads=2),
}
