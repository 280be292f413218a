"""``lmbp-convert`` as a command (``cli.run``): it ends with ``os._exit`` to skip the interpreter's teardown, so
these check that nothing a normal exit does is lost — the exit status, output still in a pipe's buffer, the exit
handlers. Torch-free paths only (help, usage and path errors): each run is a fresh interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the command as the console script runs it, with an exit handler registered first (as a coverage tool does);
#: the handler writes to stderr (line-buffered), so that it cannot flush stdout for the command
_COMMAND = ("import atexit, sys\n"
            "atexit.register(lambda: print('exit handler ran', file=sys.stderr))\n"
            "sys.argv = ['lmbp-convert', *sys.argv[1:]]\n"
            "from lmbp_convert.cli import run\n"
            "run()\n")


def _command(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered, as in a pipe
    return subprocess.run([sys.executable, "-c", _COMMAND, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_help_reaches_a_pipe_in_full_and_exits_0():
    """stdout into a pipe is block-buffered: without the flush before ``os._exit`` the help text would be lost."""
    proc = _command("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: lmbp-convert")
    assert "Exit status: 0 done" in proc.stdout
    assert proc.stderr == "exit handler ran\n"


def test_usage_error_exits_2():
    proc = _command()
    assert proc.returncode == 2
    assert "the following arguments are required" in proc.stderr
    assert proc.stderr.endswith("exit handler ran\n")


def test_bad_input_exits_1_with_one_line(tmp_path):
    proc = _command(str(tmp_path / "nope"), str(tmp_path / "dst"))
    assert proc.returncode == 1
    assert proc.stderr == f"lmbp-convert: error: SRC {tmp_path / 'nope'} does not exist\nexit handler ran\n"
    assert not (tmp_path / "dst").exists()


def test_console_script_and_dash_m_both_run_the_command():
    """The installed ``lmbp-convert`` and ``python -m lmbp_convert`` go through ``run`` (not ``main``, which
    tests call in-process and which must return)."""
    import re

    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^lmbp-convert = "lmbp_convert\.cli:run"$', pyproject, re.M)
    assert "run()" in (ROOT / "lmbp_convert" / "__main__.py").read_text()
