"""The activation matcher: squared ReLU is found by behaviour (whatever the class) and swapped for the op whose
backward keeps only its output; modules that compute it only on the trace's inputs, or not exactly, are not."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmbp_convert import convert, plan_conversion
from lmbp_convert.match.plan import OutputActSwap

D, H = 8, 32


class PrimerReLU2(nn.Module):
    """Written as Primer's code does: not a class any catalogue lists."""

    def forward(self, x):
        return F.relu(x) ** 2


class NoisyReLU2(nn.Module):
    def forward(self, x):
        y = torch.square(torch.relu(x))
        return y + 0.01 * torch.randn_like(y) if self.training else y


class ClampedReLU2(nn.Module):
    def forward(self, x):
        return torch.square(torch.relu(x)).clamp(max=1e4)  # differs only on large inputs


class GuardedReLU2(nn.Module):
    def forward(self, x):
        return torch.square(torch.relu(torch.nan_to_num(x)))


class MLP(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(D, H), act, nn.Linear(H, D)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


X = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(0))


def _plan(act):
    return plan_conversion(MLP(act), probe=X, norms=False, gated_mlp=False)


@pytest.mark.parametrize("act", [PrimerReLU2, "transformers"], ids=["primer", "transformers"])
def test_squared_relu_is_found_by_behaviour(act):
    if act == "transformers":
        from transformers.activations import ReLUSquaredActivation as act
    plan = _plan(act())
    (item,) = plan.of(OutputActSwap)
    assert item.name == "act" and item.act == "relu2"
    assert item.predicted_saved_bytes == 2 * 5 * H * 4  # relu(x), fp32: the down projection keeps the output
    assert "keeps only its output" in "\n".join(item.describe())


@pytest.mark.parametrize("act", [NoisyReLU2, ClampedReLU2, GuardedReLU2, nn.ReLU], ids=lambda c: c.__name__)
def test_what_is_not_exactly_squared_relu_is_left_alone(act):
    plan = _plan(act())
    assert not plan.of(OutputActSwap), plan.items


def test_converted_mlp_is_exact_and_keeps_one_tensor_less():
    from lmbp_convert import SavedTensorLedger

    model = MLP(PrimerReLU2())
    ref = MLP(PrimerReLU2())
    ref.load_state_dict(model.state_dict())
    rep = convert(model, probe=X, norms=False, gated_mlp=False).lmbp_report
    assert rep.verified and type(model.act).__name__ == "MSReLUSquared"
    x1, x2 = X.clone().requires_grad_(), X.clone().requires_grad_()
    with SavedTensorLedger(ref) as before:
        ref(x1).pow(2).sum().backward()
    with SavedTensorLedger(model) as after:
        model(x2).pow(2).sum().backward()
    assert before.bytes - after.bytes == 2 * 5 * H * 4
    assert torch.equal(x1.grad, x2.grad)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), model.parameters()))


def test_plan_with_the_swap_round_trips_through_json():
    import json

    from lmbp_convert.match.plan import Plan

    plan = _plan(PrimerReLU2())
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.of(OutputActSwap) == plan.of(OutputActSwap)


@pytest.mark.parametrize("after", [nn.Dropout(0.1, inplace=True), "mul_"], ids=["dropout_inplace", "mul_"])
def test_output_modified_in_place_is_left_alone_with_the_reason(after):
    """The swap keeps the output for its backward: an in-place change of it would make backward fail."""
    class Then(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.act, self.down = nn.Linear(D, H), PrimerReLU2(), nn.Linear(H, D)
            self.after = after if isinstance(after, nn.Module) else None

        def forward(self, x):
            h = self.act(self.up(x))
            h = self.after(h) if self.after is not None else h.mul_(0.5)
            return self.down(h)

    model = Then()
    plan = plan_conversion(model, probe=X, norms=False, gated_mlp=False)
    assert not plan.of(OutputActSwap)
    (skip,) = [s for s in plan.skips if s.name == "act"]
    assert "modified in place" in skip.reason, skip.reason
