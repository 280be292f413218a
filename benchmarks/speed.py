"""Step time of converted vs original models, convert() time vs model size, and a GPU mode.

    python -m benchmarks.speed                  # CPU: step time + convert() scaling, ~5 min on 2 cores
    python -m benchmarks.speed --tiny           # smoke run
    python -m benchmarks.speed --gpu            # CUDA machine, one command, <= 8 min on one H200

CPU step time: forward + loss + backward (no optimizer), median of ``--repeats`` runs after ``--warmup``
discarded ones, variants interleaved so drift hits all alike: original, converted (the ops' native CPU kernels,
or their PyTorch path where those cannot be built), and per-block checkpointing of the original. Two blocks of
each family (shapes in common.py; LLaMA at seq 256 here to keep the run short); ViT and BERT in fp32, bf16
weights and bf16 autocast, LLaMA in the last two (``--modes`` picks for all). ``--threads`` (default 1):
torch's CPU threads; with one thread the clock is ``time.thread_time`` (this thread's CPU time: other
processes on a shared machine do not count), with more ``time.perf_counter``.

convert() scaling: LLaMA-shaped causal LMs from ~60 M to ~1.1 B parameters (fp32, random weights): trace +
plan alone and the whole convert() (trace, plan, rewrite, verify).

GPU mode (``--gpu``; exits with status 2 at once when CUDA is not available; ``scripts/gpu_run.sh`` runs it
together with the CUDA tests, the kernel bandwidth and the QLoRA flow):
  1. ViT-B/16 LoRA r4 (qkv; head trained), batch 64, 224 px, bf16 autocast, AdamW: img/s,
     torch.cuda.max_memory_allocated and the GPU's busy fraction (kernel time from torch.profiler over the
     unprofiled step time), original vs converted, eager, torch.compile (per block) and
     torch.compile(mode="reduce-overhead") (CUDA graphs), next to the paper (3827 → 2717 MiB, 288 → 290 img/s).
  2. LLaMA-7B-shaped slice (4 blocks, batch 4 x seq 512 by default: --llama-seq / --llama-batch), bf16 weights
     (and bf16 autocast): tokens/s, peak memory, busy fraction and exact per-block saved bytes for original
     eager, torch.compile, Liger-Kernel (its apply_liger_kernel_to_llama: RMSNorm, SwiGLU, RoPE; carried as a
     wheel when not installed), converted (Triton kernels), converted + compile, and checkpointing; plus a
     cross-check of the byte ledger against torch.cuda.memory_allocated.
  3. ViT-B/16 and BERT-base blocks: per-block bytes, original / converted / Liger LayerNorm.
  4. Per-kernel bandwidth: benchmarks/kernels.py, if time is left.
``--sections`` picks and orders the sections. The eager rows of 1 and 2 run first, then their compiled rows,
then CUDA graphs, so a time budget (``--budget-s``) that runs out skips the least essential rows. Every row is
guarded: a failure is recorded with its error and the run goes on. Results: JSON (``--json``, default
$OUT/bench_gpu.json when OUT is set), rewritten after every row, and a markdown summary on stdout.
"""
from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import time
import traceback
from typing import Callable, Optional

import torch
from torch import nn

from benchmarks import common as C

NO_CUDA = ("benchmarks.speed --gpu: no CUDA device available (torch.cuda.is_available() is False); run it on a CUDA "
           "machine, or drop --gpu for the CPU benchmark.")
V_ORIG, V_CONV, V_CKPT, V_LIGER = "original", "converted", "checkpointing", "Liger-Kernel"
V_COMPILE, V_CONV_COMPILE = "torch.compile", "converted + compile"
#: CPU step-time shapes: LLaMA at seq 256 (two 7B-shaped blocks take ~1-2 s a step on 2 cores), ViT batch 4.
CPU_SPEED = {"llama": {"seq": 256}, "vit": {"batch": 4}, "bert": {}}
#: Default step-time modes per family (``--modes`` overrides): a fp32 LLaMA-7B step on one thread takes ~20 s.
CPU_MODES = {"llama": ("bf16", "autocast"), "vit": ("fp32", "bf16", "autocast"), "bert": ("fp32", "bf16", "autocast")}
#: The ViT and BERT steps are short (~0.2 s), so one preemption by another process weighs more: time more runs.
CPU_REPEAT_X = {"llama": 1, "vit": 3, "bert": 3}
#: convert() scaling sizes: (hidden, intermediate, layers, vocab); the last is TinyLlama-1.1B's shape.
CONVERT_SIZES = [(512, 1376, 8, 32000), (1024, 2752, 16, 32000), (1536, 4096, 20, 32000), (2048, 5632, 22, 32000)]
CONVERT_SIZES_TINY = [(64, 172, 2, 256), (128, 344, 2, 256)]


# ============================================================================================ CPU
def cpu_step_times(fam: C.Family, mode: str, repeats: int, warmup: int, log=print,
                   clock: Callable[[], float] = time.perf_counter) -> list[dict]:
    from lmbp_convert import convert

    dtype, ac = C.mode_dtype(mode), mode == "autocast"
    orig = C.build(fam, dtype)
    conv = convert(copy.deepcopy(orig))
    ckpt = copy.deepcopy(orig)
    C.set_checkpointing(ckpt, True)
    x = C.make_input(fam, dtype)
    steps = {V_ORIG: C.step_fn(fam, orig, x, ac), V_CONV: C.step_fn(fam, conv, x, ac),
             V_CKPT: C.step_fn(fam, ckpt, x, ac)}
    times = C.time_interleaved(steps, repeats, warmup, clock=clock)
    t0, b0 = C.median(times[V_ORIG]), min(times[V_ORIG])
    rows = []
    for v, ts in times.items():
        m = C.median(ts)
        rows.append({"family": fam.name, "label": fam.label, "mode": mode, "variant": v, "median_s": m,
                     "min_s": min(ts), "runs_s": [round(t, 4) for t in ts], "ratio": m / t0,
                     "ratio_min": min(ts) / b0, "shape": fam.describe()})
        log(f"  {fam.label:<10} {mode:<8} {v:<14} {m:8.3f} s/step (best {min(ts):.3f})  ×{m / t0:.3f} "
            f"(best ×{min(ts) / b0:.3f})")
    del orig, conv, ckpt
    C.free()
    return rows


