"""The norm matcher's three steps on a traced graph, each with its typed result: walk (readers of the
normalised tensor) → re-apply sites → byte prediction."""
import pytest
import torch
from torch import nn

from lmbp_convert.catalogue import load_catalogue
from lmbp_convert.enums import BetaMode, Layout, ReapplyKind
from lmbp_convert.match.context import MatchContext
from lmbp_convert.match.norm import plan_norm, predicted_norm_bytes, reapply_sites
from lmbp_convert.match.norm_walk import Reader, Refused, walk_readers
from lmbp_convert.match.roles import assign_roles, is_leaf_factory
from lmbp_convert.options import ConvertOptions
from lmbp_convert.trace.tracer import trace


class Residual(nn.Module):
    def forward(self, a, b):
        return a + b


class PostLN(nn.Module):
    def __init__(self, tail: bool = False):
        super().__init__()
        self.norm, self.fc, self.res, self.tail = nn.LayerNorm(8), nn.Linear(8, 8), Residual(), tail

    def forward(self, x):
        h = self.norm(x)
        y = self.res(self.fc(h.view(-1, 8)), h.view(-1, 8))
        return y + h.view(-1, 8) if self.tail else y  # tail: read with no module boundary of its own


def _context(model, x):
    roles = assign_roles(model, load_catalogue())
    graph, _ = trace(model, x, is_leaf_factory(model, roles))
    return MatchContext(model, graph, roles, ConvertOptions(activations=False, gated_mlp=False)), roles


def test_walk_sites_and_bytes_are_typed_steps():
    model, x = PostLN(), torch.randn(2, 3, 8)
    ctx, roles = _context(model, x)
    (node,) = ctx.g.module_nodes("norm")
    walk = walk_readers(ctx, node.outputs[0], roles["norm"].norm)
    assert list(walk.targets) == ["fc"] and walk.targets["fc"].layout is Layout.OUT_IN
    assert walk.targets["fc"].via == ["view"] and not walk.inplace and not walk.blocks
    assert [(type(r), r.what) for r in walk.others] == [(Reader, "add in res")]
    (site,) = reapply_sites(ctx, walk)
    assert (site.kind, site.module, site.position) == (ReapplyKind.MODULE_INPUT, "res", 1)
    # LayerNorm: the input (6 rows × 8 fp32) is no longer kept, nor the per-row mean
    assert predicted_norm_bytes(ctx, node, roles["norm"].norm) == 6 * 8 * 4 + 6 * 4
    fold = plan_norm(ctx, "norm", model.norm, roles["norm"].norm)
    assert fold.reapply == [site] and fold.beta is BetaMode.FOLD and fold.predicted_saved_bytes == 216


def test_a_reader_without_a_module_boundary_is_refused_with_its_reason():
    model, x = PostLN(tail=True), torch.randn(2, 3, 8)
    ctx, roles = _context(model, x)
    with pytest.raises(Refused, match="output also feeds add in <model>, and there is no module boundary"):
        plan_norm(ctx, "norm", model.norm, roles["norm"].norm)
