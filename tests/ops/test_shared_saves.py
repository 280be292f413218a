"""The shared-saves region: noted tensors stand in for their saved copies, rebuilt bitwise in backward."""
import pytest
import torch

from lmbp_convert import SavedTensorLedger
from lmbp_convert.ops.dropout_bits import dropout_bits
from lmbp_convert.ops.shared_saves import SharedSaves, active, note, note_identity
from testsupport.regions import open_region


def _lora_like(x, a, drop=None):
    """PEFT's adapter path: cast to the adapter dtype, (dropout), A."""
    x32 = x.float()
    if drop is not None:
        x32 = drop(x32)
    return x32 @ a.t()


def test_cast_copy_of_a_noted_input_is_not_kept():
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    a = torch.randn(4, 32, requires_grad=True)
    with SavedTensorLedger([a]) as plain:
        _lora_like(x * 1, a).sum().backward()
    ref = a.grad.clone()
    a.grad = None
    with SavedTensorLedger([a]) as led:
        with open_region() as region:
            h = x * 1  # a tensor with a graph, as a layer's input is
            note_identity(h)
            _lora_like(h, a).sum().backward()
            assert region.recipes == 1
    assert torch.equal(a.grad, ref)
    assert plain.bytes == 16 * 32 * 4 and led.bytes == 16 * 32 * 2  # the bf16 input instead of its fp32 copy


def test_narrowing_casts_and_plain_views_are_left_alone():
    h = torch.randn(8, 8, requires_grad=True) * 1
    w = torch.randn(8, 8, requires_grad=True)
    with open_region() as region:
        note_identity(h)
        (h.to(torch.bfloat16) @ w.to(torch.bfloat16)).sum()  # narrower copy: kept as is
        (h @ w).sum()  # h itself: nothing to rebuild
        assert region.recipes == 0


def test_one_rebuild_serves_every_recipe_of_the_same_tensor():
    calls = []
    x = torch.randn(8, 16, requires_grad=True)
    ws = [torch.randn(16, 16, requires_grad=True) for _ in range(3)]

    def rebuild(t):
        calls.append(1)
        return t * 2.0

    with open_region() as region:
        y = x * 2.0
        note(y, rebuild, x)
        loss = sum((y @ w).sum() for w in ws)
        assert region.recipes == 3
    loss.backward()
    assert len(calls) == 1
    for w in ws:
        assert torch.equal(w.grad, (x * 2.0).t() @ torch.ones(8, 16))


def _plain_and_shared(x, w, gamma, consumer):
    """Run ``consumer(x̂ * γ)`` with no region and with y noted in one: (saved bytes, x, w, γ grads) of each."""
    def run(region_open):
        x.grad = w.grad = gamma.grad = None
        with SavedTensorLedger([w, gamma]) as led:
            src = x * 1  # x̂: the product's backward keeps it anyway
            if region_open:
                with open_region() as region:
                    y = src * gamma
                    note(y, lambda t, g: t * g, src, gamma)
                    out = consumer(y)
                    assert region.recipes == 1
            else:
                out = consumer(src * gamma)
            out.float().pow(2).sum().backward()
        return led.bytes, x.grad.clone(), w.grad.clone(), gamma.grad.clone()

    return run(False), run(True)


def test_casts_of_reshapes_of_a_noted_tensor_are_rebuilt_with_the_same_reshapes():
    """An MoE router / experts under autocast: ``y.view(-1, d)`` (and an alias of it) cast to bf16 and saved by
    the matmul; the recipe rebuilds y, reshapes and casts it as the forward did: the bytes of x̂ alone, the same
    gradient."""
    x = torch.randn(2, 8, 16, requires_grad=True)
    w = torch.randn(16, 4, requires_grad=True)
    gamma = torch.randn(16, requires_grad=True)

    plain, shared = _plain_and_shared(x, w, gamma, lambda y: y.view(-1, 16)[...].to(torch.bfloat16) @ w.to(torch.bfloat16))
    assert torch.equal(plain[1], shared[1]) and torch.equal(plain[2], shared[2])
    assert plain[0] - shared[0] == 2 * 8 * 16 * 2  # the bf16 copy of y is not kept


