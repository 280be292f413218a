"""What the benchmarks share: model families, machine description, timing loop, byte ledger, table writers.

Models are built from configs with random weights and no network: on the ``meta`` device first, then
``to_empty`` and a cheap random init (norm gains drawn from U(0.5, 1.5) so the affine the converter folds is
not the identity), with the buffers that ``to_empty`` leaves uninitialised rebuilt. Three families, at the
shapes the issue names and at tiny shapes for the smoke test:

    llama  LLaMA-7B decoder block   hidden 4096, intermediate 11008, 32 heads, seq 512   (transformers)
    vit    ViT-B/16 block at 224 px hidden 768, MLP 3072, 12 heads, 197 tokens           (timm)
    bert   BERT-base encoder block  hidden 768, intermediate 3072, 12 heads, seq 512     (transformers)

Per-block bytes are a difference: the saved-for-backward bytes of the model with L layers minus those of the
same model with its layer list cut to L - 1 (same modules, so a compiled layer is reused, not recompiled).
Embedding, final norm and head cancel; what is left is exactly what one block keeps for backward.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, ContextManager, Iterable, Optional, Sequence

import torch
from torch import nn

from testsupport.blocks import block_list, ledger_bytes, truncated  # noqa: F401 (C.block_list and friends)

#: The checkout's root: default output folders (docs/, build/) and the working directory of subprocesses.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MiB = 2 ** 20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
#: The paper's analytic activation-memory reductions (arXiv 2406.16282): ReGELU2 + MS-LN on ViT,
#: ReSiLU2 + MS-RMSNorm on LLaMA (its LLaMA figure predates this project's memory-sharing gated MLP).
PAPER_REDUCTION = {"vit": 39.47, "llama": 29.19}
#: Paper, ViT-B/16 LoRA r4, batch 64, one GPU: peak memory (MiB) and throughput (img/s), original → converted.
PAPER_VIT_LORA = {"mem_mib": (3827, 2717), "img_s": (288, 290)}
MODES = ("fp32", "bf16", "autocast")
MODE_LABEL = {"fp32": "fp32", "bf16": "bf16 weights", "autocast": "bf16 autocast, fp32 weights"}


@dataclass(frozen=True)
class Family:
    """One model family at one shape. ``seq`` is the token count (ViT: (img/16)^2 + 1)."""

    name: str
    label: str
    hidden: int
    inter: int
    heads: int
    seq: int = 0
    img: int = 0
    batch: int = 1
    layers: int = 2
    vocab: int = 256

    @property
    def tokens(self) -> int:
        return (self.img // 16) ** 2 + 1 if self.name == "vit" else self.seq

    @property
    def hf(self) -> bool:
        return self.name in ("llama", "bert")

    def describe(self) -> str:
        where = f"{self.img} px ({self.tokens} tokens)" if self.name == "vit" else f"seq {self.seq}"
        return (f"hidden {self.hidden}, {'MLP' if self.name == 'vit' else 'intermediate'} {self.inter}, "
                f"{self.heads} heads, {where}, batch {self.batch}")

    def with_(self, **kw) -> "Family":
        return replace(self, **kw)


FULL = {
    "llama": Family("llama", "LLaMA-7B", 4096, 11008, 32, seq=512),
    "vit": Family("vit", "ViT-B/16", 768, 3072, 12, img=224),
    "bert": Family("bert", "BERT-base", 768, 3072, 12, seq=512),
}
TINY = {
    "llama": Family("llama", "LLaMA (tiny)", 128, 344, 2, seq=32),
    "vit": Family("vit", "ViT (tiny)", 64, 256, 2, img=48),
    "bert": Family("bert", "BERT (tiny)", 64, 256, 2, seq=32),
}


def families(tiny: bool, names: Iterable[str] | None = None) -> list[Family]:
    table = TINY if tiny else FULL
    return [table[n] for n in (names or table)]


# ------------------------------------------------------------------------------------------ machine
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ram_gib() -> Optional[float]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError, AttributeError):
        return None


def machine(device: str = "cpu") -> str:
    """One line naming the hardware and software a figure was measured on."""
    import transformers

    sw = f"torch {torch.__version__}, transformers {transformers.__version__}"
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}), {sw}"
    mem = ram_gib()
    mem_s = "" if mem is None else f", {mem:.0f} GiB RAM"
    return f"CPU {cpu_name()}, {torch.get_num_threads()} threads{mem_s}, {sw}"


def free(reset_dynamo: bool = False) -> None:
    """Collect, and hand freed heap back to the OS (other processes share the machine's memory)."""
    if reset_dynamo and "torch._dynamo" in sys.modules:  # compiled graphs hold on to the modules they traced
        torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def err(e: BaseException) -> str:
    """An exception as one short line, for a result row that failed."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


def cuda_mem(device: str) -> dict:
    """Allocated and peak CUDA memory (empty off CUDA)."""
    if not device.startswith("cuda"):
        return {}
    return {"allocated": torch.cuda.memory_allocated(), "peak": torch.cuda.max_memory_allocated()}


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def quiet() -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("timm").setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore", message=".*gradient checkpointing.*")
    warnings.filterwarnings("ignore", message=".*use_cache=True.*")


# ------------------------------------------------------------------------------------------- models
def cheap_init(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random weights, fast: N(0, 0.02) matrices and biases, norm-like gains in U(0.5, 1.5)."""
    gens: dict = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.device.type == "meta":
                continue
            g = gens.get(p.device)
            if g is None:
                g = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            if p.dim() == 1 and not name.endswith("bias"):
                p.uniform_(0.5, 1.5, generator=g)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model


def build(fam: Family, dtype: torch.dtype, device: str = "cpu", layers: Optional[int] = None,
          attn: str = "sdpa") -> nn.Module:
    """The family's model with ``layers`` blocks (default fam.layers), weights in ``dtype``, train mode."""
    quiet()
    n = fam.layers if layers is None else layers
    if fam.name == "vit":
        import timm

        with torch.device("meta"):
            m = timm.create_model("vit_base_patch16_224", pretrained=False, depth=n, embed_dim=fam.hidden,
                                  num_heads=fam.heads, mlp_ratio=fam.inter / fam.hidden, img_size=fam.img)
        m = m.to(dtype).to_empty(device=device)
    else:
        from transformers import AutoConfig, AutoModel

        if fam.name == "llama":
            cfg = AutoConfig.for_model("llama", hidden_size=fam.hidden, intermediate_size=fam.inter,
                                       num_hidden_layers=n, num_attention_heads=fam.heads,
                                       num_key_value_heads=fam.heads, vocab_size=fam.vocab,
                                       max_position_embeddings=max(4096, fam.seq), tie_word_embeddings=False,
                                       use_cache=False)
        else:
            cfg = AutoConfig.for_model("bert", hidden_size=fam.hidden, intermediate_size=fam.inter,
                                       num_hidden_layers=n, num_attention_heads=fam.heads, vocab_size=fam.vocab,
                                       max_position_embeddings=max(512, fam.seq), hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0)
        with torch.device("meta"):
            m = AutoModel.from_config(cfg, dtype=dtype, attn_implementation=attn)
        m = m.to_empty(device=device)
    cheap_init(m)
    with torch.no_grad():  # buffers to_empty left uninitialised
        if fam.name == "llama":
            m.rotary_emb.__init__(config=m.config)
            m.rotary_emb.to(device)
        elif fam.name == "bert":
            m.embeddings.position_ids.copy_(torch.arange(m.embeddings.position_ids.shape[-1]))
            m.embeddings.token_type_ids.zero_()
    return m.train()


def make_input(fam: Family, dtype: torch.dtype, device: str = "cpu", batch: Optional[int] = None,
               seed: int = 0) -> torch.Tensor:
    b = fam.batch if batch is None else batch
    g = torch.Generator(device="cpu").manual_seed(seed)
    if fam.name == "vit":
        return torch.randn(b, 3, fam.img, fam.img, generator=g).to(device=device, dtype=dtype)
    return torch.randint(0, fam.vocab, (b, fam.seq), generator=g).to(device)


def forward(fam: Family, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if fam.name == "vit":
        return model(x)
    if fam.name == "llama":
        return model(input_ids=x, use_cache=False).last_hidden_state
    return model(input_ids=x).last_hidden_state


def set_checkpointing(model: nn.Module, on: bool) -> None:
    """Per-block activation checkpointing (non-reentrant), the usual way each library exposes it."""
    if hasattr(model, "set_grad_checkpointing"):  # timm
        model.set_grad_checkpointing(on)
    elif hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        if on:
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def compile_blocks(model: nn.Module, **kw) -> None:
    """torch.compile each block (inductor by default), the usual way to compile a transformer for training."""
    for blk in block_list(model):
        blk.compile(**kw)


def autocast_ctx(device: str, on: bool):
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=on)


def mode_dtype(mode: str) -> torch.dtype:
    return torch.bfloat16 if mode == "bf16" else torch.float32


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


# ------------------------------------------------------------------------------------------- memory
def saved_bytes(fam: Family, model: nn.Module, x: torch.Tensor, autocast: bool) -> int:
    """Exact saved-for-backward bytes of one forward of the family's model."""
    def fwd():
        with autocast_ctx(str(x.device), autocast):
            return forward(fam, model, x)

    return ledger_bytes(fwd, model)


def per_block_bytes(fam: Family, model: nn.Module, x: torch.Tensor, autocast: bool) -> int:
    """Bytes one block keeps for backward: bytes(L blocks) - bytes(first L-1 blocks)."""
    n = len(block_list(model))
    full = saved_bytes(fam, model, x, autocast)
    with truncated(model, n - 1):
        short = saved_bytes(fam, model, x, autocast)
    return full - short


def warm_up(fam: Family, model: nn.Module, x: torch.Tensor, autocast: bool, backward: bool = True) -> None:
    """Run forward (and backward) once on the full and the truncated model: triggers compilation."""
    for n in (len(block_list(model)), len(block_list(model)) - 1):
        with truncated(model, n):
            with autocast_ctx(str(x.device), autocast):
                out = forward(fam, model, x)
            if backward:
                loss_of(out).backward()
            del out
    model.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------------------- timing
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def step_fn(fam: Family, model: nn.Module, x: torch.Tensor, autocast: bool) -> Callable[[], None]:
    """One training step without the optimizer: forward, loss, backward, drop the grads."""

    def step() -> None:
        with autocast_ctx(str(x.device), autocast):
            out = forward(fam, model, x)
        loss_of(out).backward()
        model.zero_grad(set_to_none=True)

    return step


def time_interleaved(steps: dict[str, Callable[[], None]], repeats: int, warmup: int = 1,
                     device: str = "cpu", clock: Callable[[], float] = time.perf_counter, inner: int = 1,
                     around: Optional[Callable[[str], ContextManager]] = None) -> dict[str, list[float]]:
    """Seconds per call of each step over ``repeats`` rounds, the steps interleaved within each round (A/B/A/B:
    drift and other load hit all alike), ``warmup`` rounds dropped. ``clock``: ``time.thread_time`` with one
    thread counts only this thread's CPU time (others' load on a shared machine does not); ``inner`` calls per
    timed sample for sub-millisecond steps; ``around(name)`` is a context entered outside the timed region."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(warmup + repeats):
        for k, fn in steps.items():
            with around(k) if around is not None else contextlib.nullcontext():
                sync(device)
                t0 = clock()
                for _ in range(inner):
                    fn()
                sync(device)
                dt = clock() - t0
            if i >= warmup:
                times[k].append(dt / inner)
    return times


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ------------------------------------------------------------------------------------------- output
def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def parse_dtypes(parser, s: str, flag: str = "--dtypes") -> list:
    """'bf16,fp32' -> [torch.bfloat16, torch.float32]; an unknown name is the parser's error."""
    names = [d.strip() for d in s.split(",") if d.strip()]
    bad = [d for d in names if d not in DTYPES]
    if bad:
        parser.error(f"{flag}: unknown {bad}; choose from {list(DTYPES)}")
    return [DTYPES[d] for d in names]


def parse_size(s: str) -> int:
    """'16M' -> 16 * 2**20 elements (K/M/G suffixes)."""
    s = s.strip().upper()
    mult = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def size_label(n: int) -> str:
    for unit, m in (("G", 2 ** 30), ("M", 2 ** 20), ("K", 2 ** 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def fmt_bytes(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MiB" if n >= 2 ** 20 else f"{n / 2 ** 10:.1f} KiB" if n >= 2 ** 10 else f"{n} B"


def mib(n: Optional[float]) -> str:
    return "—" if n is None else f"{n / MiB:.1f}"


def pct(new: Optional[float], ref: Optional[float]) -> str:
    """Signed change of ``new`` against ``ref``, e.g. '−29.2 %'."""
    if new is None or not ref:
        return "—"
    d = 100.0 * (new / ref - 1.0)
    return f"{'−' if d < 0 else '+'}{abs(d):.1f} %"


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def save_json(path: Optional[str], data: dict) -> None:
    """``write_json`` where the run was given a path (``--json``); runs save after each part, so a run stopped
    from outside keeps what it measured."""
    if path:
        write_json(path, data)


def finish(data: dict, t0: float, path: Optional[str]) -> dict:
    """Stamp the run's wall seconds since ``t0`` (``elapsed_s``), save it (``save_json``), return it."""
    data["elapsed_s"] = round(time.perf_counter() - t0, 1)
    save_json(path, data)
    return data


def print_end(data: dict, render: Optional[Callable[[dict, str], Iterable[str]]] = None,
              plot: Optional[str] = None) -> int:
    """The end of a benchmark's ``main``: the charts ``render(data, plot)`` wrote (with ``--plot``), the run's
    time; exit status 0."""
    if plot and render is not None:
        for p in render(data, plot):
            print(f"wrote {p}")
    print(f"\n{data['elapsed_s']} s")
    return 0


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def as_dict(fam: Family) -> dict:
    d = asdict(fam)
    d["tokens"] = fam.tokens
    d["describe"] = fam.describe()
    return d


def plt():
    """matplotlib with a file-only backend (pip install matplotlib, or the project's 'bench' extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def save_figure(fig, path: str) -> None:
    """Lay out, write as PNG (the size docs/ embeds) and close."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt().close(fig)
