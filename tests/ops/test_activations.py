"""The shared activation table: one code per kind for every op, PyTorch and Triton maths agree, unknown kinds
and codes are errors (never another activation)."""
import pytest
import torch
import torch.nn.functional as F

from lmbp_convert.ops import approx_act as A
from lmbp_convert.ops import gated_mlp as G
from lmbp_convert.ops._common import HAS_TRITON
from lmbp_convert.ops.activations import ACT_NAMES, ACTIVATIONS, act_code, get_activation

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def test_codes_are_unique_and_dense():
    assert sorted(a.code for a in ACTIVATIONS.values()) == list(range(len(ACTIVATIONS)))
    assert ACT_NAMES == tuple(ACTIVATIONS)


def test_every_op_uses_the_table_codes():
    """The same name means the same kernel branch in approx_act and gated_mlp (they used to disagree)."""
    for kind in A.ACT_KINDS:
        assert A._KCONSTS[(kind, 2)].act == ACTIVATIONS[kind].code
    for kind in G.ACT_KINDS:
        assert G._act_code(kind) == ACTIVATIONS[kind].code
    assert set(G.ACT_KINDS) <= set(A.ACT_KINDS) == set(ACT_NAMES)


def test_unknown_kinds_raise():
    with pytest.raises(ValueError, match="relu"):
        act_code("relu")
    with pytest.raises(ValueError, match="gated_mlp.*quick_gelu"):
        G._act_code("quick_gelu")  # in the table, but the gated op does not offer it
    with pytest.raises(ValueError, match="unknown activation kind"):
        A.approx_act(torch.randn(3), "relu")
    with pytest.raises(ValueError):
        G.gated_act(torch.randn(2, 3), torch.randn(2, 3), "relu")
    assert get_activation("silu").torch_fwd is F.silu


@pytest.mark.parametrize("kind", ACT_NAMES)
def test_torch_derivative_is_the_derivative(kind):
    x = torch.linspace(-6, 6, 97, dtype=torch.float64, requires_grad=True)
    act = ACTIVATIONS[kind]
    (d,) = torch.autograd.grad(act.torch_fwd(x).sum(), x)
    torch.testing.assert_close(act.torch_grad(torch.ones_like(x), x.detach()), d, rtol=1e-10, atol=1e-12)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from lmbp_convert.ops.activations import act_and_grad_f32, act_f32

    @triton.jit
    def _eval_kernel(x_ptr, y_ptr, dy_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        a, da = act_and_grad_f32(x, ACT)
        tl.store(y_ptr + offs, act_f32(x, ACT) - a, mask=offs < n)  # the two helpers agree bit for bit
        tl.store(dy_ptr + offs, da, mask=offs < n)
        tl.store(x_ptr + offs, a, mask=offs < n)


@needs_triton
@pytest.mark.parametrize("kind", ACT_NAMES)
def test_triton_branch_matches_torch(kind):
    act = ACTIVATIONS[kind]
    x = torch.linspace(-8, 8, 201)
    buf, same, dy = x.clone(), torch.empty_like(x), torch.empty_like(x)
    _eval_kernel[(1,)](buf, same, dy, x.numel(), ACT=act.code, BLOCK=256)
    assert torch.equal(same, torch.zeros_like(x))
    torch.testing.assert_close(buf, act.torch_fwd(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dy, act.torch_grad(torch.ones_like(x), x), rtol=1e-5, atol=1e-6)


@needs_triton
def test_unknown_code_does_not_compile():
    x = torch.zeros(4)
    with pytest.raises(Exception, match="unknown activation code"):
        _eval_kernel[(1,)](x, x.clone(), x.clone(), 4, ACT=len(ACTIVATIONS), BLOCK=4)
