#!/usr/bin/env bash
# Set up (once) and run the main job: a sync-mode GRPO run of the tiny model on the toy task, on CPU.
# Extra arguments go to `miles train`, e.g. scripts/demo.sh --num-rollout 10
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
exec .venv/bin/miles train --config configs/toy.toml "$@"
