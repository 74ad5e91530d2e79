#!/usr/bin/env bash
# The test command of the README: set up the environment, then run the whole suite (scripts/suite.py: three lanes
# side by side, then the serial tests alone, one closing line). With arguments, they go to a plain pytest run instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup-env.sh
export TORCH_EXTENSIONS_DIR="$PWD/.venv/torch_extensions"  # the comm op setup-env built
export OMP_NUM_THREADS=1
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
exec .venv/bin/python scripts/suite.py
