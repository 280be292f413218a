"""Training fidelity: does fine-tuning a converted model learn what fine-tuning the original learns?

    python -m experiments.fidelity             # full run, 4 seeds (33 min on an idle 2-core CPU);
                                               # writes docs/fidelity.md and docs/fidelity_loss.png
    python -m experiments.fidelity --quick     # a smoke run (tiny step counts), writes to /tmp unless --out
    python -m experiments.fidelity --tasks vit --vit-steps 200 --out /tmp/short  # the ViT run stopped early
    python -m experiments.fidelity --tasks lm --rounding-twin --out /tmp/twin    # + the original, one rounding
                                               # step off, as the reference for rounding-level drift

Two tasks, both generated here, deterministically (no network, no downloads):

* LM: a LLaMA-style causal LM (HF ``LlamaForCausalLM``, 3 layers, hidden 128, character-level) is pre-trained
  on a corpus from a small English grammar plus counting sequences, then fine-tuned on sentences stating facts
  about invented places ("kamito is in lorasia ."; 60 cities in 12 countries). Metrics: loss on held-out text,
  and fact recall: the share of cities whose country the model completes after "<city> is in".
* ViT: a timm ViT (4 blocks, width 128, 32×32 images, 8×8 patches) is pre-trained to tell five shapes apart,
  then fine-tuned with a fresh 10-way head to read the orientation of a bar (0°, 18°, ..., 162°) in clutter
  and noise, from a fixed training set of synthetic images. Metrics: test loss and accuracy.

Pre-training is shared (done once, on the original model). Its norms start from a random affine (γ ~ U(0.5, 1.5),
β ~ N(0, 0.2²)) as a stand-in for the far-from-identity affines of real checkpoints (fresh norms are the identity
and a few hundred steps barely move them), so folding them into the next Linear is a real reparameterisation.
For every seed the pre-trained model is copied; copies are converted as the variants say (``MAIN_VARIANTS``:
exact norms with approx-BP off, exact norms with 2-bit approx-BP, the reparameterising fold; for the ViT also
the fold with approx-BP off). All copies take the same optimizer steps on the same batches in the same order; a
seed fixes the data order (and the ViT's new head). Everything is fp32, without dropout. The report has, per
variant, the largest step-by-step |Δ train loss| against the original, and the final train and held-out metrics
with paired t over the seeds.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from benchmarks.common import ROOT, cpu_name, save_figure
from benchmarks.common import plt as file_plots


# ============================================================================================ LM task data
# A small grammar: sentences like "the old dog sees a red ball near the house ." (character-level model).
_DET = ["the", "a", "every", "one"]
_ADJ = ["red", "old", "small", "big", "quiet", "green", "happy", "cold"]
_NOUN = ["dog", "cat", "bird", "ball", "house", "tree", "child", "river", "stone", "book"]
_VERB = ["sees", "likes", "finds", "takes", "holds", "follows", "paints", "moves"]
_PREP = ["near", "under", "behind", "over", "beside"]
_CHARS = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789 .\n"))
STOI = {c: i for i, c in enumerate(_CHARS)}
VOCAB = len(_CHARS)


def _noun_phrase(rng: random.Random) -> str:
    words = [rng.choice(_DET)] + [rng.choice(_ADJ) for _ in range(rng.choice([0, 0, 1, 2]))] + [rng.choice(_NOUN)]
    if rng.random() < 0.25:
        words += [rng.choice(_PREP), rng.choice(_DET), rng.choice(_NOUN)]
    return " ".join(words)


def pretrain_corpus(n_chars: int, seed: int = 1234) -> str:
    """Grammar sentences mixed with counting sequences ("14 15 16 17 ."), about n_chars characters."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < n_chars:
        if rng.random() < 0.7:
            s = f"{_noun_phrase(rng)} {rng.choice(_VERB)} {_noun_phrase(rng)} .\n"
        else:
            start, step = rng.randrange(0, 90), rng.choice([1, 1, 2, 3, 5, 10])
            s = " ".join(str(start + k * step) for k in range(rng.randrange(3, 7))) + " .\n"
        parts.append(s)
        size += len(s)
    return "".join(parts)


# Fine-tuning corpus: facts about invented places. 60 cities, each in one of 12 countries (pseudo-words, so the
# pre-trained model has never seen them), stated in three sentence templates. Learning it = memorising facts.
_SYL = ["ka", "lo", "mi", "ra", "to", "ne", "su", "vi", "de", "po", "ga", "ri", "zo", "be", "fu", "ha"]