@pytest.mark.parametrize("pick", ["select", "slice"])
def test_casts_of_token_selections_of_a_noted_tensor_are_rebuilt(pick):
    """A classifier head under autocast reads ``y[:, 0]`` (or a slice of tokens) cast to bf16: rebuilt as well."""
    x = torch.randn(2, 8, 16, requires_grad=True)
    w = torch.randn(16, 4, requires_grad=True)
    gamma = torch.randn(16, requires_grad=True)

    def head(y):
        t = y[:, 0] if pick == "select" else y[:, 1:7:2]
        return t.to(torch.bfloat16) @ w.to(torch.bfloat16)

    plain, shared = _plain_and_shared(x, w, gamma, head)
    assert all(torch.equal(a, b) for a, b in zip(plain[1:], shared[1:]))
    assert plain[0] - shared[0] == (2 if pick == "select" else 2 * 3) * 16 * 2


def test_in_place_change_of_a_source_is_caught():
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 4, requires_grad=True)
    src = x * 1
    with open_region():
        y = src * 3.0
        note(y, lambda t: t * 3.0, src)
        loss = (y @ w).sum()
    with torch.no_grad():
        src.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_nested_dropout_of_a_cast_keeps_the_input_and_bits():
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    a = torch.randn(8, 64, requires_grad=True)
    torch.manual_seed(0)
    _lora_like(x * 1, a, lambda t: torch.nn.functional.dropout(t, 0.1, True)).sum().backward()
    ref = a.grad.clone()
    a.grad = None
    torch.manual_seed(0)
    with SavedTensorLedger([a]) as led:
        with open_region():
            h = x * 1
            note_identity(h)
            out = _lora_like(h, a, lambda t: dropout_bits(t, 0.1))
    out.sum().backward()
    assert torch.equal(a.grad, ref)
    assert led.bytes == 32 * 64 * 2 + 32 * 64 // 8


def test_regions_are_per_thread_and_closed_after_exit():
    assert active() is None
    with open_region() as region:
        assert active() is region
    assert active() is None


def test_nothing_opens_without_grad():
    with torch.no_grad():
        assert not SharedSaves().enter()


def test_notes_keep_no_tensor_alive():
    """A note must not hold what nothing else holds: under checkpointing or for an unsaved tensor, that would be
    a forward-long leak (a LoRA layer's input in every layer: +8 MiB a layer on issue 19's LLaMA)."""
    import weakref

    x = torch.randn(8, 16, requires_grad=True)
    with open_region():
        t = x * 2.0
        note_identity(t)
        d = dropout_bits(t.float() * 1.0, 0.5)
        refs = [weakref.ref(t), weakref.ref(d)]
        del t, d
        assert all(r() is None for r in refs)


def test_no_note_inside_other_hooks():
    x = torch.randn(8, 16, requires_grad=True)
    with open_region() as region:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # e.g. activation checkpointing
            t = x * 2.0
            note_identity(t)
            note(t * 1.0, lambda a: a, t)
        assert not region.notes


def test_a_source_that_is_none_is_a_value_not_a_freed_tensor():
    """The exact norm without β notes (x̂, w, None, ...): once, that None read as "a weak source was freed" and no
    recipe was made (LLaMA kept y beside x̂ in every layer)."""
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 4, requires_grad=True)
    with open_region() as region:
        y = x * 3.0
        note(y, lambda t, b: t * 3.0, x, None)
        (y @ w).sum()
        assert region.recipes == 1


