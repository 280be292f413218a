"""Tiny random-init models of the families lmbp-convert must convert, built from configs (no network).

One place for the tests (``from testsupport.families import hf, FAMILIES``) and the benchmarks
(``benchmarks.coverage``): the conversion matrix and the tests run on the same models. Every norm gets a
non-trivial γ, β (``randomize_norms``) so that a wrong fold shows. Nothing here imports lmbp_convert: a subprocess
that blocks it (tests/integration/test_save_load.py) still builds the models.

    FAMILIES         the dense families most tests parametrize over (LLaMA, BERT, ViT, ...)
    PROBE_FAMILIES   families whose input the automatic probe must build from config and signature alone
                     (encoder-decoders, speech, dual encoders, multiple choice, timm at a non-default size)
    MORE_FAMILIES    the rest of the conversion matrix (more decoders, encoders, MoE, timm and HF vision)
    registry()       all of them; GROUPS: the matrix's rows by kind
"""
from __future__ import annotations

import logging
import unittest
from typing import Callable

import torch
from torch import nn

logging.getLogger("transformers").setLevel(logging.ERROR)


class FamilyUnavailable(unittest.SkipTest):
    """The installed transformers predates the family. A ``unittest.SkipTest``: pytest reports the test as
    skipped (the compat stage runs the oldest transformers pyproject.toml allows); a benchmark shows an error row."""


# Real models' MLP ratios: 4× for BERT/ViT/CLIP/GPT-2, 11008/4096 ≈ 2.69× for LLaMA-style gated MLPs.
HF_SMALL = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)


def randomize_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial γ, β so that a wrong fold shows (fresh norms are the identity)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if "norm" not in type(mod).__name__.lower():
                continue
            w = getattr(mod, "weight", None)
            b = getattr(mod, "bias", None)
            if isinstance(w, torch.Tensor) and w.dim() == 1:
                w.copy_((torch.rand(w.shape, generator=gen) + 0.5).to(w.dtype))
            if isinstance(b, torch.Tensor) and b.dim() == 1:
                b.copy_((0.5 * torch.randn(b.shape, generator=gen)).to(b.dtype))
    return model


def nonzero_init(model: nn.Module) -> nn.Module:
    """Random values for zero-initialised parameters (timm heads, layer-scale-free zero weights): a zero weight
    stops every gradient upstream of it, which would make a gradient comparison vacuous there."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.numel() > 1 and not p.any():
                p.copy_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def _require(arch: str) -> None:
    import transformers
    from transformers import CONFIG_MAPPING

    if arch not in CONFIG_MAPPING:
        raise FamilyUnavailable(f"transformers {transformers.__version__} has no model type {arch!r} (a later family)")


def hf(arch: str, head: str = "causal", **overrides) -> nn.Module:
    """A tiny ``arch`` model at ``HF_SMALL`` sizes (``overrides`` win) with a causal-LM (default), base
    (``head="base"``) or sequence-classification (``head="cls"``) head."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    _require(arch)
    kw = dict(HF_SMALL)
    if arch == "gpt2":
        kw = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64)
    if arch in ("gemma",):
        kw.update(head_dim=16, num_key_value_heads=2)
    if arch in ("llama", "mistral", "qwen2", "gemma"):
        kw.update(intermediate_size=172)
    if arch in ("llama", "mistral", "qwen2"):
        kw.update(num_key_value_heads=2, tie_word_embeddings=False)
    if arch == "vit":
        kw.update(image_size=32, patch_size=8)
    kw.update(overrides)
    cfg = AutoConfig.for_model(arch, **kw)
    cls = {"causal": AutoModelForCausalLM, "base": AutoModel, "cls": AutoModelForSequenceClassification}[head]
    torch.manual_seed(0)
    return randomize_norms(cls.from_config(cfg))


def hf_auto(auto: str, arch: str, **kw) -> nn.Module:
    """A tiny ``arch`` model built by the transformers class ``auto`` (e.g. ``"AutoModelForSeq2SeqLM"``) from
    exactly ``kw`` (no default sizes)."""
    import transformers

    _require(arch)
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


