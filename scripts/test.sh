#!/usr/bin/env bash
# The project's test command: set up, then run the whole test suite.
# The real-SGLang CPU tier (pytest -m sglang, ~5 min) runs after everything else.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
"$PY" -m pytest -m "not sglang" "$@"
"$PY" -m pytest -m sglang "$@"
