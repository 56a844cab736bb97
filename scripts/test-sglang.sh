#!/usr/bin/env bash
# The real-SGLang CPU tier alone (scripts/test.sh, and so .ci/run, runs it after the main suite):
# real SGLang 0.5.23 workers (tiny local model, no hub), one group at a time: a plain reference
# worker alone; then 2 prefill + 1 decode over mooncake_tcp with KV events behind our router,
# sglang-router 0.3.2 and smg 1.13 in front of the same pair, and a prefill worker SIGKILLed
# mid-request; then a HiCache -> Mooncake pair. 4.5-5.5 min on 2 cores at load average 6-10
# (docs/deploy/cpu-tier.md). Under CI=true a missing SGLang environment fails it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
exec "$PY" -m pytest -m sglang --timeout=900 -rA --durations=0 --durations-min=1 "$@"