def build_causal_lm(hidden: int, inter: int, layers: int, vocab: int, dtype=torch.float32) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    C.quiet()
    cfg = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                               num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 256),
                               vocab_size=vocab, tie_word_embeddings=False)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    m = C.cheap_init(m.to_empty(device="cpu"))
    m.model.rotary_emb.__init__(config=cfg)
    return m


def time_convert(model: nn.Module):
    """(seconds for trace + plan alone, seconds for the whole convert(), its report); converts in place."""
    from lmbp_convert import convert, plan_conversion

    t0 = time.perf_counter()
    plan_conversion(model)
    t_plan = time.perf_counter() - t0
    t0 = time.perf_counter()
    rep = convert(model).lmbp_report
    return t_plan, time.perf_counter() - t0, rep


def convert_scaling(sizes, log=print) -> list[dict]:
    rows = []
    for h, i, n, v in sizes:
        m = build_causal_lm(h, i, n, v)
        params = sum(p.numel() for p in m.parameters())
        t_plan, t_conv, rep = time_convert(m)
        rows.append({"hidden": h, "intermediate": i, "layers": n, "vocab": v, "params": params,
                     "plan_s": round(t_plan, 2), "convert_s": round(t_conv, 2), "verified": rep.verified})
        log(f"  convert() LLaMA h{h} i{i} L{n}: {params / 1e6:7.0f} M params  trace+plan {t_plan:5.2f} s  "
            f"convert {t_conv:5.2f} s  verified {rep.verified}")
        del m, rep
        C.free()
    return rows


# ============================================================================================ GPU
class Budget:
    def __init__(self, seconds: float):
        self.t0 = time.perf_counter()
        self.seconds = seconds

    @property
    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)


def gpu_problem(device: str) -> Optional[str]:
    """Why the GPU mode cannot run (None when it can); checked before any model is built."""
    if not device.startswith("cuda"):
        return None  # the tests run this mode's code on CPU tensors
    if not torch.cuda.is_available():
        return NO_CUDA
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "benchmarks.speed --gpu: TRITON_INTERPRET=1 is set (Triton would interpret on the CPU); unset it."
    return None


def liger_llama(model: nn.Module) -> str:
    """Liger-Kernel on a LlamaModel instance: RMSNorm, SwiGLU MLP, RoPE (its apply_liger_kernel_to_llama)."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=False, model=model)
    return "apply_liger_kernel_to_llama(rope, rms_norm, swiglu)"


def liger_layer_norms(model: nn.Module) -> str:
    """Every nn.LayerNorm swapped for LigerLayerNorm with the same weights (ViT, BERT)."""
    from liger_kernel.transformers.layer_norm import LigerLayerNorm

    n = 0
    for name, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            if type(child) is nn.LayerNorm:
                new = LigerLayerNorm(child.normalized_shape[0], eps=child.eps, bias=True)
                new = new.to(device=child.weight.device, dtype=child.weight.dtype)
                with torch.no_grad():
                    new.weight.copy_(child.weight)
                    new.bias.copy_(child.bias)
                setattr(mod, cname, new)
                n += 1
    return f"{n} LayerNorm → LigerLayerNorm"


class _ModuleSnapshot:
    """Restore a module's globals after a library monkey-patches them (Liger patches modeling_llama)."""

    def __init__(self, module):
        self.module, self.saved = module, dict(vars(module))

    def restore(self) -> None:
        for k in list(vars(self.module)):
            if k not in self.saved:
                delattr(self.module, k)
        for k, v in self.saved.items():
            setattr(self.module, k, v)


def _vit_lora_model(fam: C.Family, device: str, tiny: bool, convert_: bool) -> nn.Module:
    import peft
    import timm
    from lmbp_convert import convert

    with torch.device("meta"):
        m = timm.create_model("vit_base_patch16_224", pretrained=False, embed_dim=fam.hidden, num_heads=fam.heads,
                              mlp_ratio=fam.inter / fam.hidden, img_size=fam.img, depth=2 if tiny else 12,
                              num_classes=100)
    m = C.cheap_init(m.to_empty(device=device))
    if convert_:
        convert(m)
    cfg = peft.LoraConfig(r=4, lora_alpha=4, lora_dropout=0.0, target_modules=["qkv"], modules_to_save=["head"])
    return peft.get_peft_model(m, cfg).train()


#: torch.compile backend of the ViT compile rows: None = inductor with the row's mode (tests use "eager").
COMPILE_BACKEND: Optional[str] = None
#: ViT LoRA variants: (name, converted?, torch.compile mode or None). Blocks are compiled one by one (the
#: usual way for a transformer; identical blocks share one compiled graph), the optimizer step stays eager.
VIT_VARIANTS = [(V_ORIG, False, None), (V_CONV, True, None),
                (V_COMPILE, False, "default"), (V_CONV_COMPILE, True, "default"),
                (V_COMPILE + " (reduce-overhead)", False, "reduce-overhead"),
                (V_CONV_COMPILE + " (reduce-overhead)", True, "reduce-overhead")]


def gpu_kernel_ms(step: Callable[[], None], device: str, steps: int = 3) -> Optional[float]:
    """GPU kernel time per step (ms): the sum of the device-side durations torch.profiler records for `steps`
    steps. Against the unprofiled step time it gives the GPU's busy fraction; the profiler's own host overhead
    does not enter (only device durations are summed)."""
    if not device.startswith("cuda"):
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total_us = sum(e.time_range.elapsed_us() for e in prof.events()
                   if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)  # kernels, copies
    return total_us / steps / 1e3


