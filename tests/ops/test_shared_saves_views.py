"""Shared saves rebuild what autograd recorded: every view and split a saved copy may sit behind, each output of a
multi-output node, and autograd's in-place check on everything the region keeps."""
import pytest
import torch

from lmbp_convert import SavedTensorLedger
from lmbp_convert.ops.shared_saves import note, note_identity
from testsupport.regions import open_region

B, T, D = 3, 6, 8

#: a view (or split output) of y, as a reader's op chain may hold it before a copy
VIEWS = {
    "slice_negative_end": lambda y: y[:, :-1],
    "slice_negative_start": lambda y: y[:, -4:],
    "slice_stepped": lambda y: y[:, 1::2],
    "slice_omitted": lambda y: y[:, :],
    "select_negative": lambda y: y.select(1, -1),
    "narrow": lambda y: y.narrow(2, 1, 5),
    "unfold": lambda y: y.unfold(1, 2, 2),
    "expand": lambda y: y[:, :1].expand(-1, 5, -1),
    "transpose": lambda y: y.transpose(0, 2),
    "permute": lambda y: y.permute(2, 0, 1),
    "movedim": lambda y: y.movedim(0, -1),
    "t": lambda y: y[0].t(),
    "diagonal": lambda y: y.diagonal(0, 1, 2),
    "as_strided": lambda y: y.as_strided((2, 3, 4), (D, 2 * D, 1), 5),
    "unsqueeze_squeeze": lambda y: y[:, :1].squeeze(1).unsqueeze(0),
    "unbind_last": lambda y: y.unbind(1)[-1],
    "chunk_second": lambda y: y.chunk(2, -1)[1],
    "split_tail": lambda y: y.split(4, 1)[1],
    "split_with_sizes": lambda y: torch.split(y, [1, 5], 1)[1],
    "view_as_complex_real": lambda y: torch.view_as_real(torch.view_as_complex(y.reshape(B, T, D // 2, 2))),
}


def _grads(view, region_open: bool):
    """x's and c's gradients of ``(view(y).double() * c).sum()``, y = 2x noted (rebuilt from x) where the region
    is open: the saved fp64 copy of the view is then a recipe. Also the recipes made and the bytes saved."""
    torch.manual_seed(0)
    x = torch.randn(B, T, D, requires_grad=True)
    c = torch.randn((), dtype=torch.float64, requires_grad=True)
    with SavedTensorLedger([c, x]) as led:  # x: kept anyway, as a norm's x̂ is
        with open_region(region_open) as region:
            y = x * 2.0
            note(y, lambda t: t * 2.0, x)
            loss = (view(y).double() * c).sum()
            recipes = region.recipes
    loss.backward()
    return x.grad, c.grad, recipes, led.bytes


@pytest.mark.parametrize("name", VIEWS)
def test_a_copy_behind_any_recorded_view_is_rebuilt_bitwise(name):
    gx, gc, _, plain = _grads(VIEWS[name], region_open=False)
    rx, rc, recipes, shared = _grads(VIEWS[name], region_open=True)
    assert recipes == 1
    assert torch.equal(rx, gx) and torch.equal(rc, gc)
    assert plain == VIEWS[name](torch.empty(B, T, D)).numel() * 8 and shared == 0  # the fp64 copy: a recipe


@pytest.mark.parametrize("split", ["chunk", "split", "unbind", "split_with_sizes"])
def test_each_output_of_a_multi_output_node_is_its_own_note(split):
    """Two adapters fed by two outputs of one node (``h.chunk(2, -1)``): each output's up-cast copy is rebuilt from
    that output, not from the first one noted on the node."""
    parts = {"chunk": lambda h: h.chunk(2, -1), "split": lambda h: h.split(4, -1),
             "unbind": lambda h: h.view(B, T, 2, 4).unbind(-2), "split_with_sizes": lambda h: h.split([4, 4], -1)}
    torch.manual_seed(0)
    x = torch.randn(B, T, D, dtype=torch.bfloat16, requires_grad=True)
    a = [torch.randn(4, 4, requires_grad=True) for _ in range(2)]

    def run(region_open):
        for p in a:
            p.grad = None
        with open_region(region_open) as region:
            outs = parts[split](x * 1)
            for o in outs:
                note_identity(o)
            loss = sum((o.float() @ p.t()).pow(2).sum() for o, p in zip(outs, a))
            recipes = region.recipes
        loss.backward()
        return [p.grad.clone() for p in a], recipes

    ref, _ = run(False)
    got, recipes = run(True)
    assert recipes == 2
    assert all(torch.equal(g, r) for g, r in zip(got, ref))


def test_a_tensor_kept_as_it_is_keeps_autograds_inplace_check():
    """Without the region autograd raises for a weight edited between forward and backward; through the region's
    hooks it would not check at all: the region checks it."""
    w = torch.randn(D, D, requires_grad=True)
    x = torch.randn(B, D, requires_grad=True)
    for region_open in (False, True):
        with open_region(region_open):
            loss = (x * 1 @ w).sum()
        with torch.no_grad():
            w.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_an_edited_source_of_a_recipe_raises():
    x = torch.randn(B, D, requires_grad=True)
    c = torch.randn((), dtype=torch.float64, requires_grad=True)
    with open_region():
        src = x * 1
        y = src * 2.0
        note(y, lambda t: t * 2.0, src)
        loss = (y.double() * c).sum() + (src * src).sum()
    with torch.no_grad():
        src.add_(1)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: \[torch.FloatTensor \[3, 8\]\]"):
        loss.backward()


def test_under_enclosing_hooks_the_check_is_theirs():
    """An enclosing pair (save_on_cpu, a ledger) decides, as it would without the region: save_on_cpu's copy makes an
    edit of the original harmless, and the region adds no check of its own."""
    w = torch.randn(D, D, requires_grad=True)
    x = torch.randn(B, D, requires_grad=True)
    with torch.autograd.graph.save_on_cpu():
        with open_region():
            loss = (x * 1 @ w).sum()
    with torch.no_grad():
        w.add_(1)
    loss.backward()
    assert x.grad is not None
