"""The checkpoint CLI and functional consumers (`ConsumerFold`): a fold it cannot write on disk (rows of
nn.MultiheadAttention's in_proj) is a skip with that reason, and convert() still folds it when it loads DST."""
import copy

import pytest
import torch

from ckpt_helpers import save_model
from lmbp_convert import convert
from lmbp_convert.match.consumers import ConsumerFold
from testsupport.families import randomize_norms


def _siglip():
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    cfg = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                             image_size=16, patch_size=8)
    return randomize_norms(SiglipVisionModel(cfg)).eval()


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_mha_rows_are_refused_on_disk_and_folded_by_convert_on_load(tmp_path, cli):
    from transformers import SiglipVisionModel

    src = save_model(_siglip(), tmp_path / "src")
    rc, out, err = cli(src, tmp_path / "dst")
    assert rc == 0, err
    assert ("skip post_layernorm: head.attention.in_proj_weight[32:64] via multi_head_attention_forward in "
            "head.attention (+β into head.attention.in_proj_bias): the on-disk fold rewrites whole weights, not a "
            "block of rows; convert() folds it when it loads the model") in out
    ref = SiglipVisionModel.from_pretrained(src).eval()
    model = SiglipVisionModel.from_pretrained(tmp_path / "dst").eval()
    x = torch.randn(2, 3, 16, 16)
    rep = convert(model, probe=x, activations=False, fold_norms=True).lmbp_report
    assert [f.name for f in rep.plan.of(ConsumerFold)] == ["post_layernorm"]
    with torch.no_grad():
        a, b = model(x).pooler_output, copy.deepcopy(ref)(x).pooler_output
    assert float((a - b).norm() / b.norm()) < 1e-5
