#!/usr/bin/env bash
# Create .venv and install lightning_fleet into it (idempotent; reinstalls only when the
# dependency files change). torch is installed first and alone, pinned by
# requirements/constraints.txt, so pip takes the CPU wheel and never pulls a CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.fleet-installed
want=$(cat requirements/constraints.txt setup.cfg pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  pip_install() { .venv/bin/python -m pip install --quiet --disable-pip-version-check -c requirements/constraints.txt "$@"; }
  pip_install torch
  pip_install -e ".[test,plot]"
  echo "$want" > "$stamp"
fi
# DeepSpeed JIT-compiles a shared-memory comm op at its first init on CPU. Build it once here, in
# one process and inside the venv, so that jobs and tests never race for (or die holding) its
# build lock: a build killed mid-way would leave a lock that makes every later job wait forever.
export TORCH_EXTENSIONS_DIR="$PWD/.venv/torch_extensions"
if [ ! -f "$TORCH_EXTENSIONS_DIR/.fleet-built" ]; then
  rm -f "$TORCH_EXTENSIONS_DIR"/*/deepspeed_shm_comm/lock
  timeout 900 .venv/bin/python -c "from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder('ShareMemCommBuilder').load()" >/dev/null
  touch "$TORCH_EXTENSIONS_DIR/.fleet-built"
fi