def world(n_cities: int = 60, n_countries: int = 12, seed: int = 99) -> dict[str, str]:
    """city -> country, fixed for all runs."""
    rng = random.Random(seed)

    def word(k: int, suffix: str = "") -> str:
        return "".join(rng.choice(_SYL) for _ in range(k)) + suffix

    countries: list[str] = []
    while len(countries) < n_countries:
        w = word(2, "ia")
        if w not in countries:
            countries.append(w)
    cities: list[str] = []
    while len(cities) < n_cities:
        w = word(rng.choice([2, 3]))
        if w not in cities and w + "ia" not in countries:
            cities.append(w)
    return {c: rng.choice(countries) for c in cities}


def facts_corpus(home: dict[str, str], n_chars: int, seed: int) -> str:
    rng = random.Random(seed)
    cities = list(home)
    parts, size = [], 0
    while size < n_chars:
        c, k = rng.choice(cities), rng.random()
        if k < 0.4:
            s = f"{c} is in {home[c]} .\n"
        elif k < 0.7:
            s = f"{_noun_phrase(rng)} lives in {c} in {home[c]} .\n"
        else:
            s = f"we fly from {c} in {home[c]} to {rng.choice(cities)} .\n"
        parts.append(s)
        size += len(s)
    return "".join(parts)


def encode(text: str) -> torch.Tensor:
    return torch.tensor([STOI[c] for c in text], dtype=torch.long)


