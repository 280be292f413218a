"""convert() is a transaction: an exception at any forward it runs leaves the model exactly as it was.

Each scenario first counts the forwards convert() runs (whole-model forwards, and calls of the new modules
inside them), then reruns convert() once per forward, raising KeyboardInterrupt, RuntimeError (out of memory)
and OSError there in turn, on the same model, and checks every observable piece of state after each run.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import lmbp_convert.apply.rewrite as rewrite_mod
from lmbp_convert import convert
from lmbp_convert.enums import ConvertedModule
from lmbp_convert.match.loss import LossSwap
from model_state import assert_same, snapshot
from testsupport.families import hf

class Injector:
    """Counts whole-model forwards (and, per forward, calls of converted modules); raises at a chosen point:
    ("model", k) as the k-th forward starts, ("inside", k) at the first converted module the k-th forward calls."""

    def __init__(self, model: nn.Module, probe):
        self.model, self.probe = model, probe
        self.forwards = 0
        self.converted_calls: dict[int, int] = {}
        self.target: tuple[str, int] | None = None
        self.exc: BaseException | None = None
        self.run_kwargs: dict = {}

    def __call__(self, module: nn.Module, args) -> None:
        if module is self.model:
            self.forwards += 1
            if self.target == ("model", self.forwards):
                raise self.exc
        elif isinstance(module, ConvertedModule):
            n = self.converted_calls[self.forwards] = self.converted_calls.get(self.forwards, 0) + 1
            if self.target == ("inside", self.forwards) and n == 1:
                raise self.exc

    def run(self, target=None, exc=None):
        self.forwards, self.converted_calls = 0, {}
        self.target, self.exc = target, exc
        handle = torch.nn.modules.module.register_module_forward_pre_hook(self)
        try:
            return convert(self.model, probe=self.probe, **self.run_kwargs).lmbp_report
        finally:
            handle.remove()


def _corrupt_fold_into(*weights_of):
    """A fold that is wrong for one Linear, so that verification fails and every unit is re-checked alone."""
    real = rewrite_mod.fold_affine

    def fold(weight, bias, gamma, beta, layout="out_in"):
        w, b = real(weight, bias, gamma, beta, layout)
        return (w * 1.5 if any(weight is of() for of in weights_of) else w), b

    return fold


def _llama():
    model = hf("llama")
    model.train()
    model.model.layers[1].eval()  # mixed flags must come back as they were
    model.model.embed_tokens.weight.requires_grad_(False)
    model.model.layers[0].mlp.register_forward_hook(lambda m, a, o: None)  # a user's hooks on swapped modules
    model.model.layers[1].post_attention_layernorm.register_forward_pre_hook(lambda m, a: None)
    return model, lambda: model.model.layers[0].self_attn.q_proj.weight


def _bert():
    model = hf("bert", head="cls")
    model.train()
    model.bert.encoder.layer[0].intermediate.intermediate_act_fn.register_forward_hook(lambda m, a, o: None)
    return model, lambda: model.bert.encoder.layer[1].intermediate.dense.weight


@pytest.mark.slow  # one conversion per forward of the model
@pytest.mark.parametrize("family", ["llama", "bert"])  # pre-LN decoder; post-LN encoder (re-apply hooks)
@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_exception_at_every_forward_restores_the_model(family, monkeypatch):
    """One Linear's fold is wrong, so convert() runs every kind of forward it has: the trace, the verification
    of all rewrites, one re-check per rewrite (rollback path) and the final check."""
    build = {"llama": _llama, "bert": _bert}[family]
    model, weight_of = build()
    twin, twin_weight_of = build()  # a dry run on a twin counts the forwards; the model stays unconverted
    monkeypatch.setattr(rewrite_mod, "fold_affine", _corrupt_fold_into(weight_of, twin_weight_of))
    probe = {"input_ids": torch.tensor([[3, 17, 42, 9, 100, 5]])}
    model.lmbp_report = "a user's attribute"  # what convert() would overwrite: must come back
    before = snapshot(model)
    counter = Injector(twin, probe)
    counter.run_kwargs = dict(fold_norms=True)  # a wrong fold, for the rollback path
    report = counter.run()
    assert report.verified and len(report.rolled_back) == 1, str(report)
    n_units = len(report.swapped) + 1
    labelled = int(any(isinstance(i, LossSwap) for i in report.plan.items))  # the loss matcher's probe with labels
    # trace, (the probe with labels,) the original on the second verification input, the original in train mode
    # (seeds 0 and 1, then the other draws if they differ), the original's measured training forward; then on both
    # inputs and every train draw: verify, one per unit, final; then the converted model's measured one
    draws = report.train_draws
    original_train = 2 if draws == 1 else draws
    checks = 2 + draws
    assert counter.forwards == 3 + labelled + original_train + checks * (1 + n_units + 1) + 1, counter.forwards
    inside = sorted(counter.converted_calls)
    assert inside == list(range(4 + labelled + original_train, counter.forwards + 1)), counter.converted_calls
    inj = Injector(model, probe)
    # forward 2 + labelled runs the original on an input derived from the probe: an error there means the model
    # rejects that input, and the next derivation rule is tried (see lmbp_convert.trace.second_probe); an error in
    # the probe with labels (forward 2 then) means the loss is skipped; an error in the original's training forward
    # means verification in eval mode only (a note); interrupts still stop all of them
    tolerant = {2, 2 + labelled} | set(range(3 + labelled, 3 + labelled + original_train))
    inj.run_kwargs = dict(counter.run_kwargs)
    cases = [(("model", k), e) for k in range(1, counter.forwards + 1) for e in (KeyboardInterrupt, RuntimeError)
             if k not in tolerant or e is KeyboardInterrupt]
    cases += [(("inside", k), (KeyboardInterrupt, RuntimeError, OSError)[k % 3]) for k in inside]
    for target, exc_type in cases:
        exc = exc_type(f"injected at {target}")
        with pytest.raises(BaseException) as caught:
            inj.run(target, exc)
        assert caught.value is exc or caught.value.__cause__ is exc, repr(caught.value)  # trace wraps errors
        assert_same(model, before, f"{exc_type.__name__} at {target}")
    # after all that the model still converts, to the same result as its twin
    again = inj.run()
    assert again.verified and again.swapped == report.swapped and again.rolled_back == report.rolled_back


@pytest.mark.parametrize("build, kwargs", [
    (lambda: hf("llama", tie_word_embeddings=True), {"untie": True}),  # the head gets a new Parameter
    (lambda: hf("gpt2"), {}),  # Conv1D layout; folds into bias-less heads
], ids=["llama-untie", "gpt2"])
def test_exception_in_verification_restores_new_and_replaced_parameters(build, kwargs):
    model = build()
    before = snapshot(model)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    probe = {"input_ids": torch.tensor([[3, 17, 42, 9]])}
    counter = Injector(build(), probe)  # the first forward that calls converted modules is verification's first
    counter.run_kwargs = kwargs
    counter.run()
    first = min(counter.converted_calls)
    assert first > 4  # after the trace, the loss matcher's probe, the original on the other inputs, its measurement
    inj = Injector(model, probe)
    for target, exc in [(("model", first), KeyboardInterrupt()),
                        (("inside", first), RuntimeError("CUDA out of memory"))]:
        inj.run_kwargs = kwargs
        with pytest.raises(type(exc)):
            inj.run(target, exc)
        assert_same(model, before, f"{exc!r} at {target}")
        assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied


def test_exception_while_applying_a_unit_restores_the_model(monkeypatch):
    model, _ = _llama()
    before = snapshot(model)
    real, calls = rewrite_mod.Unit.apply, []

    def apply(self):
        calls.append(self.label)
        if len(calls) == 4:
            raise KeyboardInterrupt
        real(self)

    monkeypatch.setattr(rewrite_mod.Unit, "apply", apply)
    with pytest.raises(KeyboardInterrupt) as caught:
        convert(model)
    assert_same(model, before, "KeyboardInterrupt in the 4th unit")
    assert any("restored" in note for note in getattr(caught.value, "__notes__", []))


@pytest.mark.parametrize("family, include", [
    ("bert", ["bert.encoder.layer.0.attention.output.LayerNorm",  # swap, fold, re-apply hook, carried hooks
              "bert.encoder.layer.0.intermediate.intermediate_act_fn"]),
    ("gpt2", ["transformer.ln_f"]),  # folded into the untied head: a new weight Parameter there, and β/γ a new
    # Parameter of the norm (the head has no bias: `BetaMode.SHIFT`); test_rewrite.py covers a `bias=None` slot filled
    ("llama", ["model.layers.0.mlp"]),  # gated MLP
])
@pytest.mark.usefixtures("past_doors")  # the fold machinery: folds a door could see
def test_interrupt_right_after_any_rewrite_step_restores_the_model(family, include, monkeypatch):
    """An interrupt can land after a step's change but before its bookkeeping: simulated after every step."""
    model = hf(family, head="cls") if family == "bert" else hf(family)
    if family == "bert":
        model.bert.encoder.layer[0].intermediate.intermediate_act_fn.register_forward_hook(lambda m, a, o: None)
    before = snapshot(model)
    real_apply, steps_done, fail_at = rewrite_mod.Unit.apply, [0], [None]

    def tick():
        steps_done[0] += 1
        if steps_done[0] == fail_at[0]:
            raise KeyboardInterrupt

    def apply(self):
        self.steps = [(lambda d=do: (d(), tick()), undo) for do, undo in self.steps]
        real_apply(self)

    monkeypatch.setattr(rewrite_mod.Unit, "apply", apply)
    probe = {"input_ids": torch.tensor([[3, 17, 42, 9]])}
    twin = hf(family, head="cls") if family == "bert" else hf(family)
    kwargs = {"untie": True, "fold_norms": True} if family == "gpt2" else {}
    report = convert(twin, include=include, probe=probe, **kwargs).lmbp_report
    total = steps_done[0]
    assert report.verified and sorted(report.swapped) == sorted(include) and total >= len(include)
    if family == "gpt2":  # the fold's new Parameters were made, so their undo is what the loop below interrupts
        assert twin.lm_head.weight is not twin.transformer.wte.weight
        assert isinstance(twin.transformer.ln_f.bias, nn.Parameter) and "bias" not in twin.transformer.ln_f._buffers
    for k in range(1, total + 1):
        steps_done[0], fail_at[0] = 0, k
        with pytest.raises(KeyboardInterrupt):
            convert(model, include=include, probe=probe, **kwargs)
        assert_same(model, before, f"interrupt after step {k} of {total}")