@pytest.mark.parametrize("view", ["permute_cast", "transpose_reshape", "contiguous", "channels_last_clone"])
def test_permuted_and_copied_views_of_a_noted_tensor_are_rebuilt_bitwise(view):
    """A channel-first view of a channels-last output (ConvNeXt's LayerNorm2d under autocast), a transposed token
    grid flattened (a copy), a contiguous or channels-last copy: the consumer's
    saved copy is rebuilt from the noted tensor with the same permutes and copies, in the forward's layout."""
    import torch.nn.functional as F

    x = torch.randn(2, 4, 4, 16, requires_grad=True)  # channels-last, as a norm over the last dim sees it
    w = torch.randn(8, 16, 1, 1, requires_grad=True)
    gamma = torch.randn(16, requires_grad=True)

    def consumer(y):
        if view == "permute_cast":
            return F.conv2d(y.permute(0, 3, 1, 2).to(torch.bfloat16), w.to(torch.bfloat16)).float()
        if view == "transpose_reshape":
            return F.linear(y.reshape(2, 16, 16).transpose(1, 2).reshape(32, 16), w.view(8, 16))  # a copy
        t = y.permute(0, 3, 1, 2)
        t = t.contiguous() if view == "contiguous" else t.transpose(2, 3).clone(memory_format=torch.channels_last)
        return F.conv2d(t, w)

    plain, shared = _plain_and_shared(x, w, gamma, consumer)
    assert all(torch.equal(a, b) for a, b in zip(plain[1:], shared[1:]))
    assert plain[0] - shared[0] == 2 * 4 * 4 * 16 * (2 if view == "permute_cast" else 4)



# -- one noted tensor, several readers through different op chains (issue 38) -------------------------------------
# Each case: the noted y's dtype and shape, the readers (y → what a weight op saves), and the recipes and rebuilds
# the region makes: one recipe per saved copy, one rebuild per distinct chain of ops (a plain view of y is y's).
def _bf16_mm(t, w):
    return t.to(torch.bfloat16) @ w.to(torch.bfloat16)


def _conv(t, w):
    return torch.nn.functional.conv2d(t, w.view(w.shape[0], -1, 1, 1))


CHAINS = {
    # y read as y by an fp32 matmul and as y.to(bf16) by a bf16 one: same stride, two dtypes
    "as_is_and_cast": (torch.float32, (8, 16), [lambda y, w: y @ w, _bf16_mm], 2, 2),
    # a bf16 y up-cast two ways (a LoRA adapter's fp32 copy beside an fp64 one)
    "float_and_double": (torch.bfloat16, (8, 16), [lambda y, w: y.float() @ w.float(),
                                                   lambda y, w: y.double() @ w.double()], 2, 2),
    # same dtype, same stride, different rows: two selections cast alike
    "two_selections": (torch.float32, (2, 8, 16), [lambda y, w: _bf16_mm(y[0], w), lambda y, w: _bf16_mm(y[1], w)],
                       2, 2),
    # a view of y (y's own chain) and a cast of that view (another)
    "view_and_cast_of_the_view": (torch.float32, (2, 8, 16), [lambda y, w: y.view(16, 16) @ w,
                                                              lambda y, w: _bf16_mm(y.view(16, 16), w)], 2, 2),
    # plain views, one at an offset: y's chain each, one rebuild serves both
    "views_share_one_rebuild": (torch.float32, (2, 8, 16), [lambda y, w: y.view(16, 16) @ w, lambda y, w: y[1] @ w],
                                2, 1),
    # the same chain of ops (a permute and a copy) into two layouts: NCHW-contiguous and channels-last
    "one_chain_two_layouts": (torch.float32, (2, 4, 4, 16), [
        lambda y, w: _conv(y.permute(0, 3, 1, 2).contiguous(), w),
        lambda y, w: _conv(y.permute(0, 3, 1, 2).clone(memory_format=torch.channels_last), w)], 2, 2),
}


