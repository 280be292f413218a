"""Test session setup.

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
_here = os.path.dirname(os.path.abspath(__file__))
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
