"""The automatic probe: built from the model's forward signature, config and module tree, checked by running it;
when it cannot be built or run, ProbeError names the arguments to pass, with an example."""
import pytest
import torch
from torch import nn

from lmbp_convert import ProbeError, convert
from lmbp_convert import plan_conversion
from lmbp_convert.apply.verify import TRAIN_DRAWS
from lmbp_convert.trace.probe import find_probe, make_probe, search_probe
from lmbp_convert.trace.tracer import call_model
from testsupport.families import PROBE_FAMILIES


def _shapes(probe):
    if isinstance(probe, torch.Tensor):
        return tuple(probe.shape)
    return {k: tuple(v.shape) for k, v in probe.items()}


# what each family's probe must be, from the tiny configs in testsupport.families.PROBE_FAMILIES (batch 2, seq 8)
EXPECTED = {
    # decoder ids sized like the text, opening with decoder_start_token_id where the config sets one
    "t5": {"input_ids": (2, 8), "decoder_input_ids": (2, 8)},
    "umt5": {"input_ids": (2, 8), "decoder_input_ids": (2, 8)},
    "bart": {"input_ids": (2, 8), "decoder_input_ids": (2, 8)},
    "marian": {"input_ids": (2, 8), "decoder_input_ids": (2, 8)},
    # pools at the end-of-sequence token: each row ends with eos_token_id (checked below)
    "bart_classifier": {"input_ids": (2, 8), "decoder_input_ids": (2, 8)},
    # composite encoder-decoders: sizes from config.encoder / config.decoder (ids < each side's vocabulary)
    "bert2bert": {"input_ids": (2, 8), "decoder_input_ids": (2, 8)},
    "vit_gpt2": {"pixel_values": (2, 3, 32, 32), "decoder_input_ids": (2, 8)},
    # Whisper: num_mel_bins × (max_source_positions × the stride of its input convolutions, 1 · 2) frames
    "whisper": {"input_features": (2, 8, 16 * 2), "decoder_input_ids": (2, 8)},
    # raw audio: the samples 10 frames need through conv kernels (10, 3), strides (5, 2): (10−1)·2+3 = 21 → 20·5+10;
    # 10 frames, not 8: SpecAugment masks spans of mask_time_length (10) frames in training
    "wav2vec2": {"input_values": (2, 110)},
    "hubert": {"input_values": (2, 110)},
    # features (batch, frames, bins) for encoders that transpose themselves: Speech2Text, 8 frames × its input
    # convolutions' stride 4; Wav2Vec2-BERT stacks 2 × 80 bins, which only its first Linear (160 in) tells
    "speech_to_text": {"input_features": (2, 32, 16), "decoder_input_ids": (2, 8)},
    "wav2vec2_bert": {"input_features": (2, 10, 160)},
    # dual encoders: text and pixels at the vision config's image_size
    "clip": {"input_ids": (2, 8), "pixel_values": (2, 3, 32, 32)},
    "siglip": {"input_ids": (2, 8), "pixel_values": (2, 3, 32, 32)},
    # sequence classification without a pad token: transformers refuses batches > 1
    "gpt2_classifier": {"input_ids": (1, 8)},
    # multiple choice: batch × choices × seq
    "bert_multiple_choice": {"input_ids": (2, 2, 8)},
    # timm at img_size=160, not pretrained_cfg's 224 (Hiera records no size: its position embedding does)
    "timm_hiera_160": (2, 3, 160, 160),
    "timm_mixer_160": (2, 3, 160, 160),
    "timm_vit_160": (2, 3, 160, 160),
}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_probe_is_built_from_config_and_signature(family):
    model = PROBE_FAMILIES[family]()
    probe, count, unit = make_probe(model)
    assert _shapes(probe) == EXPECTED[family]
    with torch.no_grad():
        call_model(model.eval(), probe)  # the model runs on it
    cfg = getattr(model, "config", None)
    start = getattr(cfg, "decoder_start_token_id", None)
    if isinstance(probe, dict) and "decoder_input_ids" in probe:
        if start is not None:
            assert (probe["decoder_input_ids"][:, 0] == start).all()
        vocab = (cfg.decoder if hasattr(cfg, "decoder") else cfg).vocab_size
        assert int(probe["decoder_input_ids"].max()) < vocab
    if isinstance(probe, dict) and "input_ids" in probe:
        vocab = (cfg.encoder if hasattr(cfg, "encoder") else cfg.get_text_config()).vocab_size
        assert int(probe["input_ids"].max()) < vocab
    assert count > 0 and unit in ("token", "image", "frame")
    if family == "bart_classifier":
        eos = model.config.eos_token_id
        assert (probe["input_ids"][:, -1] == eos).all() and int((probe["input_ids"] == eos).sum()) == 2


