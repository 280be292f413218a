"""Memory-sharing cross-entropy: values and logits gradients against torch's fp32 cross-entropy per dtype,
ignore_index / reductions / divisor, the Triton kernels (interpreter) against the PyTorch path, the chunked
backward's single gradient, exact saved bytes, autocast and torch.compile(fullgraph=True)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import tol

from lmbp_convert.memory import SavedTensorLedger
from lmbp_convert.ops import cross_entropy as C
from lmbp_convert.ops._common import HAS_TRITON
from lmbp_convert.ops.cross_entropy import cross_entropy, cross_entropy_rows

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def _inputs(n, v, dtype, ignore=-100, frac=0.25, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=gen) * 3).to(dtype)
    t = torch.randint(0, v, (n,), generator=gen)
    t[torch.rand(n, generator=gen) < frac] = ignore
    return x, t


def _ref(x, t, ignore=-100, reduction="mean", divisor=None):
    """HF's computation: fp32 upcast, torch's cross-entropy, the sum divided by num_items_in_batch."""
    loss = F.cross_entropy(x.float(), t, ignore_index=ignore, reduction=reduction)
    return loss if divisor is None else loss / divisor


def _grads(fn, x, *args, **kw):
    x = x.detach().clone().requires_grad_()
    loss = fn(x, *args, **kw)
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), g


def _grad_tol(dtype, g):
    """One rounding of the gradient's dtype at the largest gradient (HF rounds its fp32 gradient once too), plus a
    few fp32 ulps by which two fp32 exp/log implementations differ."""
    eps = 2 * torch.finfo(dtype).eps + 8 * torch.finfo(torch.float32).eps
    return dict(atol=eps * float(g.abs().max().float()) + 1e-8, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction,divisor", [("mean", None), ("sum", None), ("sum", 37), ("sum", "tensor")])
def test_matches_fp32_reference(dtype, reduction, divisor):
    x, t = _inputs(53, 301, dtype)
    div = torch.tensor(37) if divisor == "tensor" else divisor
    loss, g = _grads(cross_entropy, x, t, -100, reduction, div)
    loss_r, g_r = _grads(_ref, x, t, -100, reduction, div)
    assert loss.dtype == torch.float32 and g.dtype == dtype and g.shape == x.shape
    torch.testing.assert_close(loss, loss_r, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g.float(), g_r.float(), **_grad_tol(dtype, g_r))


@pytest.mark.parametrize("ignore", [-100, 0, 7])
def test_ignore_index(ignore):
    x, t = _inputs(40, 64, torch.float32, ignore=ignore, frac=0.4)
    loss, g = _grads(cross_entropy, x, t, ignore)
    loss_r, g_r = _grads(_ref, x, t, ignore)
    torch.testing.assert_close(loss, loss_r, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g, g_r, atol=1e-7, rtol=1e-6)
    assert torch.count_nonzero(g[t == ignore]) == 0
    rows = cross_entropy_rows(x, t, ignore)
    assert torch.count_nonzero(rows[t == ignore]) == 0


def test_all_ignored_mean_is_nan_with_zero_gradient():
    """As torch: 0/0 for the mean, and no gradient flows from ignored rows."""
    x, _ = _inputs(6, 10, torch.float32)
    t = torch.full((6,), -100)
    loss, g = _grads(cross_entropy, x, t)
    loss_r, g_r = _grads(_ref, x, t)
    assert torch.isnan(loss) and torch.isnan(loss_r)
    assert torch.equal(g, g_r) and torch.count_nonzero(g) == 0


def test_leading_dims_and_fp64_gradcheck():
    x, t = _inputs(12, 9, torch.float64)
    x = x.reshape(3, 4, 9).requires_grad_()
    t = t.reshape(3, 4)
    assert torch.autograd.gradcheck(lambda z: cross_entropy(z, t, reduction="sum"), (x,))
    with pytest.raises(ValueError, match="targets for"):
        cross_entropy(x, t[:2])
    with pytest.raises(ValueError, match="divisor"):
        cross_entropy(x, t, divisor=3)
    with pytest.raises(TypeError, match="int64 or int32"):
        cross_entropy(x, t.float())


def test_out_of_range_target_raises():
    x, t = _inputs(4, 10, torch.float32, frac=0.0)
    t[1] = 10
    with pytest.raises((IndexError, RuntimeError)):
        cross_entropy(x, t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_path_equals_one_chunk(dtype, monkeypatch):
    """Row chunks of 1, 3 and all rows give the same values bit for bit (each row is computed alone)."""
    x, t = _inputs(17, 50, dtype)
    outs = []
    for chunk in (1, 3, 10 ** 6):
        monkeypatch.setattr(C, "CHUNK_ELEMENTS", chunk * 50)
        outs.append(_grads(cross_entropy, x, t, -100, "sum"))
    for loss, g in outs[1:]:
        assert torch.equal(g, outs[0][1])
        torch.testing.assert_close(loss, outs[0][0], atol=0, rtol=1e-6)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_saves_the_logits_storage_lse_and_targets_only(dtype):
    """Exact ledger: the logits themselves (the very storage, no copy), fp32 lse per row, the targets, the mean's
    divisor. HF's upcast path keeps an fp32 (N, V) log-softmax instead."""
    n, v = 64, 1000
    x, t = _inputs(n, v, dtype)
    x.requires_grad_()
    with SavedTensorLedger() as ledger:
        loss = cross_entropy(x, t)
    assert ledger.bytes == n * v * x.element_size() + n * 4 + n * 8 + 4
    kept = [e for e in ledger.entries if e.shape == (n, v)]
    assert len(kept) == 1 and kept[0].dtype == dtype
    with SavedTensorLedger() as ledger_hf:
        _ref(x, t)
    assert ledger_hf.bytes == n * v * 4 + n * 8 + 4
    loss.backward()
    assert x.grad.dtype == dtype


