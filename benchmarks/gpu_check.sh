#!/usr/bin/env bash
# The GPU check, one script, <= 8 minutes on one GPU:
#   1. the tests marked `gpu` (tests/test_gpu.py and any other): nccl process group, bf16 autocast
#      training steps, SDPA taking the flash/memory-efficient kernels, NVML figures in xirang-status,
#      Hugging Face import/export on the GPU where present; the device decision (runtime/device.py), serving
#      on the GPU (greedy tokens equal the CPU's), a 2-rank FSDP2 job on >= 2 GPUs (skipped, saying so, on one),
#      train.precision=fp8 (torchao float8, rowwise) against bf16 on a GPU of compute capability >= 8.9
#      (skipped, naming the capability, on an older one);
#   2. tokens/s and MFU of a ~1.1B Llama-family model for 30 steps, xirang's trainer vs a plain
#      PyTorch loop of the same model on the same GPU, printed as a ratio (benchmarks/bench_gpu_train.py).
# Without a GPU it says why and exits 0.
#
# The GPU machine has no network: packages it lacks travel as wheels in .whl/ (made here by
# benchmarks/gpu_wheels.sh, ignored by git) and are installed into a private target directory.
# Figures and logs go to $OUT (default /tmp/gpu-check).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  echo "gpu_check: skipped: no CUDA device visible to $PY (no torch, or torch.cuda.is_available() is False)"
  exit 0
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/xirang-site \
    .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/xirang-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$OUT/gpu.txt"
status=0
echo "== tests marked gpu"
timeout 270 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" || status=1
echo "== training throughput: xirang vs plain PyTorch (~1.1B Llama-family, 30 steps)"
timeout 240 "$PY" benchmarks/bench_gpu_train.py --steps 30 --json "$OUT/bench_gpu_train.json" 2>&1 \
  | tee "$OUT/bench_gpu_train.log" || status=1
exit $status