def test_speech_probe_trains_with_spec_augment():
    """Training masks time spans of mask_time_length frames: the probe is long enough for a training forward."""
    model = PROBE_FAMILIES["wav2vec2"]().train()
    probe, count, unit = make_probe(model)
    out = call_model(model, probe)
    assert out.last_hidden_state.shape[1] == model.config.mask_time_length and unit == "frame"
    assert count == 2 * model.config.mask_time_length


def test_seed_draws_another_input_of_the_same_shapes():
    model = PROBE_FAMILIES["clip"]()
    a, _, _ = make_probe(model)
    b, _, _ = make_probe(model, seed=1)
    assert _shapes(a) == _shapes(b)
    assert not torch.equal(a["input_ids"], b["input_ids"]) and not torch.equal(a["pixel_values"], b["pixel_values"])
    assert torch.equal(a["input_ids"], make_probe(model)[0]["input_ids"])  # deterministic


def test_trying_probes_leaves_modes_and_rng_as_they_were():
    model = PROBE_FAMILIES["bert_multiple_choice"]().train()  # refuses the 2-D ids first
    model.bert.encoder.eval()
    flags = [m.training for m in model.modules()]
    state = torch.random.get_rng_state()
    make_probe(model)
    assert [m.training for m in model.modules()] == flags
    assert torch.equal(torch.random.get_rng_state(), state)


class _NeedsGraph(nn.Module):
    """A timm-style image model whose forward also requires an argument no config describes."""

    pretrained_cfg = {"input_size": (3, 8, 8)}

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 2)

    def forward(self, x, edge_index):
        return self.conv(x)[..., edge_index]


def test_argument_it_cannot_build_is_named_with_an_example():
    model = _NeedsGraph()
    with pytest.raises(ProbeError) as err:
        convert(model)
    msg = str(err.value)
    assert "`edge_index`" in msg and "pass probe=" in msg
    # the example holds what could be built, and a slot for what could not
    assert "convert(model, probe={'x': torch.randn(2, 3, 8, 8), 'edge_index': ...})" in msg


def test_model_refusing_every_probe_says_why_and_what_to_pass():
    class Picky(nn.Module):
        img_size = 8

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 2)

        def forward(self, x):
            if x.shape[-1] != 5:
                raise ValueError(f"takes 5 pixels wide images, got {x.shape[-1]}")
            return self.conv(x)

    # the example's shape comes from the model: its stem's 4 channels and its 8-pixel size
    with pytest.raises(ProbeError, match=r"(?s)ValueError: takes 5 pixels wide.*"
                                         r"pass probe=.*convert\(model, probe=\{'x': torch.randn\(2, 4, 8, 8\)\}\)"):
        make_probe(Picky())


def test_channels_come_from_the_model_not_the_declared_default():
    """timm keeps ``pretrained_cfg['input_size']`` at the architecture's 3 channels when a model is built with
    ``in_chans=1``; the stem convolution (and ``in_chans``) say what it takes."""
    class DeclaresThree(nn.Module):
        pretrained_cfg = {"input_size": (3, 8, 8)}  # says 3 channels, takes 4

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 2)

        def forward(self, x):
            return self.conv(x)

    probe, _, unit = make_probe(DeclaresThree())
    assert unit == "image" and tuple(probe.shape) == (2, 4, 8, 8)


def test_one_channel_timm_vit_converts():
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, in_chans=1, img_size=32, depth=2,
                              num_classes=10)
    assert model.pretrained_cfg["input_size"][0] == 3  # the declared default that misled the probe
    probe, _, _ = make_probe(model)
    assert tuple(probe.shape) == (2, 1, 32, 32)
    convert(model)
    assert model.lmbp_report.verification == "passed"
    assert len(model.lmbp_report.plan.items) == 7  # 2 GELUs, 5 norms