def test_backward_makes_one_gradient_and_bounded_scratch(monkeypatch):
    """Every storage the backward allocates is either the one (N, V) gradient in the logits' dtype or a chunk of at
    most CHUNK_ELEMENTS fp32 values (plus per-row vectors)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    n, v = 64, 1000
    monkeypatch.setattr(C, "CHUNK_ELEMENTS", 8 * v)
    x, t = _inputs(n, v, torch.bfloat16)
    x.requires_grad_()
    loss = cross_entropy(x, t)
    storages = {}

    class Allocs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor):
                    storages[o.untyped_storage().data_ptr()] = (o.untyped_storage().nbytes(), o.dtype)
            return out

    with Allocs():
        loss.backward()
    storages.pop(x.untyped_storage().data_ptr(), None)  # views of the saved logits
    big = [s for s in storages.values() if s[0] > 8 * v * 4]
    assert big == [(n * v * 2, torch.bfloat16)]
    assert max(s[0] for s in storages.values() if s[1] == torch.float32) <= 8 * v * 4


def test_autocast_keeps_the_logits_dtype():
    x, t = _inputs(20, 33, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, g = _grads(cross_entropy, x, t)
    loss_r, g_r = _grads(_ref, x, t)
    assert loss.dtype == torch.float32 and g.dtype == torch.bfloat16
    torch.testing.assert_close(loss, loss_r, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g.float(), g_r.float(), **_grad_tol(torch.bfloat16, g_r))


# ------------------------------------------------------------------------- Triton launchers (interpreter)
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v,block", [(37, None), (301, 64), (64, 64)])
def test_triton_kernels_match_the_pytorch_path(dtype, v, block):
    """The kernels (Triton's interpreter on CPU tensors) against the PyTorch path: per-row loss and lse to fp32
    rounding; the gradient to one rounding of the dtype (the interpreter truncates fp32 → bf16). Rows with
    -inf logits and an ignored row included; the upstream gradient is an expanded scalar (stride 0), as a sum
    gives it."""
    x, t = _inputs(9, v, dtype)
    x[2, :5] = float("-inf")
    t[2] = 6
    loss_t, lse_t = C._fwd_triton(x, t, -100, block=block)
    loss_p, lse_p = C._fwd_torch(x, t, -100)
    torch.testing.assert_close(loss_t, loss_p, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(lse_t, lse_p, atol=1e-5, rtol=1e-6)
    for g in (torch.rand(9), torch.tensor(0.7).expand(9)):
        dx_t = C._bwd_triton(g, x, t, lse_p, -100, block=block)
        dx_p = C._bwd_torch(g, x, t, lse_p, -100)
        assert dx_t.dtype == dtype
        torch.testing.assert_close(dx_t.float(), dx_p.float(), **_grad_tol(dtype, dx_p.float()))
        assert torch.count_nonzero(dx_t[t == -100]) == 0


@needs_triton
def test_triton_dispatch_end_to_end(monkeypatch):
    """The op with Triton dispatch forced on (CPU tensors, interpreter): same loss, gradient and saved bytes."""
    monkeypatch.setattr(C, "use_triton", lambda x: x.dtype in DTYPES)
    x, t = _inputs(21, 130, torch.bfloat16)
    x.requires_grad_()
    with SavedTensorLedger() as ledger:
        loss = cross_entropy(x, t, reduction="sum", divisor=torch.tensor(11))
    assert ledger.bytes == 21 * 130 * 2 + 21 * 4 + 21 * 8 + 8  # the divisor tensor (int64) for DivBackward
    (g,) = torch.autograd.grad(loss, x)
    loss_r, g_r = _grads(_ref, x, t, -100, "sum", torch.tensor(11))
    torch.testing.assert_close(loss, loss_r, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(g.float(), g_r.float(), **_grad_tol(torch.bfloat16, g_r.float()))


# ------------------------------------------------------------------------------------------------ compile
@pytest.mark.parametrize("backend", ("torch", pytest.param("triton", marks=needs_triton)))
def test_compile_fullgraph_matches_eager(backend, monkeypatch):
    """fullgraph=True: the PyTorch path traces into one graph; 'triton' exercises the library ops (fake impls
    under dynamo, kernels under the interpreter)."""
    if backend == "triton":
        monkeypatch.setattr(C, "use_triton", lambda x: x.dtype in DTYPES)
    torch._dynamo.reset()
    lin = torch.nn.Linear(16, 40)
    h = torch.randn(3, 5, 16)
    t = torch.randint(0, 40, (3, 5))
    t[0, :2] = -100

    def step(h):
        logits = lin(h)
        return cross_entropy(logits, t, reduction="sum", divisor=7), logits

    def run(fn):
        lin.zero_grad()
        loss, logits = fn(h)
        loss.backward()
        return loss.detach(), logits.detach(), lin.weight.grad.clone()

    eager = run(step)
    comp = run(torch.compile(step, fullgraph=True, backend="aot_eager" if backend == "triton" else "inductor"))
    for a, b in zip(comp, eager):
        torch.testing.assert_close(a, b, **tol(torch.float32, "bwd"))


SM90_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lmbp_convert.ops import cross_entropy as CE

def compile_(fn, sig, consts, warps):
    src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]

for dt in ("bf16", "fp16", "fp32"):
    compile_(CE._ce_fwd_kernel, {"X": f"*{dt}", "T": "*i64", "LOSS": "*fp32", "LSE": "*fp32", "stride_x": "i32",
                                 "V": "i32", "ignore_index": "i32"}, dict(BLOCK=CE.BLOCK), 8)
    compile_(CE._ce_bwd_kernel, {"G": "*fp32", "X": f"*{dt}", "T": "*i64", "LSE": "*fp32", "DX": f"*{dt}",
                                 "stride_g": "i32", "stride_x": "i32", "stride_dx": "i32", "V": "i32",
                                 "ignore_index": "i32"}, dict(BLOCK=CE.BLOCK), 8)
print("compiled")
"""


@needs_triton
@pytest.mark.slow  # real compiles
def test_kernels_compile_for_sm90():
    """The interpreter accepts things the compiler rejects: both kernels compile to PTX for sm_90 (no GPU)."""
    import os
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", SM90_SCRIPT], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "0"})
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-4000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "divisor"])
@pytest.mark.parametrize("chunk", [None, 1, 3, 7])
def test_torch_backward_is_bitwise_hf_loss(dtype, reduction, chunk, monkeypatch):
    """In full precision the PyTorch path's logits gradient is HF's ``F.cross_entropy(logits.float(), ...)``
    gradient bit for bit (ignored rows, chunks of 1, 3, 7 rows and one chunk)."""
    if chunk is not None:
        monkeypatch.setattr(C, "CHUNK_ELEMENTS", chunk * 101)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(13, 101, generator=gen).to(dtype).requires_grad_()
    t = torch.randint(0, 101, (13,), generator=gen)
    t[[2, 5]] = -100
    ref_x = x.detach().clone().requires_grad_()
    up = ref_x.float() if dtype is torch.float32 else ref_x  # fp64 logits: the loss works in fp64 (not HF's cast)
    if reduction == "divisor":
        ref = F.cross_entropy(up, t, reduction="sum") / 7
        out = cross_entropy(x, t, reduction="sum", divisor=7)
    else:
        ref = F.cross_entropy(up, t, reduction=reduction)
        out = cross_entropy(x, t, reduction=reduction)
    ref.backward()
    out.backward()
    assert torch.equal(out.detach(), ref.detach())
    assert torch.equal(x.grad, ref_x.grad)


