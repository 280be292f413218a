"""benchmarks.checkpoint --small runs end to end and prints its table (the full-size run is manual)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs the checkpoint benchmark end to end

ROOT = Path(__file__).resolve().parents[2]  # the checkout: `python -m benchmarks.checkpoint` runs from it


def test_bench_small_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.checkpoint", "--small", "--repeat", "1",
                           "--dir", str(tmp_path / "work")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    for row in ("plain copy (shutil.copy)", "streaming write", "throughput vs copy", "peak RSS", "spot check"):
        assert row in proc.stdout
    assert "max |DST - fold(SRC)| = 0 " in proc.stdout  # bit-identical to fold_affine
    assert not (tmp_path / "work").exists()  # cleaned up