def _levit(**kw):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("levit_128s", pretrained=False, img_size=64, num_classes=10, **kw)
    assert model.pretrained_cfg["input_size"] == (3, 224, 224)  # the declared default, not what it was built for
    return model.eval()


def test_levit_probes_at_the_size_its_token_grid_was_built_for():
    """LeViT keeps no ``img_size``: it turns it into its attention's token grid (``resolution``, 4×4 at 64 pixels
    over a stride-16 stem), whose biases refuse any other size. The grid times the stem convolutions' strides says
    the size; the declared 224 comes after it."""
    model = _levit(act_layer="gelu", in_chans=1)
    probe, _, unit = make_probe(model)
    assert unit == "image" and tuple(probe.shape) == (2, 1, 64, 64)
    convert(model)
    assert model.lmbp_report.verification == "passed" and model.lmbp_report.plan.act_swaps


class _Refuses(nn.Module):
    """A timm-style wrapper that refuses every input, around a model built at 64 pixels, 1 channel."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.pretrained_cfg = inner.pretrained_cfg

    def forward(self, x):
        self.inner(x)
        raise ValueError("refuses every input")


def test_probe_error_example_shape_comes_from_the_model():
    with pytest.raises(ProbeError, match=r"(?s)ValueError: refuses every input.*"
                                         r"convert\(model, probe=\{'x': torch.randn\(2, 1, 64, 64\)\}\)"):
        make_probe(_Refuses(_levit(in_chans=1)))


def test_unknown_conv_model_gets_an_example_of_the_size_it_records():
    class Unrun(nn.Module):  # no pretrained_cfg; a stride-4 stem, then a block built for a 5×5 grid
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(2, 8, 2, stride=2), nn.Conv2d(8, 8, 2, stride=2))
            self.block = nn.Linear(8, 8)
            self.block.resolution = 5

        def forward(self, x, mask):
            return self.block(self.stem(x).flatten(2).transpose(1, 2))

    with pytest.raises(ProbeError, match=r"'x': torch.randn\(2, 2, 20, 20\), 'mask': \.\.\."):
        make_probe(Unrun())


def test_config_without_sizes_names_the_main_input():
    model = PROBE_FAMILIES["clip"]()
    model.config.text_config.vocab_size = 0  # nothing to draw ids from
    with pytest.raises(ProbeError, match=r"argument `input_ids`.*pass probe="):
        make_probe(model)


def test_unknown_model_gets_an_example_from_its_first_layer():
    with pytest.raises(ProbeError, match=r"argument `input`.*convert\(model, probe=torch.randn\(2, 8\)\)"):
        make_probe(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)))


def _count_forwards(model):
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    return calls


def test_planning_with_the_automatic_probe_runs_the_model_once():
    """The trace is the probe's acceptance check: choosing the probe costs no forward of its own."""
    model = PROBE_FAMILIES["t5"]()
    calls = _count_forwards(model)
    plan_conversion(model, loss=False, measure=False)
    assert len(calls) == 1
    calls.clear()
    plan_conversion(model, measure=False)  # the loss matcher's one forward with labels (match/loss.py) on top
    assert len(calls) == 2
    calls.clear()
    plan_conversion(model, loss=False)  # measured: one training forward before the rewrites, one after
    assert len(calls) == 3


def test_a_refused_candidate_is_skipped_before_the_trace_and_the_next_one_traced():
    model = PROBE_FAMILIES["bert_multiple_choice"]()  # refuses the 2-D ids, takes the 3-D ones
    calls = _count_forwards(model)
    plan = plan_conversion(model, measure=False)  # (measured, the plan adds two training forwards)
    assert plan.probe["input_ids"].dim() == 3
    # the 2-D candidate: refused by the trace, then by a plain forward; the 3-D one: traced once
    assert len(calls) == 3


def test_a_failure_of_the_callers_work_on_an_input_the_model_takes_is_raised():
    class Boom(Exception):
        pass

    def accept(inputs):
        raise Boom("the trace's own failure")

    model = PROBE_FAMILIES["t5"]()
    with pytest.raises(Boom):
        find_probe(model, accept)


