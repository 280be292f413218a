"""Every recipe in README.md and docs/recipes.md runs (issue 22, item 6): a recipe that no longer works fails here.

Each section (the text under one heading) runs its fenced blocks in order in a fresh folder holding a tiny LLaMA
checkpoint at ``./llama``: ``python`` blocks are executed, ``bash`` blocks' ``lmbp-convert`` lines go to the CLI's
``main``. A line marked ``# test: EXPR`` runs as written, then ``<its names> = EXPR`` (a local model for a hub
name). A block that uses ``model`` without building it (the README's one-liner) gets the tiny LLaMA. A section importing
an optional package that cannot be imported here (trl, datasets: not installed, or built for another transformers)
is skipped, saying which.
"""
from __future__ import annotations

import ast
import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import torch

from testsupport.text import word_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/recipes.md")
OPTIONAL = {"trl", "datasets"}  # recipes for them are shown; their sections skip where they are missing
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_MARK = re.compile(r"^(\s*)([\w, ]+?)\s*=.*#\s*test:\s*(.+)$")


def _sections(doc: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """(heading, [(language, code), ...]) for each heading of ``doc`` that has python or bash blocks."""
    out, heading, blocks = [], "top", []
    text = (ROOT / doc).read_text()
    pos = 0
    for m in re.finditer(r"^#+ ([^\n]+)$|" + _FENCE.pattern, text, re.S | re.M):
        if m.start() < pos:
            continue
        pos = m.end()
        if m.group(1) is not None:
            if blocks:
                out.append((heading, blocks))
            heading, blocks = m.group(1).strip(), []
        elif m.group(2) in ("python", "bash"):
            blocks.append((m.group(2), m.group(3)))
    if blocks:
        out.append((heading, blocks))
    return out


def _cases() -> list:
    return [pytest.param(doc, head, blocks, id=f"{doc}::{head}") for doc in DOCS for head, blocks in _sections(doc)]


def _with_overrides(code: str) -> str:
    lines = []
    for line in code.splitlines():
        lines.append(line)
        m = _MARK.match(line)
        if m:
            lines.append(f"{m.group(1)}{m.group(2)} = {m.group(3).strip()}")
    return "\n".join(lines) + "\n"


def _missing_optional(code: str) -> list[str]:
    """The imports of optional packages in ``code`` that fail here (not installed, or built for another
    transformers), each as written."""
    failed = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names = {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = {node.module.split(".")[0]}
        else:
            continue
        if names & OPTIONAL:
            try:
                exec(ast.unparse(node), {})
            except Exception as exc:  # noqa: BLE001 - any failure to import means the recipe cannot run here
                failed.append(f"{ast.unparse(node)} ({type(exc).__name__}: {exc})")
    return failed


def _run_bash(code: str) -> None:
    from lmbp_convert.cli import main
    for line in code.splitlines():
        argv = shlex.split(line, comments=True)
        if argv and argv[0] == "lmbp-convert":
            assert main(argv[1:]) == 0, line


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "llama"
    _tiny_llama().save_pretrained(path)
    word_tokenizer().save_pretrained(path)  # for the recipes that load one
    return path


def _builds_model(code: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "model" and isinstance(n.ctx, ast.Store)
               for n in ast.walk(ast.parse(code)))


def _same_as_saved(ns: dict, llama_dir: Path) -> None:
    """The meta-device recipe must give the model it loaded: the saved one's logits, rotary buffers included."""
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = ns["model"].eval()(ids).logits, ref(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _really_4bit(ns: dict, llama_dir: Path) -> None:
    """The QLoRA recipe runs on real bitsandbytes 4-bit weights wherever they run (its CPU backend included), and
    convert() swaps the folded norms and fuses the gated MLPs over them."""
    from testsupport.bnb import cpu_4bit_problem

    model, rep = ns["model"], ns["model"].lmbp_report
    quantized = any(type(m).__name__ == "Linear4bit" for m in model.modules())
    assert quantized == ns["BNB"], (quantized, ns["BNB"], cpu_4bit_problem())
    kinds = {type(it).__name__ for it in rep.plan.items}
    assert rep.verified and {"NormFold", "GatedMLPSwap"} <= kinds and not rep.plan.skips, str(rep)
    assert "activation checkpointing is on" in str(rep)  # prepare_model_for_kbit_training turned it on


#: what a section must also leave behind, beyond running without an error
CHECKS = {"Meta device: convert before the weights are read": _same_as_saved,
          "QLoRA: fold on disk, load in 4 bits, then convert": _really_4bit}


def test_the_docs_have_the_recipes_the_issue_asks_for():
    heads = {h for doc in DOCS for h, _ in _sections(doc)}
    for want in ("HF Trainer + PEFT LoRA", "QLoRA", "TRL SFTTrainer", "timm", "Meta device"):
        assert any(want in h for h in heads), (want, sorted(heads))
    assert set(CHECKS) <= heads


def test_readme_stays_short_with_its_one_figure_block():
    """Issue 22: under 150 lines; the whole-step table sits between markers a benchmark rerun replaces."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 150
    head, sep, rest = text.partition("<!-- whole-step table -->\n")
    table, end, _ = rest.partition("<!-- /whole-step table -->")
    assert sep and end and "| config | original MiB (activations) |" in table


@pytest.mark.parametrize("doc, heading, blocks", _cases())
def test_recipe_runs(doc, heading, blocks, llama_dir, tmp_path, monkeypatch):
    code = "\n".join(c for lang, c in blocks if lang == "python")
    missing = _missing_optional(code) if code else []
    if missing:
        pytest.skip(f"{'; '.join(missing)}: the recipe is shown, not run")
    (tmp_path / "llama").symlink_to(llama_dir, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    from testsupport.bnb import cpu_4bit_problem

    # bitsandbytes 4-bit where it runs: CUDA, or its CPU backend (in the index's wheels since 0.48)
    bnb = importlib.util.find_spec("bitsandbytes") is not None and (torch.cuda.is_available()
                                                                     or cpu_4bit_problem() is None)
    ns: dict = {}
    for lang, block in blocks:
        if lang == "bash":
            _run_bash(block)
        else:
            ns = {"__name__": "__recipe__", "BNB": bnb}
            if not _builds_model(block):  # the one-liner: `convert(model)` on a model of yours
                ns["model"] = _tiny_llama()
            exec(compile(_with_overrides(block), f"{doc}::{heading}", "exec"), ns)
    if heading in CHECKS:
        CHECKS[heading](ns, llama_dir)


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(md: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ ([^\n]+)$", re.sub(r"^```.*?^```", "", md.read_text(), flags=re.S | re.M), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("doc", [*DOCS, "docs/usage.md"])
def test_links_resolve(doc):
    src = ROOT / doc
    for target in _LINK.findall(src.read_text()):
        if re.match(r"\w+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (src.parent / path).resolve() if path else src
        assert dest.exists(), f"{doc}: {target}"
        if anchor:
            assert anchor in _anchors(dest), f"{doc}: {target}"


def test_readme_says_how_to_install_on_a_cpu_and_shows_the_whole_step_chart():
    """Issue 36 item 7: PyTorch's CPU wheels first on a machine without a GPU (documentation only: nothing is
    installed here), and the chart of the whole-step peak that benchmarks.step_peak draws."""
    text = (ROOT / "README.md").read_text()
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in text
    end = text.index("<!-- /whole-step table -->")
    assert "](docs/bench_step_peak.png)" in text[end:end + 200]
    assert (ROOT / "docs/bench_step_peak.png").read_bytes()[:4] == b"\x89PNG"
    usage = (ROOT / "docs/usage.md").read_text()
    assert "~900" not in usage  # the inner loop's size is not stated (it was 2421 tests when it said ~900)
