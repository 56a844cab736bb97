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
STAMP="$LMCACHE_VENV/.smetric-lmcache-stamp"
WANT="lmcache==$LMCACHE_VERSION ${TORCH[*]} ${EXTRA[*]}"
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
pipq "${TORCH[@]}"
CONS=$(mktemp)
echo "${TORCH[0]}" >"$CONS"
pipq -c "$CONS" "lmcache==$LMCACHE_VERSION" "${EXTRA[@]}"
rm -f "$CONS"
"$LMCACHE_VENV/bin/python" -c "import lmcache, torch; import mooncake.store; from lmcache.v1.token_database import ChunkedTokenDatabase; print('install-lmcache: lmcache', __import__('importlib.metadata').metadata.version('lmcache'), 'torch', torch.__version__, 'ok')"
echo "$WANT" >"$STAMP"
echo "install-lmcache: install into $LMCACHE_VENV took $(( $(date +%s) - start )) s"
