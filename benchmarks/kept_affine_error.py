"""Gradient error of the affine-keeping memory-sharing norm (`lmbp_convert.ops.ms_norm_affine`) against an fp64
reference, next to torch's own LayerNorm / RMSNorm run in the same dtype: realistic γ, β (γ ≈ 1 ± 0.3 with some
negative channels, β ≈ ±0.3) and hostile ones (γ = 0, ±1e-6, −3e-4, 2e-3 on a few channels, a channel with
β/γ = 80, plus a wide γ spread), with the guard (the unreliable channels keep their input columns) and without
it (every channel inverted, γ clamped at 1e-3 as a stand-in for Apex's clamp). Errors: max |Δ| / max |ref| per
gradient (dx, dγ, dβ), the worst over 5 seeds; rows of 1024, 256 rows.

    python -m benchmarks.kept_affine_error
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmbp_convert.fold import unreliable_channels
from lmbp_convert.ops import ms_norm_affine as M

N, ROWS = 1024, 256


def gammas(kind: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = 1 + 0.3 * torch.randn(N, generator=gen)
    w[: N // 16] *= -1
    b = 0.3 * torch.randn(N, generator=gen)
    if kind == "hostile":
        w[:8] = torch.tensor([0.0, 1e-6, -1e-6, -3e-4, 2e-3, 0.0, 5e-3, -2e-3])
        b[8], w[8] = 4.0, 0.05
        w[16:64] = torch.logspace(-3, 1, 48) * torch.sign(torch.randn(48, generator=gen))
    return w, b


def _ref(norm: str, x, w, b):
    if norm == "layer":
        return F.layer_norm(x, (N,), w, b, 1e-5)
    return F.rms_norm(x, (N,), w, 1e-5) + b


def _grads(fn, x, w, b, g):
    x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
    return torch.autograd.grad(fn(x, w, b), (x, w, b), g)


def _err(got, ref) -> float:
    return float((got.double() - ref).abs().max() / ref.abs().max())


def measure(norm: str, dtype: torch.dtype, dist: str, seeds: int = 5) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        w, b = gammas(dist, gen)
        x = (torch.randn(ROWS, N, generator=gen) * 1.5 + 0.2).to(dtype)
        g = torch.randn(ROWS, N, generator=gen).to(dtype)
        wd, bd = w.to(dtype), b.to(dtype)
        ref = _grads(lambda a, c, d: _ref(norm, a, c, d), x.double(), wd.double(), bd.double(), g.double())
        rms = norm == "rms"
        idx = torch.nonzero(unreliable_channels(wd, bd, False)).reshape(-1)
        wc = torch.where(wd.abs() < 1e-3, torch.where(wd < 0, -1e-3, 1e-3).to(dtype), wd)
        runs = {
            "torch": lambda a, c, d: _ref(norm, a, c, d),
            "guarded": lambda a, c, d: M.ms_norm_affine(a, c, d, N, 1e-5, rms, keep_idx=idx),
            # no guard: inverts every channel; the forward uses γ, the backward divides by γ clamped at 1e-3
            "clamped": lambda a, c, d: _Clamped.apply(a, c, d, wc, rms),
        }
        for name, fn in runs.items():
            got = _grads(fn, x, wd, bd, g)
            errs = [_err(a, r) for a, r in zip(got, ref)]
            prev = out.setdefault(name, [0.0, 0.0, 0.0])
            out[name] = [e if e != e or p != p else max(p, e) for p, e in zip(prev, errs)]  # NaN sticks
        out.setdefault("kept", [0])[0] = int(idx.numel())
    return out


class _Clamped(torch.autograd.Function):
    """The unguarded route for comparison: the op's own backward with every channel inverted by a clamped γ."""

    @staticmethod
    def forward(ctx, x, w, b, wc, rms):
        y, rstd, mean = M._fwd_torch(x, w, b, N, 1e-5, rms, False, x.dtype)
        ctx.save_for_backward(y, rstd, wc, b, w)
        ctx.rms, ctx.xd = rms, x.dtype
        return y

    @staticmethod
    def backward(ctx, g):
        y, rstd, wc, b, w = ctx.saved_tensors
        gf, r = g.float(), rstd.reshape(-1, 1)
        xh = (y.float() - b.float()) / wc.float()  # every channel inverted, γ clamped away from 0
        gh = gf * w.float()
        dx = gh - xh * (gh * xh).mean(-1, keepdim=True)
        if not ctx.rms:
            dx = dx - gh.mean(-1, keepdim=True)
        return ((dx * r).to(ctx.xd), (gf * xh).sum(0).to(w.dtype), gf.sum(0).to(b.dtype), None, None)


def main() -> None:
    print(f"rows {ROWS} × {N}; max|Δ|/max|ref| vs fp64 (dx, dγ, dβ), worst of 5 seeds")
    for norm in ("layer", "rms"):
        for dtype in (torch.float32, torch.bfloat16):
            for dist in ("realistic", "hostile"):
                r = measure(norm, dtype, dist)
                cells = "  ".join(f"{k} " + "/".join(f"{e:.1e}" for e in r[k]) for k in ("torch", "guarded", "clamped"))
                print(f"{norm:5s} {str(dtype)[6:]:8s} {dist:9s} kept {r['kept'][0]:3d}  {cells}", flush=True)


if __name__ == "__main__":
    main()
