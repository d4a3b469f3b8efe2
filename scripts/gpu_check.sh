#!/usr/bin/env bash
# First SmolLM2-135M-Instruct's arithmetic config in bf16 on the GPU (scripts/gpu_real_model.py: tokens/s,
# the train step's MFU, peak GPU memory). Then the real engines, in under 8 minutes. For SGLang and for vLLM (each
# when installed): the engine contract against a real server, generation tokens/s at 64 concurrent
# requests and the weight-push pause in ms, then a 20-step fully-async toy run with that engine.
# Skips, saying why, where there is no CUDA device or no engine.
#
#   scripts/gpu_check.sh [MODEL_DIR]     # the model to measure (default: the built-in tiny model)
#
# Needs: an NVIDIA GPU (nvidia-smi); this project's .venv (scripts/setup.sh: the trainer runs on CPU);
# sglang and/or vllm installed in a Python named by MILES_SGLANG_PYTHON / MILES_VLLM_PYTHON (default:
# python3, when it imports them), e.g. `python3 -m venv /opt/sgl && /opt/sgl/bin/pip install sglang`.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: skipped: no CUDA device (nvidia-smi -L found none)"
  exit 0
fi
# SmolLM2-135M-Instruct's config in bf16 (transformers engine, torch trainer), with the machine's own torch and
# transformers: no setup, no network (pydantic from .cache/gpu-wheels: scripts/gpu_wheels.sh)
real=0
timeout 300 "${MILES_GPU_PYTHON:-python3}" scripts/gpu_real_model.py --device cuda || real=$?
if ! scripts/setup.sh; then
  echo "gpu_check: the engine checks need this project's .venv, and scripts/setup.sh failed (no network?)"
  exit $(( real ? real : 1 ))
fi
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
export PREFECT_HOME="${PREFECT_HOME:-$PWD/.cache/prefect-test-home}"
timeout 470 .venv/bin/python scripts/gpu_check.py "$@" || exit $?
exit $real
