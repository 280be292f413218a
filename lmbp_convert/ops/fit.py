"""Fit the step-derivative constants of an Approx-BP activation (arXiv 2406.16282, Sec. 4).

An activation h is approximated by f(x) = sum_i a_i * relu(x - c_i), i = 1..m, m = 2**k - 1. The derivative
f' is a step function with 2**k levels, so backward only needs a k-bit code per element (how many thresholds
x exceeds). The paper's fit::

    minimise  integral over R of (h(x) - f(x))**2 dx   subject to  sum(a) = 1,  sum(a * c) = 0

The constraints make f match h's asymptotes (0 at -inf, x at +inf); without them the integral diverges.

Method (variable projection):

* For fixed c the objective is quadratic in a with two linear equality constraints: one KKT solve.
  The basis is rewritten as phi_i(x) = relu(x - c_i) - relu(x) + c_i * H(x) (H = Heaviside step) and the
  target as h(x) - relu(x); under the constraints the residual is unchanged, but every phi_i now has compact
  support and the target decays, so the Gram matrix has finite, well-scaled entries.
* c is optimised with L-BFGS (float64, autograd through the quadrature and the KKT solve), from several
  deterministic starts: symmetric spreads, the (k-1)-bit solution with thresholds inserted (which makes the
  objective non-increasing in k), and seeded jitters of the best start.
* Quadrature: composite Gauss-Legendre on [-L, L] split at every kink (the c_i and 0), so each panel's
  integrand is smooth and the objective is a smooth function of c. L = 40 covers every supported kind: the
  slowest tail (SiLU, |x| e^-|x|) contributes < 1e-30 beyond it.

scipy is deliberately not used (not a dependency); torch provides everything needed.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import torch

__all__ = [
    "FIT_KINDS",
    "PAPER_CONSTANTS",
    "FitResult",
    "reference",
    "objective",
    "solve_slopes",
    "fit",
]

FIT_KINDS = ("gelu", "gelu_tanh", "silu", "quick_gelu")

#: Constants published in the paper (ReGELU2, ReSiLU2). The op uses these exactly for 2-bit gelu/silu.
PAPER_CONSTANTS: dict[tuple[str, int], dict[str, tuple[float, ...]]] = {
    ("gelu", 2): {
        "a": (-0.04922261145617846, 1.0979632065417297, -0.048740595085551286),
        "c": (-3.1858810036855245, -0.001178821281161997, 3.190832613414926),
    },
    ("silu", 2): {
        "a": (-0.04060357190528599, 1.080925428529668, -0.040321856624382146),
        "c": (-6.3050461001646445, -0.0008684942046214787, 6.325815242089708),
    },
}

DEFAULT_HALF_WIDTH = 40.0  # L: integrate over [-L, L]
DEFAULT_PANEL_WIDTH = 1.0
DEFAULT_ORDER = 16  # Gauss-Legendre nodes per panel
_DT = torch.float64


# ---------------------------------------------------------------------------------------------------------
# Reference activations (float64)
# ---------------------------------------------------------------------------------------------------------
def _gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x * math.sqrt(0.5)))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_REFERENCES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "silu": _silu,
    "quick_gelu": _quick_gelu,
}


def reference(kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The exact activation ``kind`` as a float64-friendly torch function."""
    try:
        return _REFERENCES[kind]
    except KeyError:
        raise ValueError(f"unknown activation kind {kind!r}; expected one of {FIT_KINDS}") from None


# ---------------------------------------------------------------------------------------------------------
# Quadrature
# ---------------------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _gauss_legendre(order: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes and weights on [-1, 1] (Golub-Welsch: eigen-decomposition of the Jacobi matrix)."""
    k = torch.arange(1, order, dtype=_DT)
    beta = k / torch.sqrt(4.0 * k * k - 1.0)
    jacobi = torch.diag(beta, 1) + torch.diag(beta, -1)
    nodes, vecs = torch.linalg.eigh(jacobi)
    weights = 2.0 * vecs[0, :] ** 2
    return nodes, weights


def _quadrature(c: torch.Tensor, half_width: float, panel_width: float, order: int):
    """Nodes/weights on [-L, L] with panel edges at every kink; differentiable in c (edges move with c)."""
    t, w = _gauss_legendre(order)
    lim = torch.tensor([-half_width, 0.0, half_width], dtype=_DT)
    pts = torch.sort(torch.cat([lim, c.clamp(-half_width, half_width)])).values
    los, his = [], []
    widths = (pts[1:] - pts[:-1]).detach()
    for j in range(pts.numel() - 1):
        n = max(1, math.ceil(float(widths[j]) / panel_width))
        frac = torch.arange(n + 1, dtype=_DT) / n
        edges = pts[j] + (pts[j + 1] - pts[j]) * frac
        los.append(edges[:-1])
        his.append(edges[1:])
    lo, hi = torch.cat(los), torch.cat(his)
    half, mid = 0.5 * (hi - lo), 0.5 * (hi + lo)
    x = (mid[:, None] + half[:, None] * t[None, :]).reshape(-1)
    wx = (half[:, None] * w[None, :]).reshape(-1)
    return x, wx


