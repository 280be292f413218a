"""Save a converted, trained model; load it with plain transformers / timm in a process that cannot import
lmbp_convert; same outputs, no missing/unexpected keys, no tie warnings. Then convert the loaded model again
and it computes the same (a checkpoint round trip back into converted training)."""
import contextlib
import copy
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from lmbp_convert import convert
from lmbp_convert.export import plain_state_dict, save_pretrained
from lmbp_convert.match.doors import fold_past_doors
from lmbp_convert.trace.probe import make_probe
from lmbp_convert.trace.tracer import call_model
from testsupport.families import hf, timm_swin, timm_vit

pytestmark = pytest.mark.slow  # trains, saves and reloads every family

# the checkout root: the loader subprocess imports the tiny-model builders (testsupport.families) from it
ROOT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name → (builder, convert kwargs, parameters to freeze during "fine-tuning", plain loader)
HF_CASES = {
    "llama": (lambda: hf("llama"), {}, (), "AutoModelForCausalLM"),
    "gemma": (lambda: hf("gemma"), {}, (), "AutoModelForCausalLM"),
    "gpt2": (lambda: hf("gpt2"), {}, (), "AutoModelForCausalLM"),
    # ln_f folded into an untied copy of the tied head (untie is for folds); head frozen, as when fine-tuning the body
    "gpt2_untied": (lambda: hf("gpt2"), {"untie": True, "fold_norms": True}, ("lm_head.",), "AutoModelForCausalLM"),
    "bert": (lambda: hf("bert", head="cls"), {}, (), "AutoModelForSequenceClassification"),
    "vit": (lambda: hf("vit", head="base"), {}, (), "AutoModel"),
}
TIMM_CASES = {"timm_vit": timm_vit, "timm_swin": timm_swin}


def _out(out):
    for attr in ("logits", "last_hidden_state"):
        if hasattr(out, attr):
            return getattr(out, attr)
    return out


def _train(model, probe, freeze=(), steps=2):
    """A few AdamW steps on every parameter (γ, β of re-applied norms included) but the frozen ones."""
    for n, p in model.named_parameters():
        p.requires_grad_(not any(n.startswith(f) for f in freeze))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    reached = set()
    for _ in range(steps):
        y = _out(call_model(model, probe)).float()
        (y - 1.0).pow(2).mean().backward()
        reached |= {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        opt.step()
        opt.zero_grad()
    model.eval()
    assert len(reached) > len(before) // 2
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in reached)


_LOADER = textwrap.dedent(r"""
    import importlib.abc, json, logging, sys
    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "lmbp_convert" or name.startswith("lmbp_convert."):
                raise ImportError("lmbp_convert is blocked in this process")
    sys.meta_path.insert(0, _Block())
    sys.path.insert(0, ROOT_DIR)
    import torch, transformers
    records = []
    class _H(logging.Handler):
        def emit(self, r):
            records.append(r.getMessage())
    transformers.utils.logging.set_verbosity_warning()
    transformers.utils.logging.get_logger().addHandler(_H())
    jobs = json.load(open(sys.argv[1]))
    results = {}
    for name, job in jobs.items():
        records.clear()
        data = torch.load(job["expected"])
        if job["kind"] == "hf":
            cls = getattr(transformers, job["cls"])
            model, info = cls.from_pretrained(job["path"], output_loading_info=True)
            info = {k: [str(x) for x in v] for k, v in info.items()}
        else:
            from testsupport import families
            model = getattr(families, name)()
            res = model.load_state_dict(torch.load(job["path"]), strict=True)
            info = {"missing_keys": list(res.missing_keys), "unexpected_keys": list(res.unexpected_keys)}
        model.eval()
        probe = data["probe"]
        with torch.no_grad():
            out = model(**probe) if isinstance(probe, dict) else model(probe)
        out = getattr(out, "logits", getattr(out, "last_hidden_state", out))
        want = data["out"]
        rel = float((out.double() - want.double()).norm() / want.double().norm())
        results[name] = {"rel": rel, "info": info, "warnings": list(records),
                         "lmbp_loaded": any(m.startswith("lmbp_convert") for m in sys.modules)}
    print("RESULTS" + json.dumps(results))
""").replace("ROOT_DIR", repr(ROOT_DIR))


