#!/usr/bin/env bash
# Install real LMCache (its CPU-usable parts) into its own virtualenv.
#
# Why a separate venv: lmcache 0.5.6 pins numpy<=2.2.6, protobuf<7, setuptools<81,
# opentelemetry<=1.40 and more, which clash with both the project's environment and SGLang's.
# The tests reach it through $SMETRIC_LMCACHE_PYTHON (default: $LMCACHE_VENV/bin/python).
#
#   bash .ci/install-lmcache.sh
#
# What goes in: CPU torch 2.13.0 (on this machine's disk; lmcache's cuda_ops extension needs
# CUDA torch and is never imported on the CPU paths used here), then lmcache 0.5.6 with its
# declared requirements (they include CUDA Python packages, which install without a GPU).
# Idempotent: a stamp file records what was installed; a second run returns at once.
# Set LMCACHE_VENV to choose where (default /opt/lmcache-venv).
set -euo pipefail

LMCACHE_VERSION="${LMCACHE_VERSION:-0.5.6}"
LMCACHE_VENV="${LMCACHE_VENV:-/opt/lmcache-venv}"
TORCH=("torch==2.13.0")
# the Mooncake store client LMCache's mooncakestore:// remote backend imports (mooncake.store);
# the non-CUDA wheel, as the project's own environment and SGLang's use
EXTRA=("mooncake-transfer-engine-non-cuda>=0.3.13")
# requirements/lmcache.lock.txt pins every package of the venv (scripts/lock.sh --lmcache makes it);
# the install is constrained by it, and the stamp carries its hash, so a new lock reinstalls.
# SMETRIC_RELOCK=1 (scripts/lock.sh): build without the lock, to freeze a new one.
LOCK="$(cd "$(dirname "$0")/.." && pwd)/requirements/lmcache.lock.txt"
LOCKED=()
if [[ "${SMETRIC_RELOCK:-0}" != "1" ]]; then LOCKED=(-c "$LOCK"); fi
STAMP="$LMCACHE_VENV/.smetric-lmcache-stamp"
WANT="lmcache==$LMCACHE_VERSION ${TORCH[*]} ${EXTRA[*]} lock=$(if [[ ${#LOCKED[@]} -gt 0 ]]; then sha256sum "$LOCK" | cut -c1-16; else echo none; fi)"
if [[ -f "$STAMP" ]] && [[ "$(cat "$STAMP")" == "$WANT" ]]; then
  echo "install-lmcache: $LMCACHE_VENV already has $WANT (nothing to do)"
  exit 0
fi

start=$(date +%s)
if [[ ! -x "$LMCACHE_VENV/bin/python" ]]; then
  python3 -m venv "$LMCACHE_VENV"
fi
PIP=("$LMCACHE_VENV/bin/python" -m pip install -q --disable-pip-version-check --progress-bar off)
NOISE='^WARNING: Location|dependency conflicts|requires .*, which is not installed|but you have|^ERROR: pip.s dependency resolver'
pipq() {  # pip install, minus the noise; keeps pip's exit status
  local rc=0
  "${PIP[@]}" "$@" >"$LMCACHE_VENV/.pip.log" 2>&1 || rc=$?
  grep -vE "$NOISE" "$LMCACHE_VENV/.pip.log" || true
  return $rc
}
# torch first, alone (CPU build), then lmcache constrained to keep it
pipq "${LOCKED[@]}" "${TORCH[@]}"
CONS=$(mktemp)
echo "${TORCH[0]}" >"$CONS"
pipq -c "$CONS" "${LOCKED[@]}" "lmcache==$LMCACHE_VERSION" "${EXTRA[@]}"
rm -f "$CONS"
if [[ ${#LOCKED[@]} -gt 0 ]]; then  # the venv is the lock, nothing more or less
  extra=$("$LMCACHE_VENV/bin/python" "$(dirname "$0")/../scripts/check_lock.py" "$LOCK" --list-extra)
  if [[ -n "$extra" ]]; then pipq_uninstall=("$LMCACHE_VENV/bin/python" -m pip uninstall -q -y); "${pipq_uninstall[@]}" $extra; fi
  "$LMCACHE_VENV/bin/python" "$(dirname "$0")/../scripts/check_lock.py" "$LOCK" --exact
fi
"$LMCACHE_VENV/bin/python" -c "import lmcache, torch; import mooncake.store; from lmcache.v1.token_database import ChunkedTokenDatabase; print('install-lmcache: lmcache', __import__('importlib.metadata').metadata.version('lmcache'), 'torch', torch.__version__, 'ok')"
echo "$WANT" >"$STAMP"
echo "install-lmcache: install into $LMCACHE_VENV took $(( $(date +%s) - start )) s"
