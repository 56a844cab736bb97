#!/usr/bin/env bash
# Install the project and everything its tests need on a fresh Debian machine (idempotent).
#   --main                 only what the main job needs (skips the real-SGLang and LMCache venvs)
#   SMETRIC_SKIP_SGLANG=1  skip the real-SGLang venv (~6 GB; its tests then skip)
#   SMETRIC_SKIP_LMCACHE=1 skip the LMCache venv (~2 GB; its tests then skip, fail under CI=true)
set -euo pipefail
if [ "${1:-}" = "--main" ]; then SMETRIC_SKIP_SGLANG=1 SMETRIC_SKIP_LMCACHE=1; fi
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHON="$PY"
# dev: the test tools; ray: `smetric bench --executor ray` and its tests (tests/test_bench_ray.py)
"$PY" -m pip install --quiet --disable-pip-version-check -e '.[dev,ray]'
# Debian packages and real components: libibverbs1, redis-server, mooncake (master, store, transfer engine)
bash .ci/install-system.sh
# real SGLang 0.5.23 for CPU, in its own venv (/opt/sglang-venv): argument checks and the CPU tier
if [ "${SMETRIC_SKIP_SGLANG:-0}" != "1" ]; then
  bash .ci/install-sglang.sh
fi
# real LMCache 0.5.6 (its CPU parts), in its own venv (/opt/lmcache-venv): the LMCache tier's tests
if [ "${SMETRIC_SKIP_LMCACHE:-0}" != "1" ]; then
  bash .ci/install-lmcache.sh
fi
