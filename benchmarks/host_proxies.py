"""The training-step proxies `benchmarks.host` times: a real model's modules at tiny width, original or converted,
one LoRA step with AdamW (`PROXIES`), and the step itself (`train_step`). Split from host.py: which models and
steps are measured here, how they are timed and reported there.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import common as C

#: The proxy's ViT: timm ViT-B/16's 12 blocks and module structure at width 96 (12 heads of 8), 32 px (5 tokens).
PROXY_VIT = dict(depth=12, embed_dim=96, num_heads=12, mlp_ratio=4.0, img_size=32, num_classes=10)
PROXY_BATCH = 2


@dataclass(frozen=True)
class Proxy:
    """One training-step proxy: a real model's modules at tiny width, original or converted, one LoRA step.

    ``build(convert)`` returns the model in train mode (converted on the PyTorch path before LoRA, as a user
    does); ``inputs()`` one batch; ``loss(model, batch)`` the step's loss; ``autocast``: forward under bf16
    autocast (fp32 weights) rather than in the weights' dtype.
    """
    key: str
    title: str
    shape: str
    build: Callable[[bool], nn.Module]
    inputs: Callable[[], tuple]
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    autocast: bool


def _vit_lora(convert_: bool) -> nn.Module:
    import peft
    import timm
    from lmbp_convert import convert

    C.quiet()
    m = C.cheap_init(timm.create_model("vit_base_patch16_224", pretrained=False, **PROXY_VIT))
    if convert_:
        convert(m)  # on the PyTorch path (convert() verifies values; the stub computes none)
    cfg = peft.LoraConfig(r=4, lora_alpha=4, lora_dropout=0.0, target_modules=["qkv"], modules_to_save=["head"])
    return peft.get_peft_model(m, cfg).train()


def _vit_inputs() -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(PROXY_BATCH, 3, PROXY_VIT["img_size"], PROXY_VIT["img_size"], generator=g),
            torch.randint(0, PROXY_VIT["num_classes"], (PROXY_BATCH,), generator=g))


def _vit_loss(m: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(m(x).float(), y)


#: LLaMA-7B's block structure (RMSNorm, SwiGLU MLP at 11008/4096 ≈ 2.7×, rotary attention) at width 64, 4 heads
#: of 16, 8 blocks; bf16 weights as benchmarks.speed's LLaMA slice; PEFT LoRA r8 on every projection (q, k, v,
#: o, gate, up, down): the common LLaMA LoRA/QLoRA recipe, and the one that sends down through the fused
#: LoRA path of MSGatedMLP.
PROXY_LLAMA = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=8, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False,
                   use_cache=False)
#: BERT-base's post-LN encoder (12 layers, 12 heads, 4× MLP, GELU, pooler, classifier) at width 96; dropout 0
#: as benchmarks.speed's BERT rows; PEFT LoRA r4 on query and value, classifier trained; bf16 autocast.
PROXY_BERT = dict(hidden_size=96, intermediate_size=384, num_hidden_layers=12, num_attention_heads=12,
                  vocab_size=256, max_position_embeddings=64, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, num_labels=4)
PROXY_SEQ = 8


def _hf_lora(model_type: str, auto: str, cfg_kw: dict, dtype: torch.dtype, lora: dict) -> Callable[[bool], nn.Module]:
    def build(convert_: bool) -> nn.Module:
        import peft
        import transformers
        from lmbp_convert import convert

        C.quiet()
        cfg = transformers.AutoConfig.for_model(model_type, **cfg_kw)
        m = C.cheap_init(getattr(transformers, auto)(cfg)).to(dtype)
        if convert_:
            convert(m)
        return peft.get_peft_model(m, peft.LoraConfig(lora_dropout=0.0, **lora)).train()

    return build


def _token_inputs(vocab: int, labels: int | None) -> Callable[[], tuple]:
    def inputs() -> tuple:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (PROXY_BATCH, PROXY_SEQ), generator=g)
        return ids, (ids if labels is None else torch.randint(0, labels, (PROXY_BATCH,), generator=g))

    return inputs


def _hf_loss(m: nn.Module, batch: tuple) -> torch.Tensor:
    ids, labels = batch
    return m(input_ids=ids, labels=labels).loss


PROXIES: dict[str, Proxy] = {p.key: p for p in (
    Proxy("vit", "ViT-B/16 LoRA r4 step proxy",
          f"timm vit_base_patch16_224 modules: {PROXY_VIT['depth']} blocks, width {PROXY_VIT['embed_dim']}, "
          f"{PROXY_VIT['num_heads']} heads, {PROXY_VIT['img_size']} px, batch {PROXY_BATCH}; PEFT LoRA r4 on qkv, "
          "head trained, AdamW, bf16 autocast", _vit_lora, _vit_inputs, _vit_loss, True),
    Proxy("llama", "LLaMA decoder LoRA r8 step proxy",
          f"transformers LlamaForCausalLM: {PROXY_LLAMA['num_hidden_layers']} blocks, width "
          f"{PROXY_LLAMA['hidden_size']}, MLP {PROXY_LLAMA['intermediate_size']}, {PROXY_LLAMA['num_attention_heads']}"
          f" heads, batch {PROXY_BATCH} × {PROXY_SEQ} tokens, bf16 weights; PEFT LoRA r8 on q, k, v, o, gate, up, "
          "down; AdamW",
          _hf_lora("llama", "LlamaForCausalLM", PROXY_LLAMA, torch.bfloat16,
                   dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"])),
          _token_inputs(PROXY_LLAMA["vocab_size"], None), _hf_loss, False),
    Proxy("bert", "BERT-base (post-LN) LoRA r4 step proxy",
          f"transformers BertForSequenceClassification: {PROXY_BERT['num_hidden_layers']} layers, width "
          f"{PROXY_BERT['hidden_size']}, {PROXY_BERT['num_attention_heads']} heads, batch {PROXY_BATCH} × "
          f"{PROXY_SEQ} tokens, dropout 0; PEFT LoRA r4 on query, value, classifier trained; AdamW, bf16 autocast",
          _hf_lora("bert", "BertForSequenceClassification", PROXY_BERT, torch.float32,
                   dict(r=4, lora_alpha=4, target_modules=["query", "value"], modules_to_save=["classifier"])),
          _token_inputs(PROXY_BERT["vocab_size"], PROXY_BERT["num_labels"]), _hf_loss, True),
)}


def pair(proxy: Proxy) -> tuple[dict[str, nn.Module], tuple]:
    """Original and converted model with the same LoRA init (values do not matter: the kernels never run)."""
    orig, conv = proxy.build(False), proxy.build(True)
    conv.load_state_dict(copy.deepcopy(orig.state_dict()), strict=False)
    return {"original": orig, "converted": conv}, proxy.inputs()


def proxy_autocast(proxy: Proxy):
    return torch.autocast("cpu", dtype=torch.bfloat16) if proxy.autocast else contextlib.nullcontext()


def finite_grads(params: list[torch.Tensor]) -> None:
    """Zero the gradients before the optimizer runs, in both models alike.

    Why: the stub's kernels never write their outputs, so the converted model's gradients are garbage, soon NaN,
    and so are its parameters after one AdamW step; AdamW's arithmetic on NaN runs ~35 % slower on some CPUs
    (measured: +2.9 ms of a BERT full fine-tuning step), an artefact no GPU shows. Zeroed, the optimizer does the
    same work on finite numbers in both models (one foreach call each)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_zero_(grads)


def train_step(proxy: Proxy, m: nn.Module, batch: tuple) -> Callable[[], None]:
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step() -> None:
        with proxy_autocast(proxy):
            loss = proxy.loss(m, batch)
        loss.backward()
        finite_grads(params)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def lmbp_modules(m: nn.Module) -> int:
    from lmbp_convert.enums import ConvertedModule

    return sum(isinstance(mod, ConvertedModule) for mod in m.modules())


def lmbp_hooks(m: nn.Module) -> int:
    from lmbp_convert.enums import ConvertedHook

    return sum(isinstance(h, ConvertedHook) or isinstance(getattr(h, "__self__", None), ConvertedHook)
               for mod in m.modules() for d in (mod._forward_hooks, mod._forward_pre_hooks) for h in d.values())