def _readers_run(dtype, shape, readers, region_open, outside=None):
    """y = x̂·γ noted (with a rebuild that counts its calls), each reader's output summed into one loss:
    (ledger bytes, every gradient, recipes, rebuild calls). ``outside``: one more reader after the region closed."""
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    gamma = torch.rand(shape[-1], dtype=dtype).add(0.5).requires_grad_()
    ws = [torch.randn(16, 16, requires_grad=True) for _ in readers + ([outside] if outside else [])]
    calls = []

    def rebuild(t, g):
        calls.append(1)
        return t * g

    with SavedTensorLedger([gamma, *ws]) as led:
        src = x * 1  # x̂: the product's backward keeps it anyway
        with open_region(region_open) as region:
            y = src * gamma
            if region_open:
                note(y, rebuild, src, gamma)
            outs = [r(y, w) for r, w in zip(readers, ws)]
        if outside is not None:
            outs.append(outside(y, ws[-1]))
        loss = sum(o.float().pow(2).sum() for o in outs)
    recipes = region.recipes
    loss.backward()
    return led.bytes, [x.grad, gamma.grad, *(w.grad for w in ws)], recipes, len(calls)


def _assert_bitwise(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a is not None and a.dtype == b.dtype and torch.equal(a, b), i


@pytest.mark.parametrize("case", list(CHAINS))
def test_one_noted_tensor_read_through_different_chains(case):
    """One rebuild per distinct chain of ops (and layout) from the noted tensor, shared by the recipes of that chain
    only: a rebuild keyed without its casts hands an fp32 y to a bf16 matmul ('expected m1 and m2 to have the
    same dtype'); one keyed without the selection, or the layout, hands one reader another's values."""
    dtype, shape, readers, n_recipes, n_rebuilds = CHAINS[case]
    plain_bytes, want, _, _ = _readers_run(dtype, shape, readers, False)
    shared_bytes, got, recipes, rebuilds = _readers_run(dtype, shape, readers, True)
    assert (recipes, rebuilds) == (n_recipes, n_rebuilds)
    _assert_bitwise(got, want)
    assert shared_bytes < plain_bytes


def test_a_reader_outside_the_region_keeps_its_own_copy():
    """The region's notes end with it: a cast of y saved after the region closed is kept as eager autograd keeps
    it (no recipe, no rebuild for it), beside the two readers inside that share y."""
    readers = [lambda y, w: y @ w, _bf16_mm]
    plain_bytes, want, _, _ = _readers_run(torch.float32, (8, 16), readers, False, outside=_bf16_mm)
    shared_bytes, got, recipes, rebuilds = _readers_run(torch.float32, (8, 16), readers, True, outside=_bf16_mm)
    assert (recipes, rebuilds) == (2, 2)
    _assert_bitwise(got, want)
    # the inside readers' y and bf16 copy are not kept, the outside reader's bf16 copy is
    assert plain_bytes - shared_bytes == 8 * 16 * 4 + 8 * 16 * 2


def test_two_noted_tensors_read_through_the_same_chain_are_rebuilt_apart():
    """Two noted tensors of one shape, each read through the same cast: two rebuilds, each its own values."""
    torch.manual_seed(0)
    xs = [torch.randn(8, 16, requires_grad=True) for _ in range(2)]
    ws = [torch.randn(16, 4, requires_grad=True) for _ in range(2)]
    calls = []

    def rebuild(t, s):
        calls.append(1)
        return t * s

    def run(region_open):
        for t in xs + ws:
            t.grad = None
        with open_region(region_open) as region:
            ys = [x * s for x, s in zip(xs, (2.0, 3.0))]
            if region_open:
                for x, y, s in zip(xs, ys, (2.0, 3.0)):
                    note(y, rebuild, x, s)
            loss = sum(_bf16_mm(y, w).float().sum() for y, w in zip(ys, ws))
        recipes = region.recipes
        loss.backward()
        return recipes, [t.grad.clone() for t in xs + ws]

    _, want = run(False)
    recipes, got = run(True)
    assert recipes == 2 and len(calls) == 2
    _assert_bitwise(got, want)
