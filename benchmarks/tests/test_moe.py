"""benchmarks.moe at tiny sizes: its parser, and one run per family showing the conversion's saving."""
from __future__ import annotations

import pytest

from benchmarks import moe as M

SMALL = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


def test_help_names_the_module(capsys):
    with pytest.raises(SystemExit) as exc:
        M.parse_args(["--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m benchmarks.moe")


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(M.SHAPES))
def test_tiny_blocks_fold_into_the_experts_and_keep_fewer_bytes(arch, capsys):
    rows = M.main(["--models", arch, "--seq", "8", "--experts", "8"], small=SMALL)
    assert [r["mode"] for r in rows] == ["bf16", "autocast"]
    for r in rows:
        assert r["verified"] and r["regions"] == ["mlp.experts"]
        assert {"mlp.experts.gate_up_proj", "mlp.gate.weight"} <= set(r["folded"])
        assert r["converted"] < 0.7 * r["original"], r
    assert "| original | converted | less |" in capsys.readouterr().out


def test_benchmarks_all_keeps_the_moe_section_when_it_regenerates_the_file(tmp_path):
    from benchmarks.all import kept_sections

    md = tmp_path / "benchmarks.md"
    section = "<!-- lmbp-kept-section moe -->\n## MoE blocks\n| a |\n<!-- /lmbp-kept-section moe -->"
    md.write_text(f"# Benchmarks\n\nold tables\n\n{section}\n\n## Reproduce\n")
    assert kept_sections(str(md)) == ["", section]
    assert kept_sections(str(tmp_path / "missing.md")) == []