def _busy(row: dict, step: Callable[[], None], device: str) -> None:
    """Adds the GPU kernel ms per step and the busy fraction (kernel time / step time) to ``row``."""
    try:
        k = gpu_kernel_ms(step, device)
    except Exception as e:  # the profiler is optional: the throughput figures stand without it
        row["busy_error"] = C.err(e)
        return
    if k is not None:
        row["gpu_kernel_ms"] = k
        row["gpu_busy"] = k / (row["step_s"] * 1e3)


def _compile_blocks_counted(fam: C.Family, m: nn.Module, mode: str) -> Callable[[dict], None]:
    """Compile each block; returns a function that records graph / graph-break counts into a row."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    dynamo.reset()
    counters.clear()
    for blk in C.block_list(m.base_model.model if hasattr(m, "base_model") else m):
        if COMPILE_BACKEND is None:
            blk.compile(mode=mode)
        else:
            blk.compile(backend=COMPILE_BACKEND)

    def record(row: dict) -> None:
        row.update({"graphs": int(counters["stats"].get("unique_graphs", 0)),
                    "graph_breaks": int(sum(counters["graph_break"].values()))})
        if mode == "reduce-overhead":  # inductor falls back to no CUDA graph for a graph it cannot capture
            row["cudagraph_skips"] = int(counters["inductor"].get("cudagraph_skips", 0))

    return record


def _vit_lora_variant(fam: C.Family, device: str, tiny: bool, variant: str, steps: int, warmup: int,
                      convert_: bool = False, compile_mode: Optional[str] = None) -> dict:
    """One variant, start to end inside this frame, so nothing of it outlives the measurement."""
    base = C.cuda_mem(device).get("allocated", 0)
    m = _vit_lora_model(fam, device, tiny, convert_)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
    x = C.make_input(fam, torch.float32, device)
    y = torch.randint(0, 100, (fam.batch,), device=device)
    row: dict = {"variant": variant, "converted": convert_, "compile": compile_mode}
    record = _compile_blocks_counted(fam, m, compile_mode) if compile_mode else None
    graphs = compile_mode == "reduce-overhead" and device.startswith("cuda")

    def step():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with C.autocast_ctx(device, True):
            logits = m(x)
        nn.functional.cross_entropy(logits.float(), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for _ in range(max(warmup, 3 if compile_mode else 0)):  # CUDA graphs record on the 2nd-3rd call
        step()
    C.sync(device)
    row["warmup_s"] = round(time.perf_counter() - t0, 1)
    if record:
        record(row)
    if not compile_mode:  # saved bytes do not depend on compiling; hooks would also stop CUDA graphs
        def fwd():
            with C.autocast_ctx(device, True):
                return m(x)

        row["saved_bytes"] = C.ledger_bytes(fwd, m)
    C.reset_peak(device)
    row["static"] = C.cuda_mem(device).get("allocated", 0)
    times = C.time_interleaved({"s": step}, steps, 0, device)["s"]
    med = C.median(times)
    row.update({"img_s": fam.batch / med, "step_s": med, **C.cuda_mem(device)})
    if "peak" in row:
        row["peak_over_baseline"] = row["peak"] - base
        row["peak_over_static"] = row["peak"] - row["static"]
    _busy(row, step, device)
    return row


def vit_lora(device: str, tiny: bool, steps: int, warmup: int, budget: Budget, log=print,
             compile_: bool = True, only: Optional[set] = None, into: Optional[dict] = None,
             on_row: Callable[[], None] = lambda: None) -> dict:
    """ViT-B/16 LoRA r4 batch 64 training steps: img/s, peak memory, GPU busy fraction; original vs converted,
    eager, torch.compile and torch.compile(mode="reduce-overhead") (CUDA graphs)."""
    import torch._dynamo as dynamo

    fam = C.TINY["vit"].with_(batch=4) if tiny else C.FULL["vit"].with_(batch=64)
    out = into if into is not None else {}
    out.update({"shape": fam.describe() + ", LoRA r4 on qkv (alpha 4), head trained, AdamW, bf16 autocast, "
                                          "fp32 weights, 100 classes", "paper": C.PAPER_VIT_LORA})
    out.setdefault("rows", [])
    for variant, conv, mode in VIT_VARIANTS:
        if (mode and not compile_) or (only is not None and variant not in only):
            continue
        need = 60 if mode else 20
        if budget.left < need:
            out["rows"].append({"variant": variant, "skipped": "time budget"})
            on_row()
            continue
        C.free()
        try:
            row = _vit_lora_variant(fam, device, tiny, variant, steps, warmup, conv, mode)
            log(f"  ViT-B/16 LoRA {variant:<38} {row['img_s']:8.1f} img/s (median step)  peak "
                + (f"{row['peak'] / C.MiB:8.0f} MiB" if "peak" in row else "n/a (not CUDA)")
                + (f"  saved {row['saved_bytes'] / C.MiB:8.1f} MiB" if "saved_bytes" in row else "")
                + (f"  GPU busy {100 * row['gpu_busy']:.0f} %" if "gpu_busy" in row else "")
                + (f"  ({row['graphs']} graphs, {row['graph_breaks']} breaks, warm-up {row['warmup_s']} s)"
                   if "graphs" in row else ""))
        except Exception as e:
            row = {"variant": variant, "error": C.err(e)}
            log(f"  ViT-B/16 LoRA {variant}: FAILED {row['error']}")
            traceback.print_exc()
        finally:
            dynamo.reset()
        out["rows"].append(row)
        on_row()
        C.free()
    return out


def _linear_weight_bytes_bf16(m: nn.Module) -> int:
    """What autocast's weight cache holds during a forward: a bf16 copy of every fp32 Linear weight."""
    return sum(mod.weight.numel() * 2 for mod in m.modules()
               if isinstance(mod, nn.Linear) and mod.weight.dtype == torch.float32)