def timm_model(name: str, **kw) -> nn.Module:
    """A timm model, random init, 10 classes."""
    import timm

    torch.manual_seed(0)
    return randomize_norms(timm.create_model(name, pretrained=False, num_classes=10, **kw))


def clip_vision() -> nn.Module:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    cfg = CLIPVisionConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8)
    return randomize_norms(CLIPVisionModel(cfg))


def timm_vit() -> nn.Module:
    return timm_model("vit_base_patch16_224", depth=2, embed_dim=64, num_heads=4, img_size=32, patch_size=8)


def timm_swin() -> nn.Module:
    return timm_model("swin_tiny_patch4_window7_224", depths=(1, 1, 1, 1), embed_dim=32, num_heads=(1, 1, 1, 1))


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "llama": lambda: hf("llama"),
    "mistral": lambda: hf("mistral"),
    "qwen2": lambda: hf("qwen2"),
    "gemma": lambda: hf("gemma"),
    "gpt2": lambda: hf("gpt2"),
    "bert": lambda: hf("bert", head="cls"),
    "roberta": lambda: hf("roberta", head="cls", max_position_embeddings=66),
    "vit": lambda: hf("vit", head="base"),
    "clip_vision": clip_vision,
    "timm_vit": timm_vit,
    "timm_swin": timm_swin,
}

# ---------------------------------------------------------------------------------------- probe families
# ids kept within the tiny vocabularies (the defaults of Marian/Whisper point beyond them)
_SPECIAL = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=1)
SEQ2SEQ_SMALL = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=96,
                     max_position_embeddings=32, **_SPECIAL)
T5_SMALL = dict(d_model=32, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2, d_kv=16, vocab_size=96)
ENCODER_SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
SPEECH_SMALL = dict(ENCODER_SMALL, conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2),
                    num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, vocab_size=32)


def _timm_mixer() -> nn.Module:
    # mixer_s16_224's entry point fixes the width; the builder it calls sets pretrained_cfg the same way
    from timm.models import build_model_with_cfg
    from timm.models.mlp_mixer import MlpMixer

    torch.manual_seed(0)
    return randomize_norms(build_model_with_cfg(MlpMixer, "mixer_s16_224", pretrained=False, img_size=160,
                                                patch_size=16, embed_dim=32, num_blocks=1, num_classes=10))


def _timm_160(name: str, **kw) -> nn.Module:
    return timm_model(name, img_size=160, **kw)


