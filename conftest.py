"""Test session setup, for tests/ and benchmarks/tests/ (the checkout root's conftest, so both get it).

Triton's interpreter must be switched on before any kernel is defined, so this runs before the package is
imported: in CI (no GPU) the Triton kernels then execute on CPU tensors and are compared with the PyTorch path.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import sys  # noqa: E402

# Test files mirror the package (tests/ops/test_gated_mlp.py and tests/nn/test_gated_mlp.py), so pytest runs
# with --import-mode=importlib; shared helpers are imported by name from these folders.
_here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests")
for _p in (_here, os.path.join(_here, "ops")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# Model families whose every test takes seconds on 2 cores (Swin: windowed attention, 4 stages). Their cases are
# `slow` (left out of `pytest -m "not slow"`) except the conversion check itself, so the fast loop still converts one.
SLOW_FAMILIES = {"timm_swin"}
SLOW_FAMILY_KEPT_IN_FAST_LOOP = {"test_family_converts_with_exact_outputs"}


def pytest_collection_modifyitems(items):
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (SLOW_FAMILIES & {v for v in params.values() if isinstance(v, str)}
                and item.originalname not in SLOW_FAMILY_KEPT_IN_FAST_LOOP):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def past_doors():
    """Plan folds a door could see as folds (`lmbp_convert.match.doors.fold_past_doors`, as the checkpoint CLI plans):
    for tests of the fold machinery itself (re-apply sites, unfolding, fold-on-load, untying, the fold's analysis on
    toy models whose norm sits in the model's own frame), on folds that ``convert(fold_norms=True)`` would keep
    exact. Which folds convert() keeps exact is tests/match/test_doors.py's business."""
    from lmbp_convert.match.doors import fold_past_doors

    with fold_past_doors():
        yield