@pytest.mark.skipif(not isinstance(getattr(__import__("transformers").PreTrainedModel, "loss_function", None), property),
                    reason="transformers < 4.46: no loss_function an instance can set")
def test_exception_at_every_forward_of_a_loss_conversion_restores_the_model():
    """With the memory-sharing loss planned: an interrupt at any forward (the trace, the probe with labels, the
    verification) leaves loss_function as it was; an error in the probe with labels only skips the loss."""
    model = hf("llama")
    probe = {"input_ids": torch.tensor([[3, 17, 42, 9]])}
    before = snapshot(model)
    counter = Injector(hf("llama"), probe)
    counter.run_kwargs = {"activations": False, "norms": False, "gated_mlp": False}
    assert [type(i) for i in counter.run().plan.items] == [LossSwap]
    inj = Injector(model, probe)
    inj.run_kwargs = counter.run_kwargs
    for k in range(1, counter.forwards + 1):
        with pytest.raises(KeyboardInterrupt):
            inj.run(("model", k), KeyboardInterrupt())
        assert_same(model, before, f"KeyboardInterrupt at forward {k}")
        assert "_loss_function" not in model.__dict__
    with pytest.raises(Exception, match="nothing to convert") as caught:
        inj.run(("model", 2), RuntimeError("the model rejects labels"))
    assert "the probe forward with labels failed (RuntimeError" in str(caught.value)
    assert_same(model, before, "RuntimeError in the probe with labels")