def test_find_probe_returns_what_accept_returned():
    model = PROBE_FAMILIES["t5"]()
    probe, count, unit, result = find_probe(model, lambda p: ("traced", sorted(p)))
    assert result == ("traced", ["decoder_input_ids", "input_ids"])
    assert (count, unit) == make_probe(model)[1:]


def test_meta_model_is_traced_with_one_forward():
    """On the meta device the trace is the probe's check: the model runs once, not once to check and once to trace."""
    from lmbp_convert.apply.convert import plan_conversion
    from lmbp_convert.match.norm_exact import NormExact
    from testsupport.families import hf

    with torch.device("meta"):
        model = hf("llama")
    calls = []
    handle = model.register_forward_pre_hook(lambda m, args: calls.append(1))
    try:
        plan = plan_conversion(model, activations=False, gated_mlp=False, verify=False)
    finally:
        handle.remove()
    assert len(calls) == 1
    assert plan.of(NormExact) and plan.probe_tokens == 16


def test_the_second_automatic_probe_starts_from_the_candidate_that_won_at_seed_0():
    """Seeds change the data, not the shapes or their order: verification's second probe (seed 1) is the shape
    the trace chose, found with one forward instead of a new search through the refused candidates."""
    model = PROBE_FAMILIES["bert_multiple_choice"]()  # refuses the 2-D ids, takes the 3-D ones
    first = search_probe(model, None)
    assert first.index > 0 and first.probe["input_ids"].dim() == 3
    calls = _count_forwards(model)
    second = search_probe(model, None, seed=1, first=first.index)
    assert len(calls) == 1
    assert second.index == first.index and _shapes(second.probe) == _shapes(first.probe)
    assert not torch.equal(second.probe["input_ids"], first.probe["input_ids"])
    calls.clear()
    convert(model)  # trace: 2-D refused (trace + plain forward), 3-D traced; verification's forwards only after
    assert model.lmbp_report.verified_on == ["the traced probe", "a second automatic probe (seed 1)"]
    # + seed 1 once (no refused 2-D candidate) + the converted model on both + the report's two measured training
    # forwards (original, converted) + train-mode verification: the original and the converted on each RNG draw
    # (dropout is on in this config, so every draw counts)
    assert model.lmbp_report.train_draws == TRAIN_DRAWS
    assert len(calls) == 3 + 1 + 2 + 2 + 2 * TRAIN_DRAWS


def test_a_candidate_tried_first_that_the_model_refuses_falls_back_to_the_usual_order():
    model = PROBE_FAMILIES["bert_multiple_choice"]()
    found = search_probe(model, None, first=0)  # the 2-D ids: refused, then the others in order
    assert found.probe["input_ids"].dim() == 3 and found.index == search_probe(model, None).index


@pytest.mark.parametrize("oom", [torch.OutOfMemoryError, MemoryError])
@pytest.mark.parametrize("call", ["convert", "plan_conversion", "make_probe"])
def test_out_of_memory_during_the_search_is_raised_not_taken_for_a_refusal(oom, call):
    """Out of memory is the machine's limit, not the probe's: once, the search tried a smaller candidate (batch 1)
    and the conversion went on as if nothing had happened; now it is raised as it is, and the model left alone."""
    from testsupport.families import FAMILIES

    model = FAMILIES["llama"]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []

    def big_batch_does_not_fit(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen.append(tuple(ids.shape))
        if ids.shape[0] > 1:
            raise oom("out of memory (test)")

    model.register_forward_pre_hook(big_batch_does_not_fit, with_kwargs=True)
    fn = {"convert": convert, "plan_conversion": plan_conversion, "make_probe": make_probe}[call]
    with pytest.raises(oom, match="out of memory"):
        fn(model)
    assert seen == [(2, 8)]  # no other candidate tried
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any(type(m).__module__.startswith("lmbp_convert") for m in model.modules())


def test_one_channel_hf_vit_probes_with_its_config_channels():
    from testsupport.families import hf_auto

    model = hf_auto("AutoModelForImageClassification", "vit", image_size=32, patch_size=8, num_channels=1,
                    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_labels=3)
    probe, _, _ = make_probe(model)
    assert tuple(probe["pixel_values"].shape) == (2, 1, 32, 32)
