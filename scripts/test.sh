#!/usr/bin/env bash
# Set up (once) and run the test suite: unit and integration tiers (GPU tests skip without a GPU).
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not integration"
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 PREFECT_HOME="${PREFECT_HOME:-$PWD/.cache/prefect-test-home}"
mkdir -p "$PREFECT_HOME"
# pytest exits 5 when it collected no tests: that is a failure here, like any other non-zero code.
exec .venv/bin/python -m pytest "$@"