def _llama_variant(fam: C.Family, device: str, mode: str, variant: str, steps: int, warmup: int) -> dict:
    """One variant of the LLaMA slice, start to end inside this frame (no model outlives it)."""
    from lmbp_convert import SavedTensorLedger, convert

    dtype, ac = C.mode_dtype(mode), mode == "autocast"
    row: dict = {"mode": mode, "variant": variant}
    base = C.cuda_mem(device).get("allocated", 0)
    m = C.build(fam, dtype, device)
    if variant in (V_CONV, V_CONV_COMPILE):
        convert(m)
    elif variant == V_LIGER:
        row["how"] = liger_llama(m)
    elif variant == V_CKPT:
        C.set_checkpointing(m, True)
    x = C.make_input(fam, dtype, device)
    if "compile" in variant:
        import torch._dynamo as dynamo
        from torch._dynamo.utils import counters

        dynamo.reset()
        counters.clear()
        C.compile_blocks(m)
        t0 = time.perf_counter()
        C.warm_up(fam, m, x, ac, backward=True)
        row.update({"compile_s": round(time.perf_counter() - t0, 1),
                    "graphs": int(counters["stats"].get("unique_graphs", 0)),
                    "graph_breaks": int(sum(counters["graph_break"].values()))})
    step = C.step_fn(fam, m, x, ac)
    for _ in range(warmup):
        step()
    # per-block bytes (L blocks minus L-1) and the allocator's view of one whole forward
    row["block_bytes"] = C.per_block_bytes(fam, m, x, ac)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with SavedTensorLedger(m) as led:
            with C.autocast_ctx(device, ac):
                y = C.forward(fam, m, x)
        torch.cuda.synchronize()
        row["ledger_bytes"] = led.bytes
        row["alloc_delta_bytes"] = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
        if ac:  # autocast keeps its bf16 weight copies alive until the autocast region closes
            row["autocast_cache_bytes"] = _linear_weight_bytes_bf16(m)
        del y, led
    C.reset_peak(device)
    static = C.cuda_mem(device).get("allocated", 0)
    times = C.time_interleaved({"s": step}, steps, 0, device)["s"]
    med = C.median(times)
    row.update({"step_s": med, "tokens_s": fam.batch * fam.seq / med, **C.cuda_mem(device)})
    if "peak" in row:
        row["peak_over_static"] = row["peak"] - static
        row["peak_over_baseline"] = row["peak"] - base
    _busy(row, step, device)
    return row


def llama_slice(device: str, tiny: bool, modes, steps: int, warmup: int, budget: Budget, compile_: bool,
                log=print, seq: Optional[int] = None, batch: Optional[int] = None,
                checkpointing: bool = True, only: Optional[set] = None, into: Optional[dict] = None,
                on_row: Callable[[], None] = lambda: None) -> dict:
    """LLaMA-7B-shaped slice: tokens/s, peak memory, per-block saved bytes, ledger cross-check, GPU busy
    fraction; original eager, torch.compile, Liger-Kernel, converted, converted + compile (and checkpointing)."""
    from transformers.models.llama import modeling_llama

    fam = C.TINY["llama"].with_(layers=3, batch=2) if tiny else C.FULL["llama"].with_(layers=4, batch=4)
    fam = fam.with_(seq=seq or fam.seq, batch=batch or fam.batch)
    out = into if into is not None else {}
    out["shape"] = f"{fam.layers} blocks, " + fam.describe()
    out.setdefault("rows", [])
    for mode in modes:
        variants = [V_ORIG] + ([V_COMPILE] if compile_ and mode == "bf16" else []) + [V_LIGER, V_CONV]
        variants += ([V_CONV_COMPILE] if compile_ and mode == "bf16" else []) + ([V_CKPT] if checkpointing else [])
        for variant in [v for v in variants if only is None or v in only]:
            need = 90 if "compile" in variant else 20
            if budget.left < need:
                out["rows"].append({"mode": mode, "variant": variant, "skipped": "time budget"})
                on_row()
                continue
            snap = _ModuleSnapshot(modeling_llama)  # Liger patches the module's globals
            C.free()
            try:
                row = _llama_variant(fam, device, mode, variant, steps, warmup)
                log(f"  LLaMA slice {mode:<8} {variant:<20} {row['tokens_s']:9.0f} tok/s  block "
                    f"{row['block_bytes'] / C.MiB:7.1f} MiB"
                    + (f"  peak +{row['peak_over_baseline'] / C.MiB:.0f} MiB (+{row['peak_over_static'] / C.MiB:.0f}"
                       f" over weights)  ledger {row['ledger_bytes'] / C.MiB:.1f} vs allocator "
                       f"{row['alloc_delta_bytes'] / C.MiB:.1f} MiB" if "peak" in row else ""))
            except Exception as e:
                row = {"mode": mode, "variant": variant, "error": C.err(e)}
                log(f"  LLaMA slice {mode} {variant}: FAILED {row['error']}")
                if not isinstance(e, ImportError):  # a missing package (Liger) needs no traceback
                    traceback.print_exc()
            finally:
                snap.restore()
                import torch._dynamo as dynamo

                dynamo.reset()
            out["rows"].append(row)
            on_row()
            C.free()
    return out


