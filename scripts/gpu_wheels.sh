#!/usr/bin/env bash
# Wheels that scripts/gpu_real_model.py needs on a GPU machine that has torch, transformers and peft but
# none of this project's other dependencies and no network: pydantic (the run config) and its own
# dependencies, and math-verify with sympy (the math reward), for that machine's Python (default 3.12)
# on x86-64 Linux. ~10 MB, into .cache/gpu-wheels;
# carry that folder (and, for the real tokenizer, .cache/gpu-tokenizer) with the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${GPU_PYTHON_VERSION:-3.12}
rm -rf .cache/gpu-wheels && mkdir -p .cache/gpu-wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .cache/gpu-wheels \
  "pydantic==$(.venv/bin/python -c 'import pydantic; print(pydantic.VERSION)')" \
  "pydantic-core==$(.venv/bin/python -c 'import pydantic_core; print(pydantic_core.__version__)')" \
  annotated-types typing-inspection typing-extensions
# the math reward: math-verify and what it parses with (sympy ~6 MB), pure Python
for dist in math-verify latex2sympy2_extended sympy mpmath antlr4-python3-runtime; do
  version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$dist'))")
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --platform manylinux_2_17_x86_64 --platform any -d .cache/gpu-wheels "$dist==$version"
done
# SmolLM2's tokenizer (3.5 MB) when the model is imported here: the GPU run then tokenizes as the model does
model=$(ls -d .cache/miles/models/smollm2-135m-instruct-*/ 2>/dev/null | tail -n 1 || true)
if [ -n "$model" ]; then
  mkdir -p .cache/gpu-tokenizer && cp "$model"/tokenizer* "$model"/chat_template.jinja .cache/gpu-tokenizer/ 2>/dev/null || true
fi
du -sh .cache/gpu-wheels .cache/gpu-tokenizer 2>/dev/null || true