# ------------------------------------------------------------------------------------ non-finite logits
_NONFINITE = {  # (row, column, value): +inf at a target / elsewhere / in an ignored row, -inf, NaN, an all -inf row
    "+inf target": [(0, "t", float("inf"))], "+inf other": [(0, 4, float("inf"))],
    "+inf ignored row": [(2, 4, float("inf"))], "-inf target": [(0, "t", float("-inf"))],
    "-inf other": [(0, 4, float("-inf"))], "nan": [(1, 9, float("nan"))], "all -inf": [(3, slice(None), float("-inf"))],
}


@pytest.mark.parametrize("path", ("torch", pytest.param("triton", marks=needs_triton)))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(_NONFINITE))
def test_non_finite_logits_have_hfs_semantics(case, dtype, path, monkeypatch):
    """HF's ``F.cross_entropy(logits.float(), ...)``: a row whose log-softmax is undefined (a +inf or a NaN logit,
    all -inf) makes the loss NaN and its whole gradient row NaN, ignored or not; a -inf logit is +inf loss at the
    target and a finite gradient. The loss's value and the gradient's NaN pattern are HF's, its finite values to
    one rounding."""
    monkeypatch.setattr(C, "use_triton", lambda x: path == "triton")
    x, t = _inputs(6, 37, dtype, frac=0.0)
    t[2] = -100
    for row, col, val in _NONFINITE[case]:
        x[row, int(t[row]) if col == "t" else col] = val
    loss, g = _grads(cross_entropy, x, t)
    loss_r, g_r = _grads(_ref, x, t)
    assert torch.equal(loss.isnan(), loss_r.isnan()) and (loss.isnan() or loss == loss_r or
                                                          torch.isclose(loss, loss_r, atol=1e-5, rtol=1e-6))
    assert torch.equal(g.isnan(), g_r.isnan()), (int(g.isnan().sum()), int(g_r.isnan().sum()))
    finite = ~g_r.isnan()
    torch.testing.assert_close(g.float()[finite], g_r.float()[finite], **_grad_tol(dtype, g_r.float()[finite]))
    rows = cross_entropy_rows(x, t)
    assert torch.equal(rows.isnan(), F.cross_entropy(x.float(), t, reduction="none").isnan())


