"""One error contract: everything lmbp_convert raises on purpose is an ``LmbpError``, and the classes keep the
builtin bases they had before (``except ValueError`` around a probe failure still works)."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch
from torch import nn

import lmbp_convert
from lmbp_convert import LmbpError, convert
from testsupport.families import FAMILIES

#: exception classes that are control flow, not errors a user sees: (module, name) → why
_NOT_ERRORS = {
    ("lmbp_convert.cli", "_Terminated"): "SIGTERM turned into a BaseException, caught inside main()",
    ("lmbp_convert.cli", "_StdoutClosed"): "a closed stdout turned into a BaseException, caught inside main()",
    ("lmbp_convert.match.norm_walk", "Refused"): "the norm matcher's early exit, caught there: its message becomes a skip reason",
}


def _package_exception_classes() -> dict[str, type]:
    found = {}
    for info in pkgutil.walk_packages(lmbp_convert.__path__, "lmbp_convert."):
        if info.name.endswith(".__main__"):  # runs the CLI when imported
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name
                    and (info.name, name) not in _NOT_ERRORS):
                found[f"{info.name}.{name}"] = obj
    return found


def test_every_exception_class_of_the_package_derives_from_the_base():
    classes = _package_exception_classes()
    assert {"lmbp_convert.errors.ConversionError", "lmbp_convert.errors.TraceError",
            "lmbp_convert.errors.ProbeError", "lmbp_convert.checkpoint.errors.CheckpointError",
            "lmbp_convert.export.ExportError"} <= set(classes), sorted(classes)
    assert [name for name, cls in classes.items() if not issubclass(cls, LmbpError)] == []


def test_old_bases_and_import_locations_are_kept():
    from lmbp_convert.checkpoint.errors import CheckpointError
    from lmbp_convert.errors import ConversionError, NothingToConvertError
    from lmbp_convert.export import ExportError
    from lmbp_convert.trace.probe import ProbeError
    from lmbp_convert.trace.tracer import TraceError

    assert issubclass(ProbeError, ValueError) and issubclass(TraceError, RuntimeError)
    assert issubclass(ConversionError, RuntimeError) and issubclass(CheckpointError, Exception)
    for cls in (ProbeError, TraceError, NothingToConvertError, ExportError):
        assert issubclass(cls, ConversionError), cls
    assert lmbp_convert.ProbeError is ProbeError and lmbp_convert.TraceError is TraceError
    assert lmbp_convert.CheckpointError is CheckpointError and lmbp_convert.ExportError is ExportError


def test_one_except_catches_a_probe_failure():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4), nn.GELU())  # nothing says its input
    with pytest.raises(LmbpError, match="probe=") as err:
        convert(model)
    assert isinstance(err.value, lmbp_convert.ProbeError)


def test_one_except_catches_a_trace_failure():
    with pytest.raises(LmbpError, match="probe=") as err:
        convert(FAMILIES["llama"](), probe={"not_an_argument": torch.zeros(1)})
    assert isinstance(err.value, lmbp_convert.TraceError)


def test_one_except_catches_nothing_to_convert():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    with pytest.raises(LmbpError, match="nothing to convert") as err:
        convert(model, probe=torch.randn(2, 8))
    assert isinstance(err.value, lmbp_convert.NothingToConvertError)


def test_one_except_catches_a_checkpoint_error(tmp_path):
    from lmbp_convert.checkpoint import convert_checkpoint

    with pytest.raises(LmbpError, match="does not exist") as err:
        convert_checkpoint(tmp_path / "missing", tmp_path / "out")
    assert isinstance(err.value, lmbp_convert.CheckpointError)
    assert not (tmp_path / "out").exists()


def test_usage_errors_stay_builtin():
    """A wrong call is the caller's bug: TypeError / ValueError as Python code expects, not an LmbpError."""
    model = FAMILIES["llama"]()
    with pytest.raises(TypeError) as err:
        convert(model, bitz=4)
    assert not isinstance(err.value, LmbpError)
    with pytest.raises(ValueError) as err:
        convert(model, bits=7)
    assert not isinstance(err.value, LmbpError)
    with pytest.raises(TypeError):
        convert("not a model")