PROBE_FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "t5": lambda: hf_auto("AutoModelForSeq2SeqLM", "t5", **T5_SMALL),
    "umt5": lambda: hf_auto("AutoModelForSeq2SeqLM", "umt5", **T5_SMALL),
    "bart": lambda: hf_auto("AutoModelForSeq2SeqLM", "bart", **SEQ2SEQ_SMALL),
    "bart_classifier": lambda: hf_auto("AutoModelForSequenceClassification", "bart", **SEQ2SEQ_SMALL),
    "mbart": lambda: hf_auto("AutoModelForSeq2SeqLM", "mbart", **SEQ2SEQ_SMALL),
    "marian": lambda: hf_auto("AutoModelForSeq2SeqLM", "marian", **SEQ2SEQ_SMALL),
    "pegasus": lambda: hf_auto("AutoModelForSeq2SeqLM", "pegasus", **SEQ2SEQ_SMALL),
    "whisper": lambda: hf_auto("AutoModelForSpeechSeq2Seq", "whisper", **SEQ2SEQ_SMALL, num_mel_bins=8,
                               max_source_positions=16, max_target_positions=16),
    "wav2vec2_bert": lambda: hf_auto("AutoModel", "wav2vec2-bert", **ENCODER_SMALL, output_hidden_size=32),
    "speech_to_text": lambda: hf_auto("AutoModelForSpeechSeq2Seq", "speech_to_text", **SEQ2SEQ_SMALL,
                                      input_feat_per_channel=16, conv_channels=32, max_source_positions=64,
                                      max_target_positions=32),
    "wav2vec2": lambda: hf_auto("AutoModel", "wav2vec2", **SPEECH_SMALL),
    "hubert": lambda: hf_auto("AutoModel", "hubert", **SPEECH_SMALL),
    "clip": lambda: hf_auto("AutoModel", "clip", projection_dim=16,
                            text_config=dict(ENCODER_SMALL, vocab_size=96, max_position_embeddings=16),
                            vision_config=dict(ENCODER_SMALL, image_size=32, patch_size=8)),
    "siglip": lambda: hf_auto("AutoModel", "siglip",
                              text_config=dict(ENCODER_SMALL, vocab_size=96, max_position_embeddings=16),
                              vision_config=dict(ENCODER_SMALL, image_size=32, patch_size=8)),
    # no pad_token_id: the head can find the last token of a batch of one only
    "gpt2_classifier": lambda: hf_auto("AutoModelForSequenceClassification", "gpt2", n_embd=32, n_layer=1,
                                       n_head=2, vocab_size=96, n_positions=32),
    "bert_multiple_choice": lambda: hf_auto("AutoModelForMultipleChoice", "bert", **ENCODER_SMALL, vocab_size=96),
    "bert2bert": lambda: _composite("bert", "bert", "EncoderDecoder", dict(ENCODER_SMALL, vocab_size=96),
                                    dict(ENCODER_SMALL, vocab_size=80)),
    "vit_gpt2": lambda: _composite("vit", "gpt2", "VisionEncoderDecoder",
                                   dict(ENCODER_SMALL, image_size=32, patch_size=8),
                                   dict(n_embd=32, n_layer=1, n_head=2, vocab_size=80)),
    "timm_hiera_160": lambda: _timm_160("hiera_tiny_224", embed_dim=16, num_heads=1, stages=(1, 1, 1, 1)),
    "timm_mixer_160": _timm_mixer,
    "timm_vit_160": lambda: _timm_160("vit_tiny_patch16_224", embed_dim=64, depth=2, num_heads=2),
}

# ------------------------------------------------------------------------------------ the rest of the matrix
_GATED = dict(intermediate_size=172, num_key_value_heads=2)
_MOE = dict(_GATED, intermediate_size=128)  # bf16 grouped matmuls want 16-byte strides

