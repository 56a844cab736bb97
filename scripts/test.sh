#!/usr/bin/env bash
# The project's test command: set up, then run the test suite (everything but the real-SGLang
# CPU tier, whose SGLang argument checks still run here against SGLang's own parser).
# The CPU tier with real SGLang workers: bash scripts/test-sglang.sh (see docs/deploy.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
exec "$PY" -m pytest -m "not sglang" "$@"
