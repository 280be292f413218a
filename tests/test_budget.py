"""checkpoint_for_budget: it checkpoints as few layers as the budget needs, its prediction is the ledger's count
(exactly where layers take positional inputs only; plus the keyword inputs a checkpoint holds by reference
otherwise), gradients are unchanged, it refuses an impossible budget with the model untouched, and undo()
restores the layers."""
import copy

import pytest
import torch
from torch import nn

from lmbp_convert import ActivationBudget, BudgetError, LmbpError, SavedTensorLedger, checkpoint_for_budget, convert
from lmbp_convert.budget import find_layers
from testsupport.families import hf


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a, self.b = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class Stack(nn.Module):
    def __init__(self, d=16, n=4):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        x = self.inp(x)
        for blk in self.blocks:
            x = blk(x)
        return self.out(x)


def _ledger(model, probe):
    with SavedTensorLedger(model) as led:
        out = model(**probe) if isinstance(probe, dict) else model(probe)
    del out
    return led.bytes


def _grads(model, probe):
    model.zero_grad(set_to_none=True)
    out = model(**probe) if isinstance(probe, dict) else model(probe)
    (out.loss if hasattr(out, "loss") else out.pow(2).mean()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_positional_layers_predict_the_ledger_exactly():
    torch.manual_seed(0)
    model, x = Stack().train(), torch.randn(8, 16)
    d, n = 16, 4
    blk = 8 * (d + 4 * d) * 4  # a block saves x (for a) and tanh(a(x)) (for tanh and b): fp32, 8 rows
    full = checkpoint_for_budget(model, 10 ** 9, x)
    assert full.checkpointed == [] and [r.kept for r in full.layers] == [blk] * n
    assert [r.checkpointed for r in full.layers] == [8 * d * 4] * n  # a checkpoint holds the block's input
    full.undo()
    saves = blk - 8 * d * 4  # checkpointing a block keeps its input only
    assert [c[:2] for c in full.choices] == [(k, full.bytes_without - k * saves) for k in range(n + 1)]
    for k in range(n + 1):  # the bytes of k checkpointed blocks (k < n), or just below those of n - 1 (k = n)
        budget = full.bytes_without - k * saves if k < n else full.bytes_without - (n - 1) * saves - 1
        plan = checkpoint_for_budget(model, budget, x)
        assert len(plan.checkpointed) == k, str(plan)
        assert plan.predicted_bytes == plan.measured_bytes == _ledger(model, x)
        assert plan.predicted_peak_bytes <= plan.budget_bytes
        assert plan.recompute_fraction == len(plan.checkpointed) / n
        plan.undo()


@pytest.mark.parametrize("converted", [False, True])
def test_meets_the_budget_by_the_ledger_and_keeps_gradients(converted):
    model = hf("llama", num_hidden_layers=4).train()
    if converted:
        convert(model)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    probe = {"input_ids": ids, "labels": ids}
    want = _grads(model, probe)
    plain = _ledger(model, probe)
    first = checkpoint_for_budget(model, plain, probe)
    assert first.checkpointed == [] and first.bytes_without >= plain
    first.undo()
    budget = (first.bytes_without + first.bytes_all) // 2
    plan = checkpoint_for_budget(model, budget, probe)
    assert isinstance(plan, ActivationBudget) and 0 < len(plan.checkpointed) < 4, str(plan)
    assert plan.predicted_peak_bytes <= budget
    measured = _ledger(model, probe)
    assert measured == plan.measured_bytes <= plan.predicted_bytes < plain
    got = _grads(model, probe)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    plan.undo()
    assert _ledger(model, probe) == plain
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)


def test_an_impossible_budget_is_refused_untouched():
    model = hf("llama", num_hidden_layers=2).train()
    ids = torch.randint(0, 128, (2, 16))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(BudgetError, match="cannot be met") as err:
        checkpoint_for_budget(model, 1000, {"input_ids": ids})
    assert isinstance(err.value, LmbpError)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="budget_bytes"):
        checkpoint_for_budget(model, -1, {"input_ids": ids})


def test_layers_are_found_and_checked():
    model = hf("llama", num_hidden_layers=3)
    where, layers = find_layers(model)
    assert where == "model.layers" and layers == list(model.model.layers)
    with pytest.raises(BudgetError, match="no list of repeated layers"):
        find_layers(nn.Linear(2, 2))
    torch.manual_seed(0)
    stack, x = Stack(), torch.randn(4, 16)
    shared = Stack()
    shared.blocks = nn.ModuleList([stack.blocks[0]] * 4)  # one module run four times
    with pytest.raises(BudgetError, match="ran 4 times"):
        checkpoint_for_budget(shared, 10 ** 9, x, layers=[shared.blocks[0]])
    with pytest.raises(ValueError, match="submodules"):
        checkpoint_for_budget(stack, 10 ** 9, x, layers=[nn.Linear(2, 2)])


def test_twice_without_undo_is_refused_and_deepcopy_binds_the_copy():
    torch.manual_seed(0)
    model, x = Stack().train(), torch.randn(4, 16)
    plan = checkpoint_for_budget(model, checkpoint_for_budget(model, 10 ** 9, x).bytes_without - 1, x)
    assert plan.checkpointed
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for p in copied.parameters():
            p.add_(1.0)
    assert not torch.equal(copied(x), model(x))  # the copy's layers run the copy's weights
    with pytest.raises(BudgetError, match="already checkpointed"):
        checkpoint_for_budget(model, 10 ** 9, x)
    plan.undo()
