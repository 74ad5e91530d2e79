#!/usr/bin/env bash
# On a machine with one CUDA GPU (not part of CI): calibrate it (nccl), run the example GPT through FleetStrategy
# for every 4th executable plan at one process, and report predicted vs measured step time and peak memory
# (torch.cuda.max_memory_allocated) in benchmarks/RESULTS_GPU.md (+ .png). Needs a CUDA build of torch in the
# environment of $PYTHON (default: .venv/bin/python, else python3); ~5 min on one GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
"$PYTHON" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch.cuda.is_available() is False here: run this on a machine with a CUDA GPU and a CUDA build of torch")
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
PY
exec "$PYTHON" benchmarks/cost_model.py --device cuda --worlds 1 --every "${EVERY:-4}" --out benchmarks/RESULTS_GPU.md