# ------------------------------------------------------------------------------------ out-of-range targets
@pytest.mark.parametrize("path", ("torch", pytest.param("triton", marks=needs_triton)))
@pytest.mark.parametrize("bad", (-1, -101, 10, 12))
def test_out_of_range_targets_raise_as_torch_before_any_launch(bad, path, monkeypatch):
    """A target that is neither ignore_index nor a class raises torch's IndexError, on every path, before a
    kernel reads the logits at it."""
    monkeypatch.setattr(C, "use_triton", lambda x: path == "triton")
    launched = []
    for name in ("_fwd_triton", "_fwd_torch"):
        real = getattr(C, name)
        monkeypatch.setattr(C, name, lambda *a, real=real, **k: (launched.append(1), real(*a, **k))[1])
    x, t = _inputs(5, 10, torch.float32, frac=0.0)
    t[3] = -100
    t[[1, 4]] = bad
    with pytest.raises(IndexError) as want:
        F.cross_entropy(x, t)
    with pytest.raises(IndexError) as got:
        cross_entropy(x.requires_grad_(), t)
    assert str(got.value) == str(want.value) == f"Target {bad} is out of bounds."
    assert not launched
    t[[1, 4]] = 9  # the last class and ignore_index themselves are fine
    cross_entropy(x, t)
    assert launched


