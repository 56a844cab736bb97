#!/usr/bin/env bash
# Regenerate the locks: the exact versions every fresh machine and CI install (requirements/README.md).
#
#   bash scripts/lock.sh             the project lock, requirements/project.lock.txt, from pyproject.toml
#                                    (extras dev, ray, mooncake), keeping today's pins where still allowed
#   bash scripts/lock.sh --upgrade   the same, every package at the newest version pyproject.toml allows
#   bash scripts/lock.sh --sglang    the SGLang venv's lock: builds SGLang's CPU venv afresh in a scratch
#                                    folder without the old lock and freezes it (~10 min, ~6 GB)
#   bash scripts/lock.sh --lmcache   the same for the LMCache venv (~5 min, ~2 GB)
#
# The project lock is for CPython 3.11 on x86-64 Linux (glibc >= 2.28), the Python CI runs;
# `uv pip compile` (uv is in the dev extra) resolves it. After relocking, run `bash scripts/test.sh`:
# scripts/setup.sh installs from the new lock, and the SGLang/LMCache stamps change with their locks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mode=${1:-}

compile() {  # $@: extra uv flags
  "$PY" -m uv --version >/dev/null 2>&1 || "$PY" -m pip install -q "uv>=0.5"
  "$PY" -m uv pip compile pyproject.toml --extra dev --extra ray --extra mooncake \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 --quiet \
    --custom-compile-command "bash scripts/lock.sh" "$@" -o requirements/project.lock.txt
  echo "lock: requirements/project.lock.txt ($(grep -c '==' requirements/project.lock.txt) pins)"
}

freeze_venv() {  # $1: install script, $2: its venv variable, $3: lock file
  local scratch
  scratch=$(mktemp -d)
  env "$2=$scratch/venv" SMETRIC_RELOCK=1 bash "$1"
  {
    echo "# The $(basename "$1") venv's lock: 'pip freeze' of a venv that script built without a lock."
    echo "# Regenerate: bash scripts/lock.sh ${mode}"
    "$scratch/venv/bin/python" -m pip freeze --all --exclude-editable | grep -vE '^(pip|setuptools|wheel)=='
  } >"$3"
  rm -rf "$scratch"
  echo "lock: $3 ($(grep -c '==' "$3") pins)"
}

case "$mode" in
  "") compile ;;
  --upgrade) compile --upgrade ;;
  --sglang) freeze_venv .ci/install-sglang.sh SGLANG_VENV requirements/sglang.lock.txt ;;
  --lmcache) freeze_venv .ci/install-lmcache.sh LMCACHE_VENV requirements/lmcache.lock.txt ;;
  -h | --help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' ;;
  *) echo "lock.sh: unknown option $mode (see --help)" >&2; exit 2 ;;
esac
