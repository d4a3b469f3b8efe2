#!/usr/bin/env bash
# The kill-and-resume soak, longer than CI's: a run of each mode SIGKILLed 10 times (whole process
# session: trainer, producers, Prefect server) at random steps and resumed each time; after each
# kill and at the end `miles audit` must find no prompt lost or trained twice, every step is in
# metrics.jsonl once, and sync and async runs end with an uninterrupted run's weights, bit for bit. Set MILES_SOAK_KILLS (default 10) and MILES_SOAK_SEED to repeat a run;
# the seed and the steps of the kills are printed.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
export PREFECT_HOME="${PREFECT_HOME:-$PWD/.cache/prefect-test-home}" MILES_SOAK_KILLS="${MILES_SOAK_KILLS:-10}"
exec .venv/bin/python -m pytest -s -q tests/integration/test_soak.py "$@"
