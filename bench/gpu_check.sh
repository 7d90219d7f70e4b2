#!/usr/bin/env bash
# The GPU checks (issue 16): on a machine with NVIDIA GPUs, from the repository root, after
# `make install` (or with torch's CUDA build and `pip install -e '.[dev,examples]'`):
#
#   bash bench/gpu_check.sh            # digits (DDP) and the small GPT (DDP, FSDP), NCCL, bf16
#
# 1. what torch sees (CUDA, NCCL, bf16), 2. the GPU-slot end-to-end test, 3. step rates through Phalanx against plain torchrun (bench/bench_gpu.py). The JSON line
# goes to stdout and to $OUT/gpu_check.jsonl when OUT is set; paste its rows into bench/RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
nvidia-smi -L
"$PY" - <<'PYEOF'
import torch, torch.distributed as dist
assert torch.cuda.is_available(), "torch sees no CUDA device (a CPU build of torch?)"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s), "
      f"NCCL {dist.is_nccl_available()}, bf16 {torch.cuda.is_bf16_supported()}")
PYEOF
"$PY" -m pytest -q -p no:cacheprovider tests/e2e/test_gpu_slots.py
"$PY" bench/bench_gpu.py --repeat "${REPEAT:-3}" | tee "${OUT:-/tmp}/gpu_check.jsonl"