# ------------------------------------------------------------------------------ logits edited after forward
_MODIFIED = "one of the variables needed for gradient computation has been modified by an inplace operation"


@pytest.mark.parametrize("path", ("torch", pytest.param("triton", marks=needs_triton)))
@pytest.mark.parametrize("hooks", ("none", "save_on_cpu", "copy"))
def test_logits_edited_in_place_after_forward_raise(hooks, path, monkeypatch):
    """The loss keeps the logits' storage, not a copy: an in-place edit after forward raises as autograd does for
    a saved tensor, with or without saved-tensor hooks (which switch autograd's own check off; ``save_on_cpu``
    keeps a CPU tensor itself), naming the logits and ``loss=False``; hooks that saved a copy are unaffected and
    give the gradient of the unedited logits."""
    from lmbp_convert.errors import LmbpError, LogitsModifiedError

    monkeypatch.setattr(C, "use_triton", lambda x: path == "triton")
    x0, t = _inputs(8, 33, torch.bfloat16)
    _, g_r = _grads(cross_entropy, x0, t)
    pack = {"none": None, "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(),
            "copy": lambda: torch.autograd.graph.saved_tensors_hooks(lambda a: a.clone(), lambda a: a)}[hooks]
    for edit in (lambda a: a.div_(2.0), lambda a: a.zero_()):
        x = x0.clone().requires_grad_()
        logits = x * 1  # a non-leaf, as a head's output
        if pack is None:
            loss = cross_entropy(logits.reshape(2, 4, 33), t.reshape(2, 4))
        else:
            with pack():
                loss = cross_entropy(logits.reshape(2, 4, 33), t.reshape(2, 4))
        with torch.no_grad():
            edit(logits)
        if hooks == "copy":
            loss.backward()
            assert torch.equal(x.grad, g_r)
            continue
        with pytest.raises(LogitsModifiedError) as err:
            loss.backward()
        assert isinstance(err.value, LmbpError) and isinstance(err.value, RuntimeError)
        msg = str(err.value)
        assert msg.startswith(_MODIFIED) and "[8, 33]" in msg and "loss=False" in msg and "memory-sharing" in msg
    x = x0.clone().requires_grad_()
    with pack() if pack is not None else torch.enable_grad():
        loss = cross_entropy(x * 1, t)
    loss.backward()  # no edit: the gradient as ever
    assert torch.equal(x.grad, g_r)


def test_inference_mode_and_no_grad_compute_the_loss():
    """No backward, nothing to watch: inference tensors (which have no version counter) and no_grad alike."""
    x, t = _inputs(6, 20, torch.float32)
    with torch.inference_mode():
        inf_loss = cross_entropy(x.clone(), t)
    with torch.no_grad():
        ng_loss = cross_entropy(x.clone().requires_grad_(), t)
    torch.testing.assert_close(inf_loss, _ref(x, t), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ng_loss, _ref(x, t), atol=1e-6, rtol=1e-6)