MORE_FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "phi3": lambda: hf("phi3", pad_token_id=0, **_GATED),
    "granite": lambda: hf("granite", **_GATED),
    "gemma2": lambda: hf("gemma2", head_dim=16, **_GATED),
    "stablelm": lambda: hf("stablelm", **_GATED),
    "qwen3": lambda: hf("qwen3", head_dim=16, **_GATED),
    "olmo": lambda: hf("olmo", **_GATED),
    "electra": lambda: hf("electra", head="cls", embedding_size=64),
    "distilbert": lambda: hf("distilbert", head="cls", dim=64, hidden_dim=256, n_layers=2, n_heads=4),
    "mixtral": lambda: hf("mixtral", num_local_experts=4, num_experts_per_tok=2, **_MOE),
    "qwen2_moe": lambda: hf("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                            shared_expert_intermediate_size=64, **_MOE),
    "qwen3_moe": lambda: hf("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                            head_dim=16, **_MOE),
    "olmoe": lambda: hf("olmoe", num_experts=4, num_experts_per_tok=2, **_MOE),
    "opt": lambda: hf("opt", ffn_dim=256, word_embed_proj_dim=64, max_position_embeddings=64),
    "gpt_neox": lambda: hf("gpt_neox", tie_word_embeddings=False),
    "bloom": lambda: hf("bloom", n_layer=2, n_head=4),
    "timm_convnext": lambda: timm_model("convnext_atto", depths=(1, 1, 1, 1), dims=(16, 32, 48, 64)),
    "timm_eva02": lambda: timm_model("eva02_tiny_patch14_224", embed_dim=64, depth=2, num_heads=2, img_size=28),
    "timm_deit": lambda: timm_model("deit_tiny_patch16_224", embed_dim=64, depth=2, num_heads=2, img_size=32),
    "timm_beit": lambda: timm_model("beit_base_patch16_224", embed_dim=64, depth=2, num_heads=2, img_size=32),
    # what people fine-tune beyond the above: Gemma 3, Phi-2, Falcon (40B/180B layout), StarCoder2, OLMo 2 (norms
    # after each sublayer), DeBERTa-v3, ModernBERT, ALBERT (one layer shared), FLAN-T5 (T5 v1.1 gated-GELU),
    # Granite-MoE, DeepSeek-V3 (MLA attention, a dense first layer, shared experts), GPT-OSS, DINOv2, PVT-v2, WavLM
    "gemma3": lambda: hf("gemma3_text", head_dim=16, **_GATED),
    "phi": lambda: hf("phi"),
    "falcon": lambda: hf("falcon", new_decoder_architecture=True, num_kv_heads=2),
    "starcoder2": lambda: hf("starcoder2", **_GATED),
    "olmo2": lambda: hf("olmo2", **_GATED),
    "deberta_v2": lambda: hf("deberta-v2", head="cls"),
    "modernbert": lambda: hf("modernbert", head="cls", pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                             sep_token_id=2, global_attn_every_n_layers=2, local_attention=16,
                             max_position_embeddings=64),
    "albert": lambda: hf("albert", head="cls", embedding_size=32),
    "flan_t5": lambda: hf_auto("AutoModelForSeq2SeqLM", "t5", feed_forward_proj="gated-gelu", **T5_SMALL),
    "granitemoe": lambda: hf("granitemoe", num_local_experts=4, num_experts_per_tok=2, **_MOE),
    "deepseek_v3": lambda: hf("deepseek_v3", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                              n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32,
                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1, **_MOE),
    "gpt_oss": lambda: hf("gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=16, **_MOE),
    "dinov2": lambda: hf("dinov2", head="base", image_size=32, patch_size=8),
    "timm_pvt_v2": lambda: timm_model("pvt_v2_b0", embed_dims=(16, 32, 48, 64), depths=(1, 1, 1, 1),
                                      num_heads=(1, 1, 1, 1)),
    "wavlm": lambda: hf_auto("AutoModel", "wavlm", **SPEECH_SMALL),
}

GROUPS: dict[str, list[str]] = {
    "decoder": ["llama", "mistral", "qwen2", "gemma", "gpt2", "gpt2_classifier", "phi3", "qwen3", "olmo", "granite",
                "gemma2", "stablelm", "opt", "gpt_neox", "bloom", "gemma3", "phi", "falcon", "starcoder2", "olmo2"],
    "encoder": ["bert", "roberta", "bert_multiple_choice", "electra", "distilbert", "deberta_v2", "modernbert",
                "albert"],
    "enc-dec": ["t5", "flan_t5", "umt5", "bart", "bart_classifier", "mbart", "marian", "pegasus", "bert2bert",
                "vit_gpt2"],
    "MoE": ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "deepseek_v3", "gpt_oss"],
    "speech": ["whisper", "wav2vec2_bert", "speech_to_text", "wav2vec2", "hubert", "wavlm"],
    "vision-timm": ["timm_vit", "timm_swin", "timm_hiera_160", "timm_mixer_160", "timm_vit_160", "timm_convnext",
                    "timm_eva02", "timm_deit", "timm_beit", "timm_pvt_v2"],
    "vision-HF": ["vit", "clip_vision", "dinov2"],
    "dual": ["clip", "siglip"],
}


def registry() -> dict[str, Callable[[], nn.Module]]:
    """Every family of the conversion matrix: name → builder of a tiny random-init model."""
    return {**FAMILIES, **PROBE_FAMILIES, **MORE_FAMILIES}


def group_of(name: str) -> str:
    return next((g for g, names in GROUPS.items() if name in names), "other")


def lora_on_every_linear(model: nn.Module, seed: int = 2) -> nn.Module:
    """PEFT LoRA (r 4, alpha 8) on every plain ``nn.Linear``, PEFT's default initialisation (B = 0) drawn under
    ``seed``: the adapters the conversion tests put on a family."""
    from peft import LoraConfig, get_peft_model

    targets = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
