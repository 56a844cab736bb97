#!/usr/bin/env bash
# Install the project and everything its tests need on a fresh Debian machine (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHON="$PY"
"$PY" -m pip install --quiet --disable-pip-version-check -e '.[dev]'
# system packages and real components (mooncake, redis, ...) when their scripts exist
for s in .ci/install-system.sh; do
  if [ -f "$s" ]; then bash "$s"; fi
done
