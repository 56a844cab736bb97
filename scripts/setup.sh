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
# The project's dependencies at the versions of requirements/project.lock.txt (extras dev: the test
# tools, ray: `smetric bench --executor ray`, mooncake: the store, transfer engine and master), then
# the project itself without dependencies. The lock is for CPython 3.11 on x86-64 Linux; on another
# Python the unlocked bounds of pyproject.toml are installed instead, with a warning.
PIPI=("$PY" -m pip install --quiet --disable-pip-version-check)
if [ "$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" = "3.11" ]; then
  "${PIPI[@]}" -r requirements/project.lock.txt 2> >(grep -v "^WARNING: Location" >&2)
  "${PIPI[@]}" --no-deps -e .
else
  echo "setup: $("$PY" -V) is not the locked Python (3.11): installing the newest versions pyproject.toml allows" >&2
  "${PIPI[@]}" -e '.[dev,ray,mooncake]'
fi
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
