"""`benchmarks.speed --gpu`: ViT-B/16 LoRA, the LLaMA-7B slice, ViT / BERT blocks and kernel bandwidth on CUDA.

What each section measures: `benchmarks.speed`'s module doc. Every row is guarded (a failure is recorded with its
error); the JSON is rewritten after every row.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from typing import Callable, Optional

import torch
from torch import nn

from benchmarks import common as C
from benchmarks.speed_report import V_CKPT, V_COMPILE, V_CONV, V_CONV_COMPILE, V_LIGER, V_ORIG

NO_CUDA = ("benchmarks.speed --gpu: no CUDA device available (torch.cuda.is_available() is False); run it on a CUDA "
           "machine, or drop --gpu for the CPU benchmark.")


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
           "--budget-s", str(int(left - 15)), "--out", out_md]
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
            "budget_s": args.budget_s, "date": time.strftime("%Y-%m-%d", time.gmtime())}
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
