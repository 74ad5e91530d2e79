#!/usr/bin/env bash
# The main job of the README: set up the environment, then plan GPT-3 175B on 128 DGX A100 nodes
# (1024 GPUs) and explain the choice. Extra arguments go to `fleet plan`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup-env.sh
mkdir -p out
exec .venv/bin/fleet plan --model gpt3-175b --cluster dgx-a100-80gb-x128 --top 5 --plot out/plan-gpt3-175b.png "$@"
