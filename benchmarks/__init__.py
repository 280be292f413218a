"""Benchmarks of lmbp-convert: what the conversion costs in time and saves in bytes. A package run from the
checkout root (``python -m benchmarks.<name>``); not shipped in the wheel.

    all         regenerate docs/benchmarks.md and its charts (runs memory, host, speed; renders GPU JSON)
    memory      exact saved-for-backward bytes per block, LLaMA / ViT / BERT, and how they scale
    speed       CPU step time, convert() time vs model size; ``--gpu``: ViT LoRA, LLaMA slice, Liger (CUDA)
                (speed_gpu: the GPU mode; speed_report: its tables and charts)
    host        host time of the ops' CUDA path, measured on a CPU with Triton launches stubbed (testsupport/triton_stub.py)
    ops         each op's forward + backward time and saved bytes next to the torch op it replaces
    kernels     per-kernel GB/s on a CUDA GPU, next to torch's kernels
    qlora       the QLoRA flow: fold on disk, 4-bit load, convert(), LoRA, steps; vs plain QLoRA (CUDA)
    checkpoint  the checkpoint CLI's streaming fold vs a plain copy: throughput and peak RSS
    gated_recompute  the gated MLP's down projection fused vs called unchanged with h recomputed: bytes, CPU time
    gated_identity   gated MLPs behind Dropout / Identity / casts / an inner norm (T5, UMT5, ModernBERT, EVA02): bytes
    coverage    every family of the matrix, plain convert(model) in fp32 / bf16 / autocast: saved bytes, or why not
                (docs/coverage.md; floors and causes tested from coverage_expected)
    (testsupport/families.py: the tiny random-init model of every family, shared with the tests)
    moe         MoE blocks at real sizes (Mixtral, Qwen3-MoE; experts as 3-D parameters): bytes, bf16 and autocast
    common      what they share: model families, machine line, interleaved timing, byte ledger, tables

A new standalone benchmark is one module here with ``parse_args`` / ``main`` and its smoke test in
benchmarks/tests/ (e.g. ``gated_recompute`` and benchmarks/tests/test_gated_recompute.py).
GPU correctness is tested, not benchmarked: tests/ops/test_cuda.py. scripts/gpu_run.sh runs the CUDA parts.
"""
