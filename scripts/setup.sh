#!/usr/bin/env bash
# Create .venv (once) and install the project with pinned dependencies.
# torch 2.13.0 (CPU build) goes first; constraints.txt then holds it so nothing pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
# deepspeed: install the Python package only, no CUDA/C++ op builds (the trainer compiles none)
export DS_BUILD_OPS=0
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-$(cat pyproject.toml scripts/constraints.txt | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[dev]"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