def _objective_t(kind: str, a: torch.Tensor, c: torch.Tensor, half_width: float, panel_width: float,
                 order: int) -> torch.Tensor:
    x, w = _quadrature(c, half_width, panel_width, order)
    f = (a[None, :] * torch.relu(x[:, None] - c[None, :])).sum(1)
    r = reference(kind)(x) - f
    return (w * r * r).sum()


def objective(kind: str, a, c, *, half_width: float = DEFAULT_HALF_WIDTH,
              panel_width: float = DEFAULT_PANEL_WIDTH, order: int = DEFAULT_ORDER) -> float:
    """integral_{-L}^{L} (h(x) - sum_i a_i relu(x - c_i))**2 dx for any (a, c), e.g. the paper's constants."""
    a_t = torch.as_tensor(a, dtype=_DT).reshape(-1)
    c_t = torch.as_tensor(c, dtype=_DT).reshape(-1)
    if a_t.shape != c_t.shape:
        raise ValueError(f"a and c must have the same length, got {a_t.numel()} and {c_t.numel()}")
    return float(_objective_t(kind, a_t, c_t, half_width, panel_width, order))


def _solve_a_t(kind: str, c: torch.Tensor, half_width: float, panel_width: float, order: int) -> torch.Tensor:
    m = c.numel()
    if m == 1:  # sum(a) = 1 and a*c = 0 leave nothing to choose
        return torch.ones(1, dtype=_DT)
    x, w = _quadrature(c, half_width, panel_width, order)
    relu_x = torch.relu(x)
    step = (x > 0).to(_DT)
    phi = torch.relu(x[:, None] - c[None, :]) - relu_x[:, None] + c[None, :] * step[:, None]
    target = reference(kind)(x) - relu_x
    gram = phi.T @ (w[:, None] * phi)
    rhs = phi.T @ (w * target)
    cons = torch.stack([torch.ones_like(c), c])  # (2, m)
    kkt = torch.cat([torch.cat([gram, cons.T], 1), torch.cat([cons, torch.zeros(2, 2, dtype=_DT)], 1)], 0)
    b = torch.cat([rhs, torch.tensor([1.0, 0.0], dtype=_DT)])
    return torch.linalg.solve(kkt, b)[:m]


def solve_slopes(kind: str, c, *, half_width: float = DEFAULT_HALF_WIDTH,
                 panel_width: float = DEFAULT_PANEL_WIDTH, order: int = DEFAULT_ORDER) -> tuple[float, ...]:
    """The optimal a for fixed thresholds c (equality-constrained least squares via its KKT system)."""
    c_t = torch.as_tensor(c, dtype=_DT).reshape(-1)
    return tuple(float(v) for v in _solve_a_t(kind, c_t, half_width, panel_width, order))


# ---------------------------------------------------------------------------------------------------------
# Outer optimisation over c
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FitResult:
    """Fitted constants for one activation and bit width. ``c`` is sorted ascending."""

    kind: str
    bits: int
    a: tuple[float, ...]
    c: tuple[float, ...]
    objective: float
    settings: dict = field(default_factory=dict, compare=False)

    @property
    def slopes(self) -> tuple[float, ...]:
        """Derivative of the fit on each of the 2**bits intervals: cumulative sums of a, from 0 to sum(a)."""
        out, s = [0.0], 0.0
        for v in self.a:
            s += v
            out.append(s)
        return tuple(out)


def _to_params(c: torch.Tensor) -> torch.Tensor:
    """Sorted, distinct thresholds <-> (c_1, log gaps): keeps the KKT system non-singular during the search."""
    gaps = (c[1:] - c[:-1]).clamp_min(1e-6)
    return torch.cat([c[:1], torch.log(gaps)])


def _from_params(u: torch.Tensor) -> torch.Tensor:
    return torch.cat([u[:1], u[:1] + torch.cumsum(torch.exp(u[1:]), 0)])


