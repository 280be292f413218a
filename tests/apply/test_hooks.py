from collections import namedtuple

import torch
from torch import nn

from lmbp_convert.apply.hooks import ReapplyInput, ReapplyOutput


class _Norm(nn.Module):
    def __init__(self, param="w"):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([2.0, 3.0]))
        self.bias = nn.Parameter(torch.tensor([1.0, -1.0]))
        self.param = param  # the declared field the re-apply hooks read (as on `_MSNorm`)


def test_input_hook_positional_and_keyword():
    norm = _Norm()
    x = torch.ones(1, 2)
    args, kwargs = ReapplyInput(norm, 1, None)(None, (x, x), {})
    assert torch.equal(args[0], x) and torch.equal(args[1], torch.tensor([[3.0, 2.0]]))
    args, kwargs = ReapplyInput(norm, None, "h")(None, (), {"h": x})
    assert torch.equal(kwargs["h"], torch.tensor([[3.0, 2.0]]))
    assert ReapplyInput(norm, None, "missing")(None, (), {"h": x}) is None


def test_output_hook_dict_tuple_namedtuple_and_one_plus_w():
    norm = _Norm("1+w")
    x = torch.ones(1, 2)
    out = ReapplyOutput(norm, [["a"]])(None, (), {"a": x, "b": x})
    assert torch.equal(out["a"], torch.tensor([[4.0, 3.0]])) and torch.equal(out["b"], x)
    out = ReapplyOutput(norm, [[1]])(None, (), (x, x))
    assert isinstance(out, tuple) and torch.equal(out[1], torch.tensor([[4.0, 3.0]]))
    Pair = namedtuple("Pair", "p q")
    out = ReapplyOutput(norm, [[0]])(None, (), Pair(x, x))
    assert isinstance(out, Pair) and torch.equal(out.p, torch.tensor([[4.0, 3.0]]))


def _toy_model_output_class():
    from dataclasses import dataclass

    from transformers.utils import ModelOutput

    @dataclass
    class Out(ModelOutput):
        a: torch.Tensor | None = None
        b: torch.Tensor | None = None

    return Out


class _Cfg:
    return_dict = True


class _DictOrTuple(nn.Module):
    """Returns a ModelOutput or its tuple, as a transformers model does (``return_dict`` / config)."""

    out_cls = None

    def __init__(self):
        super().__init__()
        self.config = _Cfg()

    def forward(self, x, return_dict=None):
        rd = self.config.return_dict if return_dict is None else return_dict
        out = type(self).out_cls(a=x, b=x + 1)
        return out if rd else out.to_tuple()


def test_output_hooks_put_the_affine_back_whatever_container_the_caller_asks_for():
    import copy

    from lmbp_convert.apply.hooks import register_output_reapply

    _DictOrTuple.out_cls = _toy_model_output_class()
    model, norm_a, norm_b = _DictOrTuple(), _Norm(), _Norm("1+w")
    register_output_reapply(model, ReapplyOutput(norm_a, [["a"]]))  # two folds: their hooks nest
    register_output_reapply(model, ReapplyOutput(norm_b, [["b"]]))
    x = torch.ones(1, 2)
    want_a, want_b = torch.tensor([[3.0, 2.0]]), torch.tensor([[7.0, 7.0]])
    for m in (model, copy.deepcopy(model)):
        d = m(x)
        assert torch.equal(d["a"], want_a) and torch.equal(d["b"], want_b)
        t = m(x, return_dict=False)
        assert isinstance(t, tuple) and torch.equal(t[0], want_a) and torch.equal(t[1], want_b)
        m.config.return_dict = False
        t = m(x)
        assert isinstance(t, tuple) and torch.equal(t[0], want_a) and torch.equal(t[1], want_b)
        m.config.return_dict = True


def test_add_shift_adds_w_beta_and_keeps_gradients():
    from lmbp_convert.apply.hooks import AddShift

    norm = _Norm()
    lin = nn.Linear(2, 3, bias=False)
    lin.register_forward_hook(AddShift(norm, "out_in"))
    x = torch.randn(4, 2)
    y = lin(x)
    torch.testing.assert_close(y, x @ lin.weight.T + lin.weight @ norm.bias)
    y.sum().backward()
    assert norm.bias.grad is not None and lin.weight.grad is not None
    # behind_scale: the norm holds γ, β (re-applied elsewhere) and the Linear adds W'·β/γ
    lin2 = nn.Linear(2, 3, bias=False)
    lin2.register_forward_hook(AddShift(norm, "out_in", behind_scale=True))
    torch.testing.assert_close(lin2(x), x @ lin2.weight.T + lin2.weight @ (norm.bias / norm.weight))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = _Norm()
        self.head = nn.Linear(2, 3, bias=False)

    def forward(self, x):
        return self.head(x)


def test_fold_hooks_follow_a_replaced_module_and_refuse_one_they_cannot_act_on():
    """A shift hook lives on a module object; a module replaced at its path after convert() (a resized head)
    takes the hook with it at the next root call, and rollback removes it from wherever it is."""
    import pytest

    from lmbp_convert import ReplacedModuleError
    from lmbp_convert.apply.hooks import AddShift, FollowModule

    net, x = _Net(), torch.ones(1, 2)
    shift = AddShift(net.norm, "out_in")
    handles = FollowModule(net, "head", shift, pre=False).attach(net)
    new = nn.Linear(2, 5, bias=False)  # a wider vocabulary, same input width
    net.head = new
    assert torch.allclose(net(x), new.weight @ (x[0] + net.norm.bias))
    handles.remove()
    assert torch.allclose(net(x), new.weight @ x[0])  # removed from the module it moved to
    FollowModule(net, "head", shift, pre=False).attach(net)
    net.head = nn.Identity()
    with pytest.raises(ReplacedModuleError, match="'head' was replaced after convert"):
        net(x)


def test_reapply_follows_a_replaced_module():
    from lmbp_convert.apply.hooks import FollowModule

    net, x = _Net(), torch.ones(1, 2)
    FollowModule(net, "head", ReapplyInput(net.norm, 0, None), pre=True).attach(net)
    net.head = nn.Identity()  # a head reset after convert: the features it returns carry the affine
    assert torch.equal(net(x), torch.tensor([[3.0, 2.0]]))
