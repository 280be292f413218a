"""The run-ending helpers every benchmark shares: JSON only where asked, the elapsed stamp, the closing lines."""
from __future__ import annotations

import time

from benchmarks import common as C


def test_finish_stamps_elapsed_and_saves_only_with_a_path(tmp_path):
    data = {"kind": "x"}
    assert C.finish(data, time.perf_counter() - 2.0, None) is data and data["elapsed_s"] >= 2.0
    assert not list(tmp_path.iterdir())
    path = tmp_path / "sub" / "r.json"
    C.finish(data, time.perf_counter(), str(path))
    assert C.read_json(str(path))["kind"] == "x"


def test_print_end_lists_rendered_files_only_with_plot(capsys, tmp_path):
    calls = []

    def render(data, out):
        calls.append(out)
        return [f"{out}/a.png"]

    assert C.print_end({"elapsed_s": 1.5}, render, None) == 0
    assert calls == [] and capsys.readouterr().out == "\n1.5 s\n"
    assert C.print_end({"elapsed_s": 1.5}, render, str(tmp_path)) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path}/a.png\n\n1.5 s\n"