def _optimise(kind: str, c0: torch.Tensor, settings: dict, max_iter: int) -> tuple[torch.Tensor, float]:
    hw, pw, order = settings["half_width"], settings["panel_width"], settings["order"]

    def value(u: torch.Tensor) -> torch.Tensor:
        c = _from_params(u)
        a = _solve_a_t(kind, c, hw, pw, order)
        return _objective_t(kind, a, c, hw, pw, order)

    u = _to_params(c0.clone()).requires_grad_(True)
    with torch.no_grad():
        scale = float(value(u))
    opt = torch.optim.LBFGS([u], lr=1.0, max_iter=max_iter, history_size=20, tolerance_grad=1e-10,
                            tolerance_change=1e-14, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = value(u) / scale
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        c = _from_params(u.detach())
        return c, float(value(u.detach()))


def _insert_thresholds(c: torch.Tensor) -> torch.Tensor:
    """(2m+1) thresholds from m: the old ones, the midpoints, and one beyond each end."""
    m = c.numel()
    if m == 1:
        return torch.cat([c - 2.0, c, c + 2.0])
    gap = float((c[1:] - c[:-1]).min())
    mids = 0.5 * (c[1:] + c[:-1])
    return torch.sort(torch.cat([c, mids, c[:1] - gap, c[-1:] + gap])).values


def _density_start(kind: str, m: int, half_width: float) -> torch.Tensor:
    """Knots at the quantiles of |h''|**(2/5): the asymptotically L2-optimal knot density of a linear spline."""
    x = torch.linspace(-half_width, half_width, 40001, dtype=_DT)
    h, step = reference(kind), 1e-3
    curv = ((h(x + step) - 2.0 * h(x) + h(x - step)) / step**2).abs().pow(0.4)
    cdf = torch.cat([torch.zeros(1, dtype=_DT), torch.cumsum(0.5 * (curv[1:] + curv[:-1]) * (x[1:] - x[:-1]), 0)])
    cdf = cdf / cdf[-1]
    q = (torch.arange(m, dtype=_DT) + 0.5) / m
    idx = torch.searchsorted(cdf, q).clamp(1, x.numel() - 1)
    lo, hi = cdf[idx - 1], cdf[idx]
    t = (q - lo) / (hi - lo).clamp_min(1e-300)
    return x[idx - 1] + t * (x[idx] - x[idx - 1])


def _mirror(c: torch.Tensor) -> torch.Tensor:
    """The symmetrised thresholds (c - reversed(c)) / 2: the basin of the mirror-symmetric optimum that even
    h - relu (every kind here) tends to have; for other activations it is just one more start."""
    return 0.5 * (c - c.flip(0))


@contextlib.contextmanager
def _one_thread():
    """The problem is a few thousand nodes by <= 15 columns: thread start-up dominates, and on a loaded
    machine intra-op threads make each step 10-50x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def fit(kind: str, bits: int, *, half_width: float = DEFAULT_HALF_WIDTH, panel_width: float = DEFAULT_PANEL_WIDTH,
        order: int = DEFAULT_ORDER, n_jitter: int = 2, seed: int = 0, max_iter: int = 200) -> FitResult:
    """Fit 2**bits - 1 thresholds and slopes for ``kind`` (deterministic; results are cached).

    Starts: knots at the quantiles of |h''|**(2/5), symmetric spreads s*linspace(-1, 1, m) for s in
    {1.5, 3, 6}, the (bits-1) solution with thresholds inserted (fitted recursively; keeps the objective
    non-increasing in bits), then the symmetrised best and ``n_jitter`` seeded perturbations of the best.
    Returns the best fit found (a local search: several starts, no global-optimality certificate).
    """
    reference(kind)  # validates kind
    # validated before the cache: True == 1 would otherwise hit the 1-bit entry
    if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 4:
        raise ValueError(f"bits must be an int in 1..4, got {bits!r}")
    with _one_thread():
        return _fit(kind, bits, half_width=half_width, panel_width=panel_width, order=order, n_jitter=n_jitter,
                    seed=seed, max_iter=max_iter)


@lru_cache(maxsize=None)
def _fit(kind: str, bits: int, *, half_width: float, panel_width: float, order: int, n_jitter: int, seed: int,
         max_iter: int) -> FitResult:
    settings = {"half_width": half_width, "panel_width": panel_width, "order": order, "n_jitter": n_jitter,
                "seed": seed, "max_iter": max_iter}
    m = 2**bits - 1
    if m == 1:
        a, c = torch.ones(1, dtype=_DT), torch.zeros(1, dtype=_DT)
        obj = float(_objective_t(kind, a, c, half_width, panel_width, order))
        return FitResult(kind, bits, (1.0,), (0.0,), obj, settings)

    prev = _fit(kind, bits - 1, half_width=half_width, panel_width=panel_width, order=order, n_jitter=n_jitter,
                seed=seed, max_iter=max_iter)
    starts = [_density_start(kind, m, half_width)]
    starts += [s * torch.linspace(-1.0, 1.0, m, dtype=_DT) for s in (1.5, 3.0, 6.0)]
    starts.append(_insert_thresholds(torch.tensor(prev.c, dtype=_DT)))

    best_c, best_obj = None, math.inf

    def attempt(c0: torch.Tensor) -> None:
        nonlocal best_c, best_obj
        c, obj = _optimise(kind, torch.sort(c0).values, settings, max_iter)
        if math.isfinite(obj) and obj < best_obj:
            best_c, best_obj = c, obj

    for c0 in starts:
        attempt(c0)
    attempt(_mirror(best_c))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n_jitter):
        spread = float((best_c[1:] - best_c[:-1]).min()) * 0.3
        attempt(best_c + spread * torch.randn(m, generator=gen, dtype=_DT))

    a = _solve_a_t(kind, best_c, half_width, panel_width, order)
    obj = float(_objective_t(kind, a, best_c, half_width, panel_width, order))
    return FitResult(kind, bits, tuple(float(v) for v in a), tuple(float(v) for v in best_c), obj, settings)
