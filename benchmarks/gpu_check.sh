#!/usr/bin/env bash
# The one prepared GPU check: run it once on a machine with an NVIDIA GPU (e.g. a lent device
# machine, whose image has its own torch/triton: the lock file's pins do not apply there).
#   bash benchmarks/gpu_check.sh [OUT_DIR]        (default OUT_DIR: benchmarks/results)
# 1. the kernel's correctness tests, compiled on the GPU (the same files CI runs in the interpreter);
# 2. python -m pagedlib.bench gpu, which checks correctness again, then times the grid and writes
#    gpu-<device>-<date>.json/.md into OUT_DIR. Both logs land in OUT_DIR too. About 5-7 minutes.
# Without CUDA it refuses (exit status 2) before running anything.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check.sh needs python3 with torch and a CUDA GPU, and this machine has none; on a CPU, run" \
       "make test (the kernel runs through Triton's interpreter there)." >&2
  exit 2
fi
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.cuda.is_available())" | tee "$out/gpu-check-versions.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$out/gpu-check-versions.txt"
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py tests/test_attention.py \
  2>&1 | tee "$out/gpu-check-pytest.log"
timeout 420 python3 -m pagedlib.bench gpu --out-dir "$out" 2>&1 | tee "$out/gpu-check-bench.log"