# ============================================================================================ ViT task data
def _grid(n: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    lin = torch.linspace(-1, 1, size)
    yy, xx = torch.meshgrid(lin, lin, indexing="ij")
    return xx.expand(n, size, size), yy.expand(n, size, size)


def render(task: str, n: int, gen: torch.Generator, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images (n, 3, size, size) and labels.

    task "shapes": 5 classes (disc, square, triangle, cross, ring) at random position, size, rotation, colour;
    task "orientation": 10 classes, a bar at angle 18°·k (± 4°) with random position, length, width, colour.
    Both on a random background colour with two distractor blobs and Gaussian noise (σ 0.15).
    """
    def u(*shape, lo=0.0, hi=1.0):
        return lo + (hi - lo) * torch.rand(*shape, generator=gen)

    n_cls = 5 if task == "shapes" else 10
    y = torch.randint(0, n_cls, (n,), generator=gen)
    xx, yy = _grid(n, size)
    cx, cy = u(n, 1, 1, lo=-0.35, hi=0.35), u(n, 1, 1, lo=-0.35, hi=0.35)
    if task == "shapes":
        theta = u(n, 1, 1, hi=math.pi)
    else:
        theta = (y.view(n, 1, 1).float() * 18.0 + u(n, 1, 1, lo=-4.0, hi=4.0)) * math.pi / 180.0
    du, dv = xx - cx, yy - cy
    pu = du * torch.cos(theta) + dv * torch.sin(theta)  # along the shape's axis
    pv = -du * torch.sin(theta) + dv * torch.cos(theta)
    if task == "shapes":
        r = u(n, 1, 1, lo=0.3, hi=0.55)
        rad = torch.sqrt(pu ** 2 + pv ** 2)
        masks = torch.stack([
            rad < r,                                                                   # disc
            torch.maximum(pu.abs(), pv.abs()) < 0.8 * r,                               # square
            (pv > -0.5 * r) & (pv - math.sqrt(3) * pu < r) & (pv + math.sqrt(3) * pu < r),  # triangle
            ((pu.abs() < 0.3 * r) & (pv.abs() < r)) | ((pv.abs() < 0.3 * r) & (pu.abs() < r)),  # cross
            (rad < r) & (rad > 0.6 * r),                                               # ring
        ], 1)
    else:
        length, width = u(n, 1, 1, lo=0.45, hi=0.8), u(n, 1, 1, lo=0.06, hi=0.14)
        masks = ((pu.abs() < length) & (pv.abs() < width)).unsqueeze(1).expand(n, n_cls, size, size)
    mask = masks[torch.arange(n), y].float().unsqueeze(1)                              # (n, 1, H, W)
    fg, bg = u(n, 3, 1, 1, lo=0.4, hi=1.0), u(n, 3, 1, 1, hi=0.45)
    img = bg + (fg - bg) * mask
    for _ in range(2):  # distractor blobs (round, so they carry no orientation)
        bx, by, br = u(n, 1, 1, lo=-0.9, hi=0.9), u(n, 1, 1, lo=-0.9, hi=0.9), u(n, 1, 1, lo=0.06, hi=0.16)
        blob = (((xx - bx) ** 2 + (yy - by) ** 2) < br ** 2).float().unsqueeze(1)
        img = img + (u(n, 3, 1, 1, lo=-0.4, hi=0.4)) * blob
    img = img + 0.15 * torch.randn(img.shape, generator=gen)
    return (img - 0.45) / 0.3, y


# ============================================================================================ models
def randomize_norms(model: torch.nn.Module, seed: int = 4321) -> torch.nn.Module:
    """γ ~ U(0.5, 1.5), β ~ N(0, 0.2²) for every norm: a pre-trained-like affine instead of the identity."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if "norm" not in type(mod).__name__.lower():
                continue
            w, b = getattr(mod, "weight", None), getattr(mod, "bias", None)
            if isinstance(w, torch.Tensor) and w.dim() == 1:
                w.copy_(torch.rand(w.shape, generator=gen) + 0.5)
            if isinstance(b, torch.Tensor) and b.dim() == 1:
                b.copy_(0.2 * torch.randn(b.shape, generator=gen))
    return model


def lm_model(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, attention_dropout=0.0)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def vit_model(seed: int, num_classes: int) -> torch.nn.Module:
    import timm

    torch.manual_seed(seed)
    return timm.create_model("vit_base_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=128,
                             depth=4, num_heads=4, num_classes=num_classes)


# ============================================================================================ variants
# Every variant passes fold_norms explicitly (its default is not this experiment's business).
EXACT = "exact, approx-BP off"
MAIN_VARIANTS = {
    EXACT: {"activations": False, "fold_norms": False},  # should train as the original does, up to rounding
    "exact + approx-BP": {"fold_norms": False},           # approx-BP activations on: gap within seed noise?
    "fold": {"fold_norms": True},                         # the reparameterising fold (+ approx-BP), for comparison
}
FOLD_ABLATION = {"fold, approx-BP off": {"activations": False, "fold_norms": True}}
EXACT_TARGET = 1e-5  # issue 21: step-by-step |Δ loss| of the exact variant, fp32
# --rounding-twin: the original itself with every weight moved by about one fp32 rounding step, unconverted. How
# far its loss drifts from the original's shows what training does to rounding-level differences by itself.
ROUNDING_TWIN = "original, weights × (1 ± 2⁻²³)"


def rounding_twin(model: torch.nn.Module, seed: int = 5) -> torch.nn.Module:
    """A copy of ``model`` with each weight scaled by 1 ± 2⁻²³ (random sign): same function up to rounding."""
    twin, gen = copy.deepcopy(model), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1 + (torch.randint(0, 2, p.shape, generator=gen) * 2 - 1).to(p.dtype) * 2.0 ** -23)
    return twin


# ============================================================================================ training
@dataclass
class Phase:
    steps: int
    batch: int
    lr: float
    warmup: int = 20


def lr_at(step: int, ph: Phase) -> float:
    """Linear warm-up, then cosine decay to 10 %."""
    if step < ph.warmup:
        return ph.lr * (step + 1) / ph.warmup
    t = (step - ph.warmup) / max(1, ph.steps - ph.warmup)
    return ph.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def adamw(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


class LMTask:
    name = "LM"
    # LLaMA has no activation module left to convert (the gated MLP takes SiLU, with its exact derivative), so
    # `exact + approx-BP` converts what `exact` does, and `fold` with approx-BP off would repeat `fold`.
    variants = dict(MAIN_VARIANTS)
    labels = {"loss": "held-out loss (per character)", "acc": "fact recall (accuracy)"}
    seq = 64

    def __init__(self, pre: Phase, fine: Phase):
        self.pre, self.fine = pre, fine
        self.corpus = encode(pretrain_corpus(max(200_000, pre.steps * pre.batch * self.seq)))
        self.home = world()
        self.train_text = encode(facts_corpus(self.home, 300_000, seed=1))
        val = encode(facts_corpus(self.home, 32 * self.seq * 8, seed=2))
        self.val_ids = val[: val.numel() // self.seq * self.seq].view(-1, self.seq)
        # fact probes: "\n<city> is in <country> .\n", right-padded (causal: padding never reaches earlier positions)
        rows = [encode(f"\n{c} is in {k} .\n") for c, k in self.home.items()]
        width = max(r.numel() for r in rows)
        self.probes = torch.stack([F.pad(r, (0, width - r.numel()), value=STOI[" "]) for r in rows])
        self.answer = torch.zeros_like(self.probes, dtype=torch.bool)  # positions of "<country> .", as targets
        for i, c in enumerate(self.home):
            first = 1 + len(c) + len(" is in ")
            self.answer[i, first:first + len(self.home[c]) + 2] = True

    def describe(self) -> str:
        lm = self
        return f"""- **LM:** HF `LlamaForCausalLM`, 3 layers, hidden 128, MLP 344, 4 heads (2 KV), character
  vocabulary of {VOCAB}. Pre-trained once ({lm.pre.steps} steps, batch {lm.pre.batch} × 64 characters, AdamW
  lr {lm.pre.lr:g}) on a generated corpus: sentences of a small English grammar and counting sequences.
  Fine-tuned ({lm.fine.steps} steps, batch {lm.fine.batch} × 64 characters, AdamW lr {lm.fine.lr:g}) on
  generated sentences stating facts about invented places (`kamito is in lorasia .`, `the old dog lives in
  kamito in lorasia .`, `we fly from ...`; {len(lm.home)} cities, each in one of 12 countries, all
  pseudo-words). Evaluated on held-out text from the same generator (loss per character) and by fact recall,
  the "accuracy" row: the share of the {len(lm.home)} cities for which the model completes `<city> is in` with
  the right country and ` .` (teacher-forced argmax at every answer position, i.e. greedy decoding)."""

    def windows(self, text: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, text.numel() - self.seq, (n,), generator=gen)
        return torch.stack([text[s:s + self.seq] for s in starts.tolist()])

    def pretrained(self) -> torch.nn.Module:
        model = randomize_norms(lm_model(seed=1234)).train()
        opt, gen = adamw(model, self.pre.lr), torch.Generator().manual_seed(1234)
        for step in range(self.pre.steps):
            ids = self.windows(self.corpus, self.pre.batch, gen)
            set_lr(opt, lr_at(step, self.pre))
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return model

    def start(self, pretrained: torch.nn.Module, seed: int) -> torch.nn.Module:
        return copy.deepcopy(pretrained)

    def batches(self, seed: int):
        """Random 64-character windows of the training text, drawn by ``seed``."""
        gen = torch.Generator().manual_seed(seed)
        for _ in range(self.fine.steps):
            ids = self.windows(self.train_text, self.fine.batch, gen)
            yield ids, ids

    def loss(self, model, batch) -> torch.Tensor:
        ids, labels = batch
        return model(input_ids=ids, labels=labels).loss

    @torch.no_grad()
    def evaluate(self, model) -> dict[str, float]:
        model.eval()
        loss = model(input_ids=self.val_ids, labels=self.val_ids).loss.item()
        pred = model(input_ids=self.probes).logits.argmax(-1)
        # the country and " ." predicted at every answer position from the prompt "<city> is in" (teacher-forced
        # argmax, which is exactly greedy decoding when every position is right)
        ok = (pred[:, :-1] == self.probes[:, 1:]) | ~self.answer[:, 1:]
        model.train()
        return {"loss": loss, "acc": ok.all(-1).float().mean().item()}


class ViTTask:
    name = "ViT"
    # The ablation separates the fold from approx-BP GELU (`exact + approx-BP` already is approx-BP alone).
    variants = {**MAIN_VARIANTS, **FOLD_ABLATION}
    labels = {"loss": "test loss", "acc": "test accuracy"}

    def __init__(self, pre: Phase, fine: Phase, n_train: int = 4000, n_test: int = 2000):
        self.pre, self.fine = pre, fine
        self.train_x, self.train_y = render("orientation", n_train, torch.Generator().manual_seed(7))
        self.test_x, self.test_y = render("orientation", n_test, torch.Generator().manual_seed(8))

    def describe(self) -> str:
        vit = self
        return f"""- **ViT:** timm `VisionTransformer`, 4 blocks, width 128, 4 heads, 32×32 images, 8×8
  patches. Pre-trained once ({vit.pre.steps} steps, batch {vit.pre.batch}, AdamW lr {vit.pre.lr:g}) to
  classify five generated shapes; then a fresh 10-way head (initialised by the seed) is fine-tuned
  ({vit.fine.steps} steps, batch {vit.fine.batch}, AdamW lr {vit.fine.lr:g}, whole network trainable) to read
  the orientation of a bar (0°, 18°, …, 162°, ± 4°) among distractor blobs and noise:
  {vit.train_y.numel()} fixed training images, {vit.test_y.numel()} test images."""

    def pretrained(self) -> torch.nn.Module:
        model = randomize_norms(vit_model(seed=1234, num_classes=5)).train()
        opt, gen = adamw(model, self.pre.lr), torch.Generator().manual_seed(1234)
        for step in range(self.pre.steps):
            x, y = render("shapes", self.pre.batch, gen)
            set_lr(opt, lr_at(step, self.pre))
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return model

    def start(self, pretrained: torch.nn.Module, seed: int) -> torch.nn.Module:
        model = copy.deepcopy(pretrained)
        torch.manual_seed(seed)
        model.reset_classifier(10)  # a fresh head, as when fine-tuning on a new label set
        return model

    def batches(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        order: list[int] = []
        for _ in range(self.fine.steps):
            if len(order) < self.fine.batch:
                order += torch.randperm(self.train_y.numel(), generator=gen).tolist()
            take, order = order[:self.fine.batch], order[self.fine.batch:]
            yield self.train_x[take], self.train_y[take]

    def loss(self, model, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model) -> dict[str, float]:
        model.eval()
        logits = torch.cat([model(x) for x in self.test_x.split(500)])
        model.train()
        return {"loss": F.cross_entropy(logits, self.test_y).item(),
                "acc": (logits.argmax(-1) == self.test_y).float().mean().item()}


@dataclass
class Run:
    curves: dict[str, list[float]] = field(default_factory=dict)     # variant -> per-step training loss
    final: dict[str, dict[str, float]] = field(default_factory=dict)  # variant -> eval metrics
    first_step_diff: float = 0.0
    max_step_diff: dict[str, float] = field(default_factory=dict)  # variant -> max over steps of |Δ train loss|
    reports: dict[str, str] = field(default_factory=dict)          # variant -> its conversion report's counts line


def fine_tune(task, pretrained: torch.nn.Module, seed: int) -> Run:
    """Original and converted copies, trained in lock step on the same batches."""
    from lmbp_convert import convert

    original = task.start(pretrained, seed)
    models = {"original": original.train()}
    for variant, options in task.variants.items():  # before the optimizer is built (folded γ, β become buffers)
        models[variant] = (rounding_twin(original) if variant == ROUNDING_TWIN
                           else convert(copy.deepcopy(original), **options)).train()
    opts = {k: adamw(m, task.fine.lr) for k, m in models.items()}
    run = Run(curves={k: [] for k in models}, reports={k: m.lmbp_report.counts()
                                                       for k, m in models.items() if hasattr(m, "lmbp_report")})
    for step, batch in enumerate(task.batches(seed)):
        for k, model in models.items():
            set_lr(opts[k], lr_at(step, task.fine))
            loss = task.loss(model, batch)
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            opts[k].step()
            run.curves[k].append(loss.item())
        if step == 0:
            run.first_step_diff = max(abs(c[0] - run.curves["original"][0]) for c in run.curves.values())
    ref = run.curves["original"]
    run.max_step_diff = {k: max(abs(a - b) for a, b in zip(c, ref)) for k, c in run.curves.items() if k != "original"}
    run.final = {k: task.evaluate(m) for k, m in models.items()}
    return run


def norm_affine_spread(model: torch.nn.Module) -> float:
    """Mean |γ − 1| over the norms of a model: how far from the identity the folded affines are."""
    vals = [m.weight.detach().sub(1).abs().mean().item() for m in model.modules()
            if "norm" in type(m).__name__.lower() and isinstance(getattr(m, "weight", None), torch.Tensor)]
    return sum(vals) / max(1, len(vals))


# ============================================================================================ report
def mean_std(xs: list[float]) -> tuple[float, float]:
    t = torch.tensor(xs, dtype=torch.float64)
    return t.mean().item(), (t.std().item() if len(xs) > 1 else 0.0)


def smooth(xs: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(xs):
        acc = v if i == 0 else (1 - 1 / k) * acc + v / k
        out.append(acc)
    return out


def table(results: dict[str, list[Run]], labels: dict[str, dict[str, str]], tail: int) -> tuple[str, list[str]]:
    """Markdown table, one row per task, variant and metric, each against the original.

    A difference is 'within seed noise' when |Δ mean| ≤ 2 standard errors of that difference (Welch:
    sqrt(s_o²/n + s_v²/n)). The paired t (mean / standard error of the per-seed differences) shows whether a
    difference, however small against the seed noise, is systematic.
    """
    rows = ["| task | variant | metric | original | variant | Δ variant − original (paired) | paired t | n | "
            "within seed noise? |",
            "|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for name, runs in results.items():
        n = len(runs)
        for variant in [k for k in runs[0].curves if k != "original"]:
            metrics = {f"final train loss (mean of last {tail} steps)":
                       {k: [sum(r.curves[k][-tail:]) / tail for r in runs] for k in ("original", variant)}}
            for key in ("loss", "acc"):
                metrics[labels[name][key]] = {k: [r.final[k][key] for r in runs] for k in ("original", variant)}
            for label, vals in metrics.items():
                fmt = (lambda v: f"{100 * v:.1f} %") if "accuracy" in label else (lambda v: f"{v:.4f}")
                (mo, so), (mv, sv) = mean_std(vals["original"]), mean_std(vals[variant])
                md, sd = mean_std([v - o for o, v in zip(vals["original"], vals[variant])])
                se = math.sqrt((so ** 2 + sv ** 2) / n)
                ok = abs(mv - mo) <= 2 * se
                t = md / (sd / math.sqrt(n)) if sd > 0 else (0.0 if md == 0 else math.copysign(math.inf, md))
                t_txt = f"{t:+.1f}".replace("-", "−")
                sign = "+" if md >= 0 else "−"
                verdicts.append(f"{name} {variant} {label}: {'within' if ok else 'OUTSIDE'} noise "
                                f"(|Δ| {abs(mv - mo):.4g}, 2·SE {2 * se:.4g}, paired t {t_txt})")
                vname = f"**{variant}**" if variant in MAIN_VARIANTS else variant
                rows.append(f"| {name} | {vname} | {label} | {fmt(mo)} ± {fmt(so)} | {fmt(mv)} ± {fmt(sv)} | "
                            f"{sign}{fmt(abs(md))} ± {fmt(sd)} | {t_txt} | {n} | "
                            f"{'yes' if ok else '**no**'} (2·SE = {fmt(2 * se)}) |")
    return "\n".join(rows), verdicts


def step_diff_table(results: dict[str, list[Run]]) -> tuple[str, list[str]]:
    """Largest step-by-step |Δ train loss| (variant − original, same batch, same step) per task and variant.

    The exact variant with approx-BP off is held to ``EXACT_TARGET``; the others are listed for scale.
    """
    rows = ["| task | variant | steps × seeds | largest \\|Δ train loss\\| at any step | seed of the largest | "
            "target |",
            "|---|---|---|---|---|---|"]
    verdicts = []
    for name, runs in results.items():
        for variant in runs[0].max_step_diff:
            per_seed = [r.max_step_diff[variant] for r in runs]
            worst = max(per_seed)
            target = ""
            if variant == EXACT:
                ok = worst <= EXACT_TARGET
                target = f"≤ {EXACT_TARGET:.0e}: {'met' if ok else '**not met**'}"
                verdicts.append(f"{name} {variant}: max step |Δ loss| {worst:.2e} "
                                f"({'meets' if ok else 'MISSES'} the {EXACT_TARGET:.0e} target)")
            elif variant == ROUNDING_TWIN:
                target = "rounding reference (unconverted)"
            vname = f"**{variant}**" if variant == EXACT else variant
            rows.append(f"| {name} | {vname} | {len(runs[0].curves[variant])} × {len(runs)} | {worst:.2e} | "
                        f"{per_seed.index(worst)} | {target} |")
    return "\n".join(rows), verdicts


def plot(results: dict[str, list[Run]], path: str, smooth_k: int) -> None:
    fig, axes = file_plots().subplots(2, len(results), figsize=(6 * len(results), 7), sharex="col",
                             gridspec_kw={"height_ratios": [2, 1]}, squeeze=False)
    colors = {"original": "tab:blue", EXACT: "tab:green", "exact + approx-BP": "tab:orange", "fold": "tab:red",
              "fold, approx-BP off": "tab:purple", ROUNDING_TWIN: "tab:grey"}
    for col, (name, runs) in enumerate(results.items()):
        top, bottom = axes[0, col], axes[1, col]
        for k in runs[0].curves:
            curves = torch.tensor([smooth(r.curves[k], smooth_k) for r in runs])
            mean, std = curves.mean(0), curves.std(0) if len(runs) > 1 else torch.zeros(curves.shape[1])
            steps = torch.arange(curves.shape[1])
            main = k == "original" or k in MAIN_VARIANTS
            top.plot(steps, mean, color=colors.get(k), lw=1.5 if main else 1, ls="-" if main else "--",
                     label=f"{k} (mean of {len(runs)} seeds)" + ("" if main else ", ablation"))
            if main:
                top.fill_between(steps, mean - std, mean + std, color=colors.get(k), alpha=0.25)
        top.set_yscale("log")
        top.legend(loc="lower left", fontsize=8)
        top.set_ylabel(f"training loss (EMA, {smooth_k} steps)")
        top.set_title(f"{name} fine-tuning")
        for k in [v for v in runs[0].curves if v != "original"]:
            for i, r in enumerate(runs):
                d = torch.tensor(smooth(r.curves[k], smooth_k)) - torch.tensor(smooth(r.curves["original"], smooth_k))
                bottom.plot(d, lw=1, color=colors.get(k), alpha=0.4 + 0.4 * i / max(1, len(runs) - 1),
                            ls="-" if k in MAIN_VARIANTS else "--",
                            label=f"{k} − original, per seed" if i == 0 else None)
        orig = torch.tensor([smooth(r.curves["original"], smooth_k) for r in runs])
        if len(runs) > 1:
            spread = orig.std(0)
            bottom.fill_between(torch.arange(orig.shape[1]), -spread, spread, color="grey", alpha=0.25,
                                label="± seed std of original")
        bottom.axhline(0, color="k", lw=0.5)
        bottom.set_xlabel("fine-tuning step")
        bottom.set_ylabel("loss difference")
        bottom.legend(fontsize=7)
    save_figure(fig, path)


def machine() -> str:
    cpu = cpu_name()
    load = ""
    if hasattr(os, "getloadavg"):
        load = ", load average at start " + "/".join(f"{v:.1f}" for v in os.getloadavg())
    import timm
    import transformers
    return (f"{cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}{load}; python "
            f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"timm {timm.__version__}")


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 by default: on a small shared machine more threads mostly contend)")
    ap.add_argument("--quick", action="store_true", help="a smoke run with a few steps")
    ap.add_argument("--tasks", default="lm,vit", help="comma-separated subset of lm,vit")
    ap.add_argument("--lm-steps", type=int, default=None, help="LM fine-tuning steps (default 300)")
    ap.add_argument("--vit-steps", type=int, default=None, help="ViT fine-tuning steps (default 600)")
    ap.add_argument("--no-ablations", action="store_true", help="original and the three main variants only")
    ap.add_argument("--rounding-twin", action="store_true",
                    help=f"also train `{ROUNDING_TWIN}`: the original, weights moved by one rounding step")
    ap.add_argument("--out", default=None, help="folder for fidelity.md and fidelity_loss.png "
                                                "(default docs/, or a temp folder with --quick)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = args.out or (os.path.join(ROOT, "docs") if not args.quick else "/tmp/lmbp_fidelity")
    os.makedirs(out, exist_ok=True)
    q = args.quick
    chosen = set(args.tasks.split(","))
    tasks = []
    if "lm" in chosen:
        tasks.append(LMTask(pre=Phase(20 if q else 300, 32, 3e-3),
                            fine=Phase(args.lm_steps or (10 if q else 300), 16, 2e-3)))
    if "vit" in chosen:
        tasks.append(ViTTask(pre=Phase(10 if q else 250, 64, 1e-3),
                             fine=Phase(args.vit_steps or (10 if q else 600), 48, 5e-4),
                             n_train=256 if q else 4000, n_test=200 if q else 2000))
    if not tasks:
        ap.error("--tasks: choose from lm, vit")
    for task in tasks:
        if args.no_ablations:
            task.variants = dict(MAIN_VARIANTS)
        if args.rounding_twin:
            task.variants = {**task.variants, ROUNDING_TWIN: {}}
    header = machine()
    print(header, flush=True)
    t_all = time.perf_counter()
    results, notes, timing = {}, [], []
    for task in tasks:
        t0 = time.perf_counter()
        pre = task.pretrained()
        t_pre = time.perf_counter() - t0
        spread = norm_affine_spread(pre)
        print(f"[{task.name}] pre-trained in {t_pre:.0f} s; norms' mean |γ − 1| = {spread:.3f}", flush=True)
        runs = []
        for seed in range(args.seeds):
            t1 = time.perf_counter()
            r = fine_tune(task, pre, seed)
            runs.append(r)
            print(f"[{task.name}] seed {seed}: " + ", ".join(
                f"{k} loss {v['loss']:.4f} acc {100 * v['acc']:.1f} %" for k, v in r.final.items())
                + f"; step-0 loss |Δ| {r.first_step_diff:.1e}; max step |Δ| "
                + ", ".join(f"{k} {v:.1e}" for k, v in r.max_step_diff.items())
                + f" ({time.perf_counter() - t1:.0f} s)", flush=True)
        results[task.name] = runs
        notes.append((task, spread, max(r.first_step_diff for r in runs), runs[0].reports))
        timing.append(f"{task.name}: pre-training {t_pre:.0f} s, fine-tuning {time.perf_counter() - t0 - t_pre:.0f} s")
    total = time.perf_counter() - t_all
    tail = max(1, min(50, min(t.fine.steps for t in tasks) // 5))
    md_table, verdicts = table(results, {t.name: t.labels for t in tasks}, tail)
    diff_table, diff_verdicts = step_diff_table(results)
    md_table, verdicts = diff_table + "\n\n" + md_table, diff_verdicts + verdicts
    png = os.path.join(out, "fidelity_loss.png")
    plot(results, png, smooth_k=max(1, min(20, min(t.fine.steps for t in tasks) // 10)))
    print(md_table)
    print("\n".join(verdicts))
    print(f"total {total:.0f} s ({'; '.join(timing)})")
    write_doc(os.path.join(out, "fidelity.md"), header, tasks, notes, md_table, verdicts, total, timing, args)


def write_doc(path, header, tasks, task_notes, md_table, verdicts, total, timing, args) -> None:
    notes = kept_notes(path)
    ablation_txt = "" if args.no_ablations or "ViT" not in [t.name for t in tasks] else (
        "\n  The ViT also runs `fold, approx-BP off` (`convert(model, activations=False, fold_norms=True)`), the\n"
        "  fold alone, in the same lock step.")
    twin_txt = "" if not args.rounding_twin else (
        f"\n  `{ROUNDING_TWIN}`: the unconverted original with every weight scaled by 1 ± 2⁻²³ (random sign), a\n"
        "  rounding-level twin: how far its loss drifts shows how training amplifies rounding by itself.")
    task_lines = []
    for task, spread, d0, reports in task_notes:
        summary = "; ".join(f"{k}: `{r.removeprefix('converted: ')}`" for k, r in reports.items())
        task_lines.append(f"- {task.name}: {summary}. Pre-trained norms' mean |γ − 1| = {spread:.3f} (so folding "
                          f"them is a real reparameterisation); largest step-0 loss difference original vs any "
                          f"variant {d0:.1e} (same function before training).")
    text = f"""# Training fidelity: original vs converted

Generated by `python -m experiments.fidelity{''.join(' ' + a for a in sys.argv[1:])}` (seeds: {args.seeds}); this
file and `fidelity_loss.png` are rewritten by each run (the notes under Findings are kept).

**Question.** Does fine-tuning a model after `lmbp_convert.convert(model)` learn what fine-tuning the
unconverted model learns? With exact norms (`fold_norms=False`: γ, β, W, b stay the original parameters) and
approx-BP off, it should train as the original does, step by step, up to fp32 rounding (issue 21: |Δ loss| ≤
{EXACT_TARGET:.0e} at every step); with 2-bit approx-BP on, the gap should be within seed noise (|paired t| < 2);
the reparameterising fold (`fold_norms=True`) is measured alongside.

## Setup

- **Machine:** {header}.
- **Total run time:** {total:.0f} s ({'; '.join(timing)}).
{chr(10).join(t.describe() for t in tasks)}
- **All tasks:** pre-training starts from norms with a random affine (γ ~ U(0.5, 1.5), β ~ N(0, 0.2²)), standing in
  for the far-from-identity affines of real checkpoints (fresh norms are the identity, and folding an identity
  would test nothing). fp32, no dropout, AdamW (β 0.9/0.999, no weight decay), linear warm-up 20 steps then
  cosine decay to 10 %. For each seed the original and every converted copy start from the same weights and
  take the same batches in the same order, one step each in turn (the seed sets the data order and the ViT
  head; training draws no random numbers). Convert happens before the optimizer is built.
- **Variants** (each passes `fold_norms` explicitly):
  `{EXACT}` = `convert(model, activations=False, fold_norms=False)`;
  `exact + approx-BP` = `convert(model, fold_norms=False)` (2-bit approx-BP GELU/SiLU modules);
  `fold` = `convert(model, fold_norms=True)` (affine folded into the next Linears, + approx-BP).{ablation_txt}
  All of them also use the memory-sharing gated MLP where there is one (LM).{twin_txt}
{chr(10).join(task_lines)}

## Results

Step by step (training loss of each step's batch, before that step's update):

{md_table}

Final metrics above: mean ± std over the seeds. "Within seed noise": |mean(variant) − mean(original)| ≤ 2
standard errors of that difference, 2·sqrt((s_orig² + s_var²)/n). The paired column is variant − original per seed
(same data order), mean ± std; paired t = its mean / (std/√n), n − 1 degrees of freedom: |t| < 2 is within seed
noise, |t| well above ~3 (n = 4) means a systematic shift, even when it is small next to the seed-to-seed
spread. A paired Δ of exactly 0 (identical runs) is reported as t +0.0.

![loss curves](fidelity_loss.png)

Top: training loss (EMA), mean ± std over seeds for the original and the main variants (ablation dashed, mean
only). Bottom: variant − original per seed (EMA), against the seed-to-seed spread of the original (grey).

## Findings

{notes}

## What can make them differ

- Approx-BP: GELU/SiLU keep their exact forward, but the backward uses a 4-level step derivative, so every
  gradient flowing through an MLP activation is slightly biased.
- Folding the norm affine into the next Linear (W' = W·diag(γ), b' = b + W·β, `fold_norms=True`) keeps the
  function but changes the parameterisation: the original trains γ, β and W separately, the folded model trains
  W' only (γ, β become fixed buffers). Gradient steps (and Adam's per-parameter scaling) are therefore not the
  same steps.
- Exact norms (`fold_norms=False`) keep γ, β, W, b. In full precision they keep the norm's input and replay the
  replaced module's own ops in backward (`lmbp_convert/ops/replay_norm.py`): bitwise the original's gradients.
  Under bf16 weights or autocast they compute the same function and gradients from x̂ and rstd by a different
  sequence of float operations, so they differ by rounding, which training can amplify over many steps.
- The gated-MLP rewrite (LM) recomputes act(g)·u in backward with the exact SiLU derivative: again rounding only.
"""
    with open(path, "w") as f:
        f.write(text)


NOTES_BEGIN, NOTES_END = "<!-- notes: kept by experiments/fidelity.py across runs -->", "<!-- /notes -->"


def kept_notes(path: str) -> str:
    """The hand-written notes block of an existing report (interpretation of a recorded run), to carry over."""
    try:
        with open(path) as f:
            old = f.read()
    except OSError:
        return f"{NOTES_BEGIN}\n{NOTES_END}"
    if NOTES_BEGIN in old and NOTES_END in old:
        return old[old.index(NOTES_BEGIN):old.index(NOTES_END) + len(NOTES_END)]
    return f"{NOTES_BEGIN}\n{NOTES_END}"


if __name__ == "__main__":
    main()
