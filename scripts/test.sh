#!/usr/bin/env bash
# Set up (once) and run the test suite: unit and integration tiers (GPU tests skip without a GPU).
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not integration"
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# vLLM's own environment (its server runs there; tests/integration/test_engine_vllm.py): built once
scripts/setup-vllm.sh >/dev/null
# the tinker-cookbook's own environment (its recipes run against `miles tinker-serve`;
# tests/integration/test_tinker_cookbook.py): built once
scripts/setup-tinker-cookbook.sh >/dev/null
# SGLang's package alone (no dependencies, not importable here): tests/unit/test_sglang_types.py reads
# its request types' source; the version is SGLANG_VERSION in miles_core/engines/sglang.py
SGLANG_VERSION=$(sed -n 's/^SGLANG_VERSION = "\(.*\)"/\1/p' miles_core/engines/sglang.py)
if [ ! -d ".cache/sglang-types/sglang-$SGLANG_VERSION.dist-info" ]; then
  rm -rf .cache/sglang-types
  .venv/bin/python -m pip install -q --no-deps --target .cache/sglang-types "sglang==$SGLANG_VERSION"
fi
# the UI test drives Debian's Chromium (headless); install it when missing and we may
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }) \
    || echo "warning: could not install chromium: the UI test will be skipped (or fail under CI)" >&2
fi
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 PREFECT_HOME="${PREFECT_HOME:-$PWD/.cache/prefect-test-home}"
mkdir -p "$PREFECT_HOME"
# pytest exits 5 when it collected no tests: that is a failure here, like any other non-zero code.
# Two processes by default (pytest-xdist), each taking whole test files: the integration tests mostly
# wait on the servers and processes they start. MILES_TEST_WORKERS=0 runs them in this one.
exec .venv/bin/python -m pytest -n "${MILES_TEST_WORKERS:-2}" --dist loadfile --durations=40 "$@"
