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
