"""lmbp-convert on an MoE checkpoint whose experts transformers ≥ 5 holds as 3-D parameters: the norm before the
experts folds into the router and into every expert's stored tensors (saved per expert, ``experts.{e}.w1.weight``
…, and stacked into ``gate_up_proj`` at load time), and plain transformers loads DST with SRC's outputs."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from lmbp_convert import convert
from lmbp_convert.fold import fold_affine

MIXTRAL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=96, num_local_experts=3, num_experts_per_tok=2,
               tie_word_embeddings=False)


def _tensors(root):
    out = {}
    for p in sorted(root.glob("*.safetensors")):
        with safe_open(p, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_cli_folds_the_norm_into_stored_expert_tensors_and_the_router(tmp_path, cli):
    from transformers import AutoConfig, AutoModelForCausalLM

    from ckpt_helpers import save_model

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("mixtral", **MIXTRAL)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for m in model.modules():
            if "norm" in type(m).__name__.lower():
                m.weight.copy_(torch.rand(m.weight.shape) + 0.5)
    src, dst = tmp_path / "src", tmp_path / "dst"
    save_model(model, src)
    s = _tensors(src)
    if "model.layers.0.block_sparse_moe.experts.0.w1.weight" not in s:
        pytest.skip("this transformers stores MoE experts in another layout")
    rc, out, err = cli(src, dst)
    assert rc == 0, err
    assert "post_attention_layernorm [rms, w] -> model.layers.0.mlp.experts.gate_up_proj, model.layers.0.mlp.gate" \
        in out, out
    d = _tensors(dst)
    gamma = s["model.layers.0.post_attention_layernorm.weight"]
    for e in range(3):  # gate (w1) and up (w3) take γ along their input dim; down (w2) reads the product: untouched
        for w in ("w1", "w3"):
            k = f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"
            assert torch.equal(d[k], fold_affine(s[k], None, gamma, None)[0]), k
        k = f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight"
        assert torch.equal(d[k], s[k])
    k = "model.layers.0.block_sparse_moe.gate.weight"
    assert torch.equal(d[k], fold_affine(s[k], None, gamma, None)[0])
    assert torch.all(d["model.layers.0.post_attention_layernorm.weight"] == 1)

    plain_src = AutoModelForCausalLM.from_pretrained(src).eval()
    plain_dst = AutoModelForCausalLM.from_pretrained(dst).eval()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = plain_src(input_ids=ids).logits, plain_dst(input_ids=ids).logits
    assert float((a - b).norm() / a.norm()) <= 1e-5
    report = convert(plain_dst).lmbp_report  # on DST the norm is only swapped: its weights are folded already
    fold = next(f for f in report.plan.norm_folds if f.name == "model.layers.0.post_attention_layernorm")
    assert fold.prefolded and report.verified, str(report)
