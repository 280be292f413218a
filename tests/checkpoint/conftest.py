"""Fixtures of the checkpoint tests (helpers live in ckpt_helpers.py, importable by name from these tests)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ckpt_helpers import build_model, save_model  # noqa: E402


@pytest.fixture
def cli(capsys):
    """Run ``lmbp-convert`` in-process: returns (exit code, stdout, stderr)."""
    from lmbp_convert.cli import main

    def run(*args) -> tuple[int, str, str]:
        capsys.readouterr()  # drop what fixtures printed (save_pretrained's progress bars)
        rc = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """One sharded checkpoint per family, built once; tests must not modify them (they are hashed)."""
    cache: dict[tuple, Path] = {}

    def get(arch: str, dtype: torch.dtype = torch.float32) -> Path:
        key = (arch, dtype)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{arch}-{str(dtype).split('.')[-1]}") / "src"
            save_model(build_model(arch, dtype), path)
            cache[key] = path
        return cache[key]

    return get

