#!/usr/bin/env bash
# Build the client environment of the Tinker cookbook (once; cached like .venv): the official `tinker`
# SDK and `tinker-cookbook`, the versions docs/tinker.md names, to run the cookbook's recipes against
# `miles tinker-serve` unmodified (tests/integration/test_tinker_cookbook.py, bench/tinker.py).
#
#   scripts/setup-tinker-cookbook.sh      # -> .cache/tinker-cookbook-env/bin/python (printed last)
#
# It is an environment of its own because tinker-cookbook 0.5.8 pins transformers <= 5.5.4 (ours is
# newer), and 0.6.x needs tml-renderers >= 0.4.1, which the package registry does not have yet.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR=${MILES_TINKER_COOKBOOK_ENV:-.cache/tinker-cookbook-env}
PACKAGES="tinker==0.38.0 tinker-cookbook[math-rl]==0.5.8"
PY=${PYTHON:-python3}
stamp="$ENV_DIR/.installed-$(printf '%s' "$PACKAGES" | cat - "$0" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && "$ENV_DIR/bin/python" -c "import tinker_cookbook" 2>/dev/null; then
  echo "$ENV_DIR/bin/python"
  exit 0
fi
echo "building the tinker-cookbook environment in $ENV_DIR ($PACKAGES; a few minutes)" >&2
[ -x "$ENV_DIR/bin/python" ] || "$PY" -m venv "$ENV_DIR"
"$ENV_DIR/bin/python" -m pip install -q --upgrade pip
"$ENV_DIR/bin/python" -m pip install -q "torch==2.13.0"
printf 'torch==2.13.0\n' > "$ENV_DIR/constraints.txt"
# shellcheck disable=SC2086
"$ENV_DIR/bin/python" -m pip install -q -c "$ENV_DIR/constraints.txt" $PACKAGES
"$ENV_DIR/bin/python" -c "import tinker, tinker_cookbook, transformers; print('tinker', tinker.__version__, 'transformers', transformers.__version__)" >&2
rm -f "$ENV_DIR"/.installed-*
touch "$stamp"
echo "$ENV_DIR/bin/python"
