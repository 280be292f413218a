"""Export of folds into functional consumers (`ConsumerFold`): a plain checkpoint computes what the converted
model computes — unfolding in_proj rows and conv input channels where the norm's affine is re-applied elsewhere —
or ExportError says why it cannot (a share of β in a buffer no state dict holds)."""
import copy

import pytest
import torch
from torch import nn

from lmbp_convert import convert
from lmbp_convert.export import ExportError, plain_state_dict, saves_plainly
from lmbp_convert.match.consumers import ConsumerFold
from testsupport.families import randomize_norms

D = 32


class ReturnsNorm(nn.Module):
    """The norm's output is returned (affine re-applied there) and read by an MHA's key/value and a strided conv."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.query = nn.Parameter(torch.randn(1, 2, D))
        self.sr = nn.Conv2d(D, D, 2, stride=2)

    def forward(self, x):
        h = self.norm(x)
        a = self.attn(self.query.expand(x.shape[0], -1, -1), h, h, need_weights=False)[0]
        s = self.sr(h.transpose(1, 2).reshape(x.shape[0], D, 4, 4)).flatten(2).mean(-1)
        return h, a.sum(1) + s


def _train_a_step(model, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = model(x)
    (out[0].pow(2).mean() + out[1].pow(2).mean()).backward()
    opt.step()


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_reapplied_norm_unfolds_in_proj_rows_and_conv_channels_after_training():
    torch.manual_seed(0)
    model, x = randomize_norms(ReturnsNorm()), torch.randn(2, 16, D)
    rep = convert(model, probe=x, activations=False, fold_norms=True).lmbp_report
    (fold,) = rep.plan.of(ConsumerFold)
    assert fold.reapply and {p.op for p in fold.params} == {"multi_head_attention_forward", "conv2d"}
    _train_a_step(model, x)  # γ, β (kept: re-applied on the output) and the folded weights all move
    assert not saves_plainly(model)
    plain = ReturnsNorm()
    plain.load_state_dict(plain_state_dict(model))
    with torch.no_grad():
        for a, b in zip(model(x), plain(x)):
            assert float((a - b).norm() / b.norm()) < 1e-5


@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_beta_share_in_an_unsaved_buffer_is_an_export_error():
    import sys

    sys.path.insert(0, "tests/match")
    from test_consumers import FusedQKV

    torch.manual_seed(0)
    model, x = randomize_norms(FusedQKV()), torch.randn(2, 6, D)
    convert(model, probe=x, activations=False, fold_norms=True)
    assert not saves_plainly(model)
    with pytest.raises(ExportError, match="k_bias, a buffer no state dict holds"):
        plain_state_dict(model)
    torch.manual_seed(0)
    model = randomize_norms(FusedQKV(bias_buffer_persistent=True))
    ref = copy.deepcopy(model)
    convert(model, probe=x, activations=False, fold_norms=True)
    plain = FusedQKV(bias_buffer_persistent=True)
    plain.load_state_dict(plain_state_dict(model))
    with torch.no_grad():
        assert float((plain(x) - ref(x)).norm() / ref(x).norm()) < 1e-5
