#!/usr/bin/env bash
# The main job of the README: set up the environment, then train the example GPT on the Python
# standard library's source under torchrun (2 CPU processes, gloo), with strategy "fleet" choosing
# and printing the plan. Extra arguments go to the LightningCLI (e.g. --trainer.max_steps 200).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup-env.sh
export TORCH_EXTENSIONS_DIR="$PWD/.venv/torch_extensions"  # the comm op setup-env built
port=$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export OMP_NUM_THREADS=1
exec timeout 1800 .venv/bin/torchrun --nproc-per-node=2 --master-addr=127.0.0.1 --master-port="$port" \
  examples/gpt/train.py fit --config examples/gpt/config.yaml "$@"
