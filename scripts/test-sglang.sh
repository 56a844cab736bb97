#!/usr/bin/env bash
# The real-SGLang CPU tier: real SGLang 0.5.23 prefill/decode workers (tiny local model, no hub)
# over mooncake_tcp with KV events, our router and sglang-router in front, HiCache -> Mooncake.
# ~5 min on 2 cores. Not in .ci/run yet: with four CPU workers on a 2-core machine it has
# been sensitive to CPU contention (history and fixes: docs/deploy.md, "The CPU tier").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
exec "$PY" -m pytest -m sglang --timeout=900 "$@"