@pytest.fixture(scope="module")
def plain_loads(tmp_path_factory):
    """Build, convert, train and export every case; load them all in one lmbp_convert-free subprocess."""
    root = tmp_path_factory.mktemp("plain_ckpts")
    jobs, converted = {}, {}
    for name, (build, kw, freeze, cls) in HF_CASES.items():
        model = build()
        # an untied head is for a fold into it, one a door (the backbone alone) could see: planned past doors, as the
        # checkpoint CLI plans (convert() alone keeps that norm exact: tests/match/test_doors.py)
        with fold_past_doors() if kw.get("untie") else contextlib.nullcontext():
            convert(model, **kw)
        probe, _, _ = make_probe(model, batch=2, seq=9)
        _train(model, probe, freeze)
        path = root / name
        save_pretrained(model, path)
        with torch.no_grad():
            out = _out(call_model(model, probe))
        torch.save({"probe": probe, "out": out}, root / f"{name}.pt")
        jobs[name] = {"kind": "hf", "cls": cls, "path": str(path), "expected": str(root / f"{name}.pt")}
        converted[name] = model
    for name, build in TIMM_CASES.items():
        model = build()
        convert(model)
        probe, _, _ = make_probe(model, batch=2)
        _train(model, probe)
        torch.save(plain_state_dict(model), root / f"{name}.sd.pt")
        with torch.no_grad():
            out = _out(call_model(model, probe))
        torch.save({"probe": probe, "out": out}, root / f"{name}.pt")
        jobs[name] = {"kind": "timm", "path": str(root / f"{name}.sd.pt"), "expected": str(root / f"{name}.pt")}
        converted[name] = model
    (root / "jobs.json").write_text(json.dumps(jobs))
    (root / "loader.py").write_text(_LOADER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(root / "loader.py"), str(root / "jobs.json")], capture_output=True,
                          text=True, timeout=300, env=env, cwd=str(root))
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS"))
    return json.loads(line[len("RESULTS"):]), converted, root


@pytest.mark.parametrize("name", sorted(HF_CASES) + sorted(TIMM_CASES))
def test_plain_library_loads_trained_converted_checkpoint(plain_loads, name):
    results, _, _ = plain_loads
    r = results[name]
    assert not r["lmbp_loaded"]
    assert not any(r["info"].get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), r
    bad = [w for w in r["warnings"] if re.search(r"missing|unexpected key|newly initiali|\btie|not used|mismatch",
                                                  w, re.IGNORECASE)]
    assert not bad, bad
    assert r["rel"] < 1e-5, r


def test_untied_head_checkpoint_says_untied(plain_loads):
    _, _, root = plain_loads
    cfg = json.loads((root / "gpt2_untied" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    assert json.loads((root / "gpt2" / "config.json").read_text()).get("tie_word_embeddings", True) is True


@pytest.mark.parametrize("name", ["bert", "timm_swin"])
def test_reconverting_the_plain_checkpoint_gives_the_same_model(plain_loads, name):
    """Resume fine-tuning from the exported checkpoint: load it plainly, convert() again, same outputs."""
    _, converted, root = plain_loads
    model = converted[name]
    if name in HF_CASES:
        from transformers import AutoModelForSequenceClassification

        fresh = AutoModelForSequenceClassification.from_pretrained(root / name)
    else:
        fresh = TIMM_CASES[name]()
        fresh.load_state_dict(torch.load(root / f"{name}.sd.pt"))
    convert(fresh.eval())
    data = torch.load(root / f"{name}.pt")
    with torch.no_grad():
        got = _out(call_model(fresh, data["probe"]))
    torch.testing.assert_close(got, data["out"], rtol=1e-4, atol=1e-5)
    assert [type(i) for i in fresh.lmbp_report.plan] == [type(i) for i in model.lmbp_report.plan]


@pytest.mark.usefixtures("past_doors")  # the fold machinery: BERT's re-applied folds, which a door could see
@pytest.mark.parametrize("fold", [True, False], ids=["fold", "exact"])
def test_plain_save_pretrained_of_post_ln(tmp_path, fold):
    """Why the export exists: a folded BERT's state dict holds folded Linears next to γ, β, so its plain
    save_pretrained raises (it wrote a model 1.8e-3 off before); the export loads plainly as the original. With exact
    norms (the default) nothing is folded: the plain save is the original model."""
    from transformers import AutoModelForSequenceClassification

    from lmbp_convert.export import ExportError

    model = hf("bert", head="cls")
    ref = copy.deepcopy(model).eval()
    convert(model, fold_norms=fold)
    if fold:
        with pytest.raises(ExportError, match="lmbp_convert.export.save_pretrained"):
            model.save_pretrained(tmp_path)
        save_pretrained(model, tmp_path)
    else:
        model.save_pretrained(tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    probe, _, _ = make_probe(ref, batch=2, seq=9)
    with torch.no_grad():
        a, b = loaded(**probe).logits, ref(**probe).logits
        assert float((a - b).norm() / b.norm()) < 1e-5
        if not fold:  # and the encoder alone (a fold into the pooler cannot be undone: see docs/usage.md)
            a, b = loaded.bert(**probe).last_hidden_state, ref.bert(**probe).last_hidden_state
            assert float((a - b).norm() / b.norm()) < 1e-6
