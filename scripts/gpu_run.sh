#!/usr/bin/env bash
# One command for a CUDA machine (one H200): the CUDA tests, kernel bandwidth, the speed benchmark, the QLoRA flow;
# 7-8 minutes.
#
#   bash scripts/gpu_run.sh            # logs and JSON into $OUT (default build/gpu_run/)
#   GPU_RUN_DRY=1 bash scripts/gpu_run.sh   # print the commands only (the tests check their arguments)
#
# Parts, each under its own `timeout`, none stopping the others when it fails or runs out of time:
#   1. cuda_tests   pytest tests/ops/test_cuda.py with compiled kernels: every Triton kernel vs the PyTorch path,
#      the public ops on CUDA (bytes, autocast sharing), CUDA graphs, torch.compile; test_cuda_host.py: the C++ host
#      path bitwise against the Python launch (its first use builds the extension, ~20 s); the kept-affine norm's
#      CUDA tests (no host sync under set_sync_debug_mode) (cap 170 s)
#   2. kernels      python -m benchmarks.kernels: per-kernel GB/s next to torch's kernels (cap 50 s)
#   3. bench_speed  python -m benchmarks.speed --gpu: ViT-B/16 LoRA r4 bs64 (eager, compile, reduce-overhead) and
#      the LLaMA-7B slice (eager, torch.compile, Liger-Kernel, converted, converted + compile); img/s, tokens/s,
#      peak memory, GPU busy fraction (cap 170 s; the last full run took 88 s)
#   4. bench_qlora  python -m benchmarks.qlora: lmbp-convert → 4-bit load → convert() → LoRA → steps vs plain
#      QLoRA, on a 0.84 B LLaMA-shaped model (TinyLlama's width, 16 layers) (cap 90 s)
# GPU_RUN_PARTS="bench_speed" (any of cuda_tests kernels bench_speed bench_qlora) reruns only those parts.
# Files in $OUT (8; the device tool returns at most 8): summary.txt (machine, packages, each part's exit),
# cuda_tests.log, kernels.log, kernels.md, bench_speed.log, bench_gpu.json, bench_qlora.log, bench_qlora.json.
#
# Packages the H200 image lacks (bitsandbytes for part 4, liger-kernel for part 3's Liger row) travel as wheels.
# Once, in the root of the checkout the device tool sends (about 45 MB; the tree may carry 64 MiB in all):
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
#       -d .whl bitsandbytes==0.50.2 liger-kernel==0.8.5
#
# (bitsandbytes 0.50.2 is tagged manylinux_2_24 and bundles libbitsandbytes_cuda130.so for torch 2.11+cu130;
# liger-kernel 0.8.5 is pure Python, needs torch and triton only.) Then run it with the device tool:
#   run(command="bash scripts/gpu_run.sh", carry=[".whl"], timeout_s=570)
# This script installs the wheels itself (pip --target /tmp/site, no index), when .whl/ holds any.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/build/gpu_run}"
export PYTHONUNBUFFERED=1 OUT
unset TRITON_INTERPRET
PY="${PYTHON:-python3}"
DRY="${GPU_RUN_DRY:-0}"
T0=$(date +%s)
if [ "$DRY" != "1" ]; then
    mkdir -p "$OUT"
    : > "$OUT/summary.txt"
fi

part() {  # part NAME CAP_S COMMAND...: run with a time cap, log to $OUT/NAME.log, never abort the rest
    local name=$1 cap=$2
    shift 2
    if [ "$DRY" = "1" ]; then
        echo "$name $cap $*"
        return 0
    fi
    echo "=== $name (cap ${cap}s, at $(( $(date +%s) - T0 ))s) ==="
    timeout -k 10 "$cap" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    local what="exit $rc"
    [ $rc -eq 124 ] && what="timed out after ${cap}s"
    echo "=== $name: $what ($(( $(date +%s) - T0 ))s elapsed) ===" | tee -a "$OUT/summary.txt"
}

if [ "$DRY" != "1" ]; then
    {
        date -u
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
        "$PY" -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.is_available())" 2>&1
    } >> "$OUT/summary.txt"
    if ls .whl/*.whl > /dev/null 2>&1; then
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target /tmp/site .whl/*.whl >> "$OUT/summary.txt" 2>&1; then
            export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
            echo "wheels installed: $(ls .whl | tr '\n' ' ')" | tee -a "$OUT/summary.txt"
        else
            echo "wheel install FAILED (see summary.txt): the Liger and 4-bit rows will name the missing package" \
                | tee -a "$OUT/summary.txt"
        fi
    else
        echo "no .whl/: bitsandbytes and liger-kernel only if the image has them" | tee -a "$OUT/summary.txt"
    fi
    "$PY" -c "import bitsandbytes, liger_kernel; print('bitsandbytes', bitsandbytes.__version__, 'liger_kernel ok')" \
        >> "$OUT/summary.txt" 2>&1
    cat "$OUT/summary.txt"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# The parts share 8 minutes of caps. bench_speed's own budget skips rows it could not finish (eager rows of both
# models run first).
PARTS="${GPU_RUN_PARTS:-cuda_tests kernels bench_speed bench_qlora}"  # e.g. GPU_RUN_PARTS=bench_speed to rerun one

for p in $PARTS; do
    case $p in
        cuda_tests)  # conftest.py turns Triton's interpreter on unless told otherwise
            part cuda_tests 170 env TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider --tb=short \
                tests/ops/test_cuda.py tests/ops/backends/test_cuda_host.py tests/nn/test_affine_norms.py \
                tests/ops/test_ms_norm_affine.py ;;
        kernels)
            part kernels 50 "$PY" -m benchmarks.kernels --dtypes bf16 --sizes 16M,64M --runs 10 --budget-s 40 ;;
        bench_speed)
            part bench_speed 170 "$PY" -m benchmarks.speed --gpu --modes bf16 \
                --sections vit_lora,llama_slice --no-checkpointing --repeats 10 --warmup 3 \
                --budget-s 158 --json "$OUT/bench_gpu.json" ;;
        bench_qlora)
            part bench_qlora 90 "$PY" -m benchmarks.qlora --layers 16 --seq 1024 --batch 4 --steps 8 \
                --warmup 2 --json "$OUT/bench_qlora.json" ;;
        *)
            echo "unknown part $p (cuda_tests, kernels, bench_speed, bench_qlora)" ;;
    esac
done

if [ "$DRY" != "1" ]; then
    echo "total $(( $(date +%s) - T0 ))s" | tee -a "$OUT/summary.txt"
    ls -la "$OUT"
fi
exit 0
