"""pyproject.toml ships what the code needs: every package directory, every data file.

The packages are listed by hand (find cannot see the mapped patterns/ package), so a new subpackage or data
file left out of the list would work in an editable install and break only in an installed wheel.
"""
from __future__ import annotations

from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
NOT_SHIPPED = {"__pycache__"}  # build leftovers, never package content


def _setuptools() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def _package_dirs(cfg: dict) -> dict[str, Path]:
    """Listed package name -> its directory, through package-dir (longest mapped prefix wins)."""
    mapping = cfg.get("package-dir", {})
    out = {}
    for pkg in cfg["packages"]:
        parts = pkg.split(".")
        for n in range(len(parts), -1, -1):
            prefix = ".".join(parts[:n])
            if prefix in mapping or n == 0:
                base = ROOT / mapping.get(prefix, "")
                out[pkg] = base.joinpath(*parts[n:])
                break
    return out


def _source_dirs(cfg: dict, pkg_dirs: dict[str, Path]) -> list[Path]:
    """Every directory holding Python code under the shipped roots (a package whether or not it has __init__)."""
    roots = {d for pkg, d in pkg_dirs.items() if "." not in pkg}
    roots |= {ROOT / d for d in cfg.get("package-dir", {}).values() if d}
    found = set()
    for root in roots:
        for py in root.rglob("*.py"):
            if not NOT_SHIPPED & set(py.relative_to(root).parts):
                found.add(py.parent)
    return sorted(found)


def test_every_package_directory_is_listed():
    cfg = _setuptools()
    pkg_dirs = _package_dirs(cfg)
    for pkg, d in pkg_dirs.items():
        assert (d / "__init__.py").is_file(), f"{pkg} is listed in pyproject but {d} is not a package"
    listed = {d.resolve() for d in pkg_dirs.values()}
    missing = [str(d.relative_to(ROOT)) for d in _source_dirs(cfg, pkg_dirs) if d.resolve() not in listed]
    assert not missing, f"Python code outside the [tool.setuptools] packages list (not in the wheel): {missing}"
    assert (ROOT / "lmbp_convert" / "apply") in pkg_dirs.values()  # the walk does see the subpackages


def test_every_data_file_is_declared_package_data():
    cfg = _setuptools()
    pkg_dirs = _package_dirs(cfg)
    data = cfg.get("package-data", {})
    shipped: set[Path] = set()
    for pkg, globs in data.items():
        assert pkg in pkg_dirs, f"package-data for {pkg}, which is not a listed package"
        for pattern in globs:
            hits = {p.resolve() for p in pkg_dirs[pkg].glob(pattern) if p.is_file()}
            assert hits, f"package-data {pkg}: {pattern!r} matches no file (stale entry?)"
            shipped |= hits
    # What the code loads at run time: the pattern catalogue, the fitted constants, the native kernels' source.
    for needed in ("patterns/catalogue.json", "lmbp_convert/data/approx_constants.json",
                   "lmbp_convert/data/demo_config.json", "lmbp_convert/ops/backends/csrc/cpu_ops.cpp"):
        assert (ROOT / needed).resolve() in shipped, f"{needed} is not declared package data"
    undeclared = []
    for d in set(pkg_dirs.values()):
        for f in d.rglob("*"):
            rel = f.relative_to(d)
            if (f.is_file() and f.suffix not in (".py", ".pyc") and not NOT_SHIPPED & set(rel.parts)
                    and f.resolve() not in shipped):
                undeclared.append(str(f.relative_to(ROOT)))
    assert not undeclared, f"files inside packages that the wheel would leave out: {sorted(set(undeclared))}"


def test_test_fixtures_and_benchmarks_are_not_shipped():
    """testsupport/ (the tests' and benchmarks' shared fixtures) and benchmarks/ live in the checkout only."""
    cfg = _setuptools()
    roots = {pkg.split(".")[0] for pkg in cfg["packages"]}
    assert roots == {"lmbp_convert"}, roots
    mapped = {str(d) for d in cfg.get("package-dir", {}).values()}
    assert not mapped & {"testsupport", "benchmarks", "tests"}, mapped
    assert (ROOT / "testsupport" / "__init__.py").is_file()  # what the tests import instead of benchmarks/