def gpu_blocks(device: str, tiny: bool, modes, budget: Budget, log=print) -> dict:
    """Per-block bytes of the ViT-B/16 and BERT-base blocks on the GPU: original, converted, Liger LayerNorm."""
    from lmbp_convert import convert

    out = {"rows": []}
    for fam in C.families(tiny, ["vit", "bert"]):
        for mode in modes:
            dtype, ac = C.mode_dtype(mode), mode == "autocast"
            for variant in (V_ORIG, V_CONV, V_LIGER):
                row = {"family": fam.name, "label": fam.label, "shape": fam.describe(), "mode": mode,
                       "variant": variant}
                if budget.left < 15:
                    row["skipped"] = "time budget"
                    out["rows"].append(row)
                    continue
                try:
                    m = C.build(fam, dtype, device)
                    if variant == V_CONV:
                        convert(m)
                    elif variant == V_LIGER:
                        row["how"] = liger_layer_norms(m)
                    x = C.make_input(fam, dtype, device)
                    row["block_bytes"] = C.per_block_bytes(fam, m, x, ac)
                    log(f"  {fam.label:<10} {mode:<8} {variant:<14} {row['block_bytes'] / C.MiB:8.2f} MiB per block")
                    del m
                except Exception as e:
                    row["error"] = C.err(e)
                    log(f"  {fam.label} {mode} {variant}: FAILED {row['error']}")
                out["rows"].append(row)
                C.free()
    return out


