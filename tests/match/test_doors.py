"""With ``fold_norms=True``, a fold whose affine-less output a door could see stays exact, with the reason as data
(match/doors.py): decided by data flow on the traced graph, not by class or module name."""
import copy

import torch
from torch import nn

from lmbp_convert import convert, plan_conversion
from lmbp_convert.match.doors import fold_past_doors
from lmbp_convert.match.norm_exact import NormExact
from lmbp_convert.match.plan import NormFold, Plan
from lmbp_convert.reasons import ReasonCode
from testsupport.families import registry

FOLD = dict(fold_norms=True, activations=False, gated_mlp=False)


def _kinds(plan):
    return ({it.name: it.door for it in plan.items if isinstance(it, NormExact)},
            {it.name for it in plan.items if isinstance(it, NormFold)})


class _Block(nn.Module):
    """x + fc(norm(x)): the norm and the Linear it folds into, inside one block."""

    def __init__(self, d=8):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.normal_()

    def forward(self, x):
        return x + self.fc(self.norm(x))


class _Stack(nn.Module):
    """Blocks in a list, then an output Linear: the blocks are one level below the model's own frame."""

    def __init__(self, n=2, d=8):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d) for _ in range(n))
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x)


class _Flat(nn.Module):
    """The same norm and Linear directly in the model's own frame (a timm model's final norm and head)."""

    def __init__(self, d=8):
        super().__init__()
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.norm(x))

    def forward_features(self, x):  # a door no trace sees
        return self.norm(x)


def test_a_fold_inside_a_block_stays_a_fold_and_one_in_the_models_frame_is_exact():
    x = torch.randn(2, 5, 8)
    exact, folded = _kinds(plan_conversion(_Stack(), probe=x, **FOLD))
    assert folded == {"blocks.0.norm", "blocks.1.norm"} and not exact
    flat = _Flat()
    ref = copy.deepcopy(flat)
    plan = convert(flat, probe=x, **FOLD).lmbp_report.plan
    exact, folded = _kinds(plan)
    assert not folded and exact["norm"].code is ReasonCode.DOOR and exact["norm"].subject == ""
    with torch.no_grad():
        torch.testing.assert_close(flat.forward_features(x), ref.forward_features(x))


def test_a_block_whose_output_the_model_returns_is_a_door():
    """The root's last call returning the model's output (a timm head with its own norm, which forward_head runs
    with pre_logits=True) keeps its fold exact; the same block followed by another op stays folded."""
    class Headed(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = _Block(), _Block()

        def forward(self, x):
            return self.head(self.body(x))

    exact, folded = _kinds(plan_conversion(Headed(), probe=torch.randn(2, 5, 8), **FOLD))
    assert folded == {"body.norm"} and set(exact) == {"head.norm"}, (exact, folded)
    assert exact["head.norm"].subject == "head"


def test_an_output_leaving_a_module_is_exact_with_the_module_named():
    """Post-LN: a block returns its norm's output, which the next block's Linear (or the output Linear) reads."""
    class PostLN(nn.Module):
        def __init__(self, d=8):
            super().__init__()
            self.fc, self.norm = nn.Linear(d, d), nn.LayerNorm(d)

        def forward(self, x):
            return self.norm(self.fc(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.out = PostLN(), PostLN(), nn.Linear(8, 3)

        def forward(self, x):
            return self.out(self.b(self.a(x))).sum(-1)

    exact, folded = _kinds(plan_conversion(Model(), probe=torch.randn(2, 5, 8), **FOLD))
    assert set(exact) == {"a.norm", "b.norm"} and not folded, (exact, folded)
    assert exact["a.norm"].code is ReasonCode.DOOR and exact["a.norm"].subject == "a"


def test_llama_backbone_norm_is_exact_layers_stay_folded_and_the_plan_round_trips():
    model = registry()["llama"]().eval()
    plan = plan_conversion(model, **FOLD)
    exact, folded = _kinds(plan)
    assert set(exact) == {"model.norm"} and exact["model.norm"].subject == "model"
    assert folded == {f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm",
                                                                          "post_attention_layernorm")}
    back = Plan.from_dict(plan.to_dict())
    (item,) = [it for it in back.items if isinstance(it, NormExact)]
    assert item.door == exact["model.norm"]
    assert "not folded: its output leaves model" in "\n".join(item.describe())


def test_a_wrapper_handing_on_to_the_model_is_the_model():
    """PEFT's PeftModel → LoraModel → the model return what the model returns: the model's own frame is below."""
    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    exact, folded = _kinds(plan_conversion(Wrapper(Wrapper(_Flat())), probe=torch.randn(2, 5, 8), **FOLD))
    assert set(exact) == {"inner.inner.norm"} and not folded
    exact, folded = _kinds(plan_conversion(Wrapper(_Stack()), probe=torch.randn(2, 5, 8), **FOLD))
    assert folded == {"inner.blocks.0.norm", "inner.blocks.1.norm"} and not exact


def test_bare_backbone_layers_stay_folded():
    """HF's ViTModel calls its layers from its own frame: they are not its head, so they keep their folds."""
    exact, folded = _kinds(plan_conversion(registry()["vit"]().eval(), **FOLD))
    assert set(exact) == {"layernorm"} and len(folded) == 4, (exact, folded)


def test_the_checkpoint_cli_plans_past_doors():
    model = registry()["llama"]().eval()
    with fold_past_doors():
        exact, folded = _kinds(plan_conversion(model, **FOLD))
    assert not exact and "model.norm" in folded