def kernel_bandwidth(budget: Budget, log=print) -> dict:
    """benchmarks/kernels.py (per-kernel GB/s next to torch's kernels), in a subprocess."""
    left = budget.left - 10
    if left < 45:
        return {"skipped": "time budget"}
    out_md = os.path.join(os.environ.get("OUT") or "/tmp", "gpu_kernels.md")
    cmd = [sys.executable, "-m", "benchmarks.kernels", "--dtypes", "bf16", "--sizes", "64M", "--runs", "10",
           "--skip-variants", "--budget-s", str(int(left - 15)), "--out", out_md]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        p = subprocess.run(cmd, cwd=C.ROOT, env=env, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired:
        return {"error": "benchmarks.kernels timed out"}
    table = "\n".join(line for line in p.stdout.splitlines() if line.startswith("|"))
    log(table)
    return {"returncode": p.returncode, "table": table, "stderr_tail": p.stderr[-1500:]}


def software_versions() -> dict:
    """Versions of what the GPU figures depend on (None: not installed)."""
    from importlib import metadata

    out = {}
    for name in ("torch", "triton", "transformers", "timm", "peft", "liger-kernel", "bitsandbytes", "lmbp-convert"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


#: Run order of the GPU mode's variants (see gpu_run): eager, then torch.compile, then CUDA graphs.
VIT_PHASES = [{V_ORIG, V_CONV}, {V_COMPILE, V_CONV_COMPILE},
              {V_COMPILE + " (reduce-overhead)", V_CONV_COMPILE + " (reduce-overhead)"}]
LLAMA_PHASES = [{V_ORIG, V_LIGER, V_CONV, V_CKPT}, {V_COMPILE, V_CONV_COMPILE}]


def gpu_run(args, log=print) -> dict:
    budget = Budget(args.budget_s)
    device = args.device
    data = {"kind": "gpu", "machine": C.machine(device), "device": device, "tiny": args.tiny,
            "budget_s": args.budget_s}
    modes = args.mode_list

    def save():
        C.save_json(args.json, data)

    wanted = [n.strip() for n in args.sections.split(",") if n.strip()]

    def sec(name: str) -> dict:
        return data.setdefault(name, {"rows": []})

    def vit(only: set) -> Callable[[], dict]:
        return lambda: vit_lora(device, args.tiny, args.steps, args.warmup, budget, log, not args.no_compile,
                                only, sec("vit_lora"), save)

    def llama(only: set) -> Callable[[], dict]:
        return lambda: llama_slice(device, args.tiny, modes, args.steps, args.warmup, budget, not args.no_compile,
                                   log, args.llama_seq, args.llama_batch, not args.no_checkpointing, only,
                                   sec("llama_slice"), save)

    # Eager rows of both models first, then their compiled rows, then CUDA graphs: when the time budget runs
    # out, what is left unmeasured is the least essential. Rows accumulate in their section and the JSON is
    # rewritten after each row, so a run stopped from outside keeps what it measured.
    phases: list[tuple[str, Callable[[], dict]]] = []
    n_phases = 1 if args.no_compile else len(VIT_PHASES)
    for vit_only, llama_only in list(zip(VIT_PHASES, LLAMA_PHASES + [None]))[:n_phases]:
        if "vit_lora" in wanted:
            phases.append(("vit_lora", vit(vit_only)))
        if "llama_slice" in wanted and llama_only is not None:
            phases.append(("llama_slice", llama(llama_only)))
    rest = {"blocks": lambda: gpu_blocks(device, args.tiny, modes, budget, log)}
    if device.startswith("cuda") and not args.skip_kernels:
        rest["kernels"] = lambda: kernel_bandwidth(budget, log)
    phases += [(n, rest[n]) for n in wanted if n in rest]
    data["software"] = software_versions()
    log("# " + ", ".join(f"{k} {v}" for k, v in data["software"].items()))
    for name, fn in phases:
        log(f"# {name} ({budget.left:.0f} s left)")
        t0 = time.perf_counter()
        try:
            part = fn()
        except Exception as e:  # the phase failed as a whole: keep its section's earlier rows
            part = data.setdefault(name, {})
            part.setdefault("errors", []).append(C.err(e))
            traceback.print_exc()
        data[name] = part
        part["seconds"] = round(part.get("seconds", 0) + time.perf_counter() - t0, 1)
        save()
    return C.finish(data, budget.t0, args.json)


# ============================================================================================ report
def cpu_table(data: dict) -> str:
    rows = []
    by = {}
    for r in data.get("steps", []):
        by.setdefault((r["label"], r["mode"], r["shape"]), {})[r["variant"]] = r
    for (label, mode, shape), vs in by.items():
        o, c, k = vs.get(V_ORIG), vs.get(V_CONV), vs.get(V_CKPT)
        rows.append((label, shape, C.MODE_LABEL[mode], f"{o['median_s']:.3f}", f"{c['median_s']:.3f}",
                     f"**{c['ratio']:.2f}×**", f"{k['median_s']:.3f}", f"{k['ratio']:.2f}×"))
    return C.markdown_table(("model (2 blocks)", "shape", "dtype", "original s/step", "converted s/step",
                             "converted / original", "checkpointing s/step", "checkpointing / original"), rows)


def convert_table(data: dict) -> str:
    rows = [(f"{r['params'] / 1e9:.2f} B", f"hidden {r['hidden']}, intermediate {r['intermediate']}, "
             f"{r['layers']} layers, vocab {r['vocab']}", f"{r['plan_s']:.2f}", f"{r['convert_s']:.2f}",
             r["verified"]) for r in data.get("convert", [])]
    return C.markdown_table(("params", "LLaMA shape (fp32)", "trace + plan s", "convert() s", "verified"), rows)


def _f(v, fmt="{:.0f}", scale=1.0) -> str:
    return "—" if v is None else fmt.format(v / scale)


def _pct(v: Optional[float]) -> str:
    return "—" if v is None else f"{100 * v:.0f} %"


def gpu_tables(g: dict) -> str:
    parts = [f"Machine: {g.get('machine')}."]
    v = g.get("vit_lora", {})
    if v.get("rows"):
        rows = []
        paper = C.PAPER_VIT_LORA
        ref = {r.get("compile"): r for r in v["rows"] if not r.get("converted") and "img_s" in r}
        for r in v["rows"]:
            err = r.get("error") or r.get("skipped")
            i = {V_ORIG: 0, V_CONV: 1}.get(r["variant"])
            p_mem, p_img = ("", "") if i is None else (paper["mem_mib"][i], paper["img_s"][i])
            name = r["variant"] + (f" ({r['graphs']} graphs, {r['graph_breaks']} breaks"
                                   + (f", {r['cudagraph_skips']} CUDA-graph skips" if "cudagraph_skips" in r else "")
                                   + ")" if "graphs" in r else "")
            o = ref.get(r.get("compile"), {})
            vs = (f"{r['img_s'] / o['img_s']:.2f}×" if not err and o.get("img_s") and r.get("converted") else "")
            rows.append((name, err or _f(r.get("peak"), scale=C.MiB),
                         "" if err else _f(r.get("peak_over_static"), scale=C.MiB),
                         "" if err else _f(r.get("img_s"), "{:.0f}"), vs,
                         "" if err else _pct(r.get("gpu_busy")),
                         "" if err else _f(r.get("saved_bytes"), "{:.1f}", C.MiB), p_mem, p_img))
        parts.append(f"**ViT-B/16 LoRA** ({v['shape']})\n\n" + C.markdown_table(
            ("variant", "peak allocated MiB", "peak over weights + optimizer MiB", "img/s",
             "converted / original (same compile mode)", "GPU busy", "saved for backward MiB",
             "paper peak MiB", "paper img/s"), rows))
    s = g.get("llama_slice", {})
    if s.get("rows"):
        rows = []
        ref = {r["mode"]: r for r in s["rows"] if r["variant"] == V_ORIG and "block_bytes" in r}
        for r in s["rows"]:
            err = r.get("error") or r.get("skipped")
            o = ref.get(r["mode"], {})
            if err:
                rows.append((C.MODE_LABEL[r["mode"]], r["variant"], f"not measured: {err}") + ("",) * 7)
                continue
            xc = (f"{r['ledger_bytes'] / C.MiB:.1f} / {r['alloc_delta_bytes'] / C.MiB:.1f}"
                  if "ledger_bytes" in r else "—")
            name = r["variant"] + (f" ({r['graphs']} graphs, {r['graph_breaks']} breaks)" if "graphs" in r else "")
            rows.append((C.MODE_LABEL[r["mode"]], name, _f(r["block_bytes"], "{:.1f}", C.MiB),
                         C.pct(r["block_bytes"], o.get("block_bytes")), _f(r.get("peak"), scale=C.MiB),
                         _f(r.get("peak_over_static"), scale=C.MiB), _f(r.get("tokens_s")),
                         f"{r['tokens_s'] / o['tokens_s']:.2f}×" if o.get("tokens_s") else "—",
                         _pct(r.get("gpu_busy")), xc))
        parts.append(f"**LLaMA-7B-shaped slice** ({s['shape']})\n\n" + C.markdown_table(
            ("dtype", "variant", "MiB per block", "vs original", "peak MiB", "peak over weights MiB",
             "tokens/s", "tokens/s vs original eager", "GPU busy", "ledger / allocator MiB (whole forward)"), rows))
    b = g.get("blocks", {})
    if b.get("rows"):
        rows = []
        ref = {(r["family"], r["mode"]): r.get("block_bytes") for r in b["rows"] if r["variant"] == V_ORIG}
        for r in b["rows"]:
            err = r.get("error") or r.get("skipped")
            rows.append((r["label"], C.MODE_LABEL[r["mode"]], r["variant"],
                         err or _f(r.get("block_bytes"), "{:.2f}", C.MiB),
                         "" if err else C.pct(r.get("block_bytes"), ref.get((r["family"], r["mode"])))))
        shapes = "; ".join(dict.fromkeys(f"{r['label']}: {r['shape']}" for r in b["rows"]))
        parts.append(f"**Per-block bytes on the GPU** ({shapes})\n\n" + C.markdown_table(
            ("block", "dtype", "variant", "MiB per block", "vs original"), rows))
    for name in ("vit_lora", "llama_slice", "blocks"):
        if g.get(name, {}).get("errors"):
            parts.append(f"{name}: phases that failed as a whole: " + "; ".join(map(str, g[name]["errors"])))
    q = g.get("qlora")
    if q and q.get("rows"):
        from benchmarks import qlora as bench_qlora

        parts.append(bench_qlora.table(q))
    k = g.get("kernels", {})
    if k.get("table"):
        parts.append("**Per-kernel bandwidth** (`python -m benchmarks.kernels`, bf16, 64M elements)\n\n" + k["table"])
    elif k:
        parts.append(f"Per-kernel bandwidth: not measured ({k.get('skipped') or k.get('error')}).")
    return "\n\n".join(parts)


def plot_cpu(data: dict, path: str) -> None:
    plt = C.plt()
    by = {}
    for r in data.get("steps", []):
        by.setdefault((r["label"], r["mode"]), {})[r["variant"]] = r
    keys = list(by)
    fig, ax = plt.subplots(figsize=(10, 5.4))
    width = 0.27
    colors = {V_ORIG: "#888888", V_CONV: "#1f77b4", V_CKPT: "#d62728"}
    for i, v in enumerate((V_ORIG, V_CONV, V_CKPT)):
        xs = [j + (i - 1) * width for j in range(len(keys))]
        vals = [by[k][v]["ratio"] for k in keys]
        bars = ax.bar(xs, vals, width, label=v, color=colors[v])
        for bar, k in zip(bars, keys):
            ax.text(bar.get_x() + width / 2, bar.get_height(), f"{by[k][v]['median_s']:.2f}s", ha="center",
                    va="bottom", fontsize=7, rotation=90)
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_xticks(range(len(keys)))
    shapes = {r["label"]: r["shape"] for r in data.get("steps", [])}
    ax.set_xticklabels([f"{lab}\n{C.MODE_LABEL[m].replace(', ', chr(10))}" for lab, m in keys], fontsize=7)
    ax.set_ylabel("step time / original (fwd + bwd)")
    ax.margins(y=0.2)
    ax.legend(fontsize=8)
    sh = "\n".join(f"{k}: {v}" for k, v in shapes.items())
    ax.set_title(f"CPU step time, median of {data.get('repeats')} runs (ViT, BERT: "
                 f"{3 * data.get('repeats', 0)}) after {data.get('warmup')} warm-up (2 blocks; labels: s/step)\n{sh}\n{data['machine']}", fontsize=7)
    C.save_figure(fig, path)


def plot_convert(data: dict, path: str) -> None:
    plt = C.plt()
    rows = data.get("convert", [])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ps = [r["params"] / 1e9 for r in rows]
    ax.plot(ps, [r["convert_s"] for r in rows], "o-", label="convert() total (trace, plan, rewrite, verify)")
    ax.plot(ps, [r["plan_s"] for r in rows], "s--", label="trace + plan alone")
    for r in rows:
        ax.annotate(f"{r['convert_s']:.1f} s", (r["params"] / 1e9, r["convert_s"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=7)
    ax.set_xlabel("parameters, billions (LLaMA-shaped causal LM, fp32, random weights)")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(f"convert() time vs model size\n{data['machine']}", fontsize=8)
    C.save_figure(fig, path)


def plot_gpu(g: dict, path: str) -> bool:
    v = [r for r in g.get("vit_lora", {}).get("rows", []) if "img_s" in r and "peak" in r
         and r["variant"] in (V_ORIG, V_CONV)]
    s = [r for r in g.get("llama_slice", {}).get("rows", []) if "tokens_s" in r and "peak" in r
         and r["mode"] == "bf16"]
    if not v and not s:
        return False
    plt = C.plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.0))
    if v:
        ax = axes[0]
        labels = [r["variant"] for r in v]
        ax.bar([0, 1][:len(v)], [r["peak"] / C.MiB for r in v], 0.35, label="ours: peak MiB", color="#1f77b4")
        ax.bar([0.36, 1.36][:len(v)], list(C.PAPER_VIT_LORA["mem_mib"])[:len(v)], 0.35, label="paper (its GPU): peak MiB",
               color="#aec7e8")
        for i, r in enumerate(v):
            ax.text(i, r["peak"] / C.MiB, f"{r['img_s']:.0f} img/s", ha="center", va="bottom", fontsize=8)
            ax.text(i + 0.36, C.PAPER_VIT_LORA["mem_mib"][i], f"{C.PAPER_VIT_LORA['img_s'][i]} img/s",
                    ha="center", va="bottom", fontsize=8)
        ax.set_xticks([0.18, 1.18][:len(v)])
        ax.set_xticklabels(labels)
        ax.set_ylabel("torch.cuda.max_memory_allocated, MiB")
        ax.margins(y=0.15)
        ax.legend(fontsize=8, loc="lower right")
        ax.set_title("ViT-B/16 LoRA r4, batch 64, bf16 autocast", fontsize=9)
    if s:
        ax = axes[1]
        xs = list(range(len(s)))
        ax.bar([i - 0.2 for i in xs], [r.get("ledger_bytes", 0) / C.MiB for r in s], 0.4, color="#2ca02c",
               label="held for backward after the forward (ledger)")
        ax.bar([i + 0.2 for i in xs], [r["peak_over_static"] / C.MiB for r in s], 0.4, color="#98df8a",
               label="step peak over weights (full gradients incl.)")
        for i, r in enumerate(s):
            ax.text(i, max(r.get("ledger_bytes", 0), r["peak_over_static"]) / C.MiB, f"{r['tokens_s'] / 1000:.0f}k tok/s",
                    ha="center", va="bottom", fontsize=7)
        ax.set_xticks(xs)
        ax.set_xticklabels([r["variant"].replace(" + ", "\n+ ") for r in s], fontsize=7)
        ax.set_ylabel("MiB")
        ax.margins(y=0.12)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
        ax.set_title(f"LLaMA-7B-shaped slice, bf16 weights\n{g['llama_slice']['shape']}", fontsize=9)
    fig.suptitle(g["machine"], fontsize=9)
    C.save_figure(fig, path)
    return True


def render(data: dict, outdir: str) -> list[str]:
    os.makedirs(outdir, exist_ok=True)
    paths = []
    if data.get("steps"):
        paths.append(os.path.join(outdir, "bench_speed.png"))
        plot_cpu(data, paths[-1])
    if data.get("convert"):
        paths.append(os.path.join(outdir, "bench_convert_time.png"))
        plot_convert(data, paths[-1])
    return paths


# ============================================================================================ main
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (smoke run)")
    ap.add_argument("--families", default="llama,vit,bert")
    ap.add_argument("--modes", default=None,
                    help="CPU steps: ViT/BERT fp32,bf16,autocast and LLaMA bf16,autocast by default; GPU: bf16,autocast")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU steps: torch threads (1: time.thread_time, more: time.perf_counter)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs (CPU default 5, GPU default 10)")
    ap.add_argument("--warmup", type=int, default=None, help="discarded runs (CPU default 1, GPU default 3)")
    ap.add_argument("--no-convert-scaling", action="store_true")
    ap.add_argument("--no-steps", action="store_true", help="skip the CPU step-time part")
    ap.add_argument("--gpu", action="store_true", help="the GPU benchmark (needs CUDA)")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # tests run the GPU mode's code on CPU
    ap.add_argument("--budget-s", type=float, default=420.0, help="GPU mode: skip work past this many seconds")
    ap.add_argument("--no-compile", action="store_true", help="GPU mode: skip the torch.compile rows")
    ap.add_argument("--skip-kernels", action="store_true", help="GPU mode: skip the per-kernel bandwidth")
    ap.add_argument("--sections", default="vit_lora,llama_slice,blocks,kernels",
                    help="GPU mode: which sections to run, in this order")
    ap.add_argument("--llama-seq", type=int, default=None, help="GPU mode: LLaMA slice sequence length (512)")
    ap.add_argument("--llama-batch", type=int, default=None, help="GPU mode: LLaMA slice batch (4)")
    ap.add_argument("--no-checkpointing", action="store_true", help="GPU mode: skip the checkpointing row")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--plot", default=None, help="write the PNG charts into this folder")
    a = ap.parse_args(argv)
    a.family_list = [s.strip() for s in a.families.split(",") if s.strip()]
    a.mode_list = [s.strip() for s in (a.modes or "bf16,autocast").split(",") if s.strip()]
    if not a.family_list or not set(a.family_list) <= set(C.FULL):
        ap.error(f"--families: choose from {list(C.FULL)}")
    if not a.mode_list or not set(a.mode_list) <= set(C.MODES):
        ap.error(f"--modes: choose from {list(C.MODES)}")
    a.steps = a.repeats if a.repeats is not None else (10 if a.gpu else 5)
    a.repeats = a.steps
    a.warmup = a.warmup if a.warmup is not None else (3 if a.gpu else 1)
    if a.threads < 1:
        ap.error("--threads must be >= 1")
    if a.steps < 1 or a.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    if a.gpu and a.json is None and os.environ.get("OUT"):
        a.json = os.path.join(os.environ["OUT"], "bench_gpu.json")
    return a


def cpu_run(args, log=print) -> dict:
    t0 = time.perf_counter()
    data = {"kind": "speed", "machine": C.machine("cpu"), "device": "cpu", "tiny": args.tiny,
            "repeats": args.repeats, "warmup": args.warmup, "steps": [], "convert": [],
            "loadavg_start": _loadavg()}
    if not args.no_steps:
        from lmbp_convert.ops import cpu_native

        threads = torch.get_num_threads()
        torch.set_num_threads(args.threads)
        clock = time.thread_time if args.threads == 1 else time.perf_counter
        data.update(threads=args.threads, clock=clock.__name__, cpu_kernels=cpu_native.status())
        log(f"# CPU step time on {data['machine']}; {args.threads} thread(s), time.{clock.__name__}; "
            f"CPU kernels: {data['cpu_kernels']}")
        try:
            for fam in C.families(args.tiny, args.family_list):
                if not args.tiny:
                    fam = fam.with_(**CPU_SPEED[fam.name])
                for mode in (args.mode_list if args.modes else CPU_MODES[fam.name]):
                    reps = args.repeats * (1 if args.tiny else CPU_REPEAT_X[fam.name])
                    data["steps"] += cpu_step_times(fam, mode, reps, args.warmup, log, clock)
                    C.save_json(args.json, data)
        finally:
            torch.set_num_threads(threads)
    if not args.no_convert_scaling:
        log("# convert() time vs parameters")
        data["convert"] = convert_scaling(CONVERT_SIZES_TINY if args.tiny else CONVERT_SIZES, log)
    data["loadavg_end"] = _loadavg()
    return C.finish(data, t0, args.json)


def _loadavg() -> Optional[list]:
    """1/5/15-minute load averages: on a shared machine, other work slows the timed steps."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _render_gpu(data: dict, out_dir: str) -> list[str]:
    path = os.path.join(out_dir, "bench_gpu.png")
    return [path] if plot_gpu(data, path) else []


def main(argv=None) -> int:
    args = parse_args(argv)
    C.quiet()
    if args.gpu:
        problem = gpu_problem(args.device)
        if problem:
            print(problem, file=sys.stderr)
            return 2
        data = gpu_run(args)
        print("\n" + gpu_tables(data))
        return C.print_end(data, _render_gpu, args.plot)
    data = cpu_run(args)
    if data["steps"]:
        print("\n" + cpu_table(data))
    if data["convert"]:
        print("\n" + convert_table(data))
    return C.print_end(data, render, args.plot)


if __name__ == "__main__":
    sys.exit(main())
