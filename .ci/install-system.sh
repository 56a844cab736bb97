#!/usr/bin/env bash
# System pieces the real components need on a fresh Debian machine (idempotent).
#
#   bash .ci/install-system.sh
#
# - libibverbs1: Mooncake's transfer engine links it even when only TCP is used.
# - mooncake-transfer-engine-non-cuda (PyPI, the version of requirements/project.lock.txt): mooncake_master, the store client and the
#   TransferEngine for CPU-only machines (the CUDA wheel does not import without libcuda).
# - redis-server: router replicas share dispatch accounting and the worker registry through
#   Redis (router.redis_url); the replica tests start their own redis-server on a free port.
# - prometheus (Debian's 2.42): `smetric up --prometheus` starts it beside a local stack, and
#   tests/e2e/test_dashboard.py holds every panel of deploy/grafana/stack-dashboard.json to data
#   from a real one (started on a free port; the package's own service is not used).
# - haproxy (Debian's 2.6): a real proxy with a short idle timeout in front of the router, for
#   tests/integration/test_stream_keepalive.py (started on a free port; its service is not used).
#
# Uses the current `python` (the project's environment). A second run returns quickly.
set -euo pipefail

PY="${PYTHON:-python}"
SUDO=""
if [[ "$(id -u)" != "0" ]] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi

need_apt=()
dpkg -s libibverbs1 >/dev/null 2>&1 || need_apt+=(libibverbs1)
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)
command -v haproxy >/dev/null 2>&1 || need_apt+=(haproxy)
if (( ${#need_apt[@]} )); then
  echo "install-system: apt-get install ${need_apt[*]}"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

if ! "$PY" -c "import mooncake.store, mooncake.engine" >/dev/null 2>&1 || ! command -v mooncake_master >/dev/null 2>&1; then
  # the version of the project's lock (scripts/setup.sh installs it with the rest of the lock)
  pin=$(grep -E '^mooncake-transfer-engine-non-cuda==' "$(dirname "$0")/../requirements/project.lock.txt")
  echo "install-system: pip install $pin"
  "$PY" -m pip install -q "$pin"
fi

# mooncake_master lands next to the interpreter's scripts; make sure it resolves.
if ! command -v mooncake_master >/dev/null 2>&1; then
  echo "install-system: mooncake_master not on PATH; add $("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')" >&2
  exit 1
fi
"$PY" -c "import mooncake.store, mooncake.engine" 
echo "install-system: ok (libibverbs1, redis-server $(command -v redis-server), prometheus $(command -v prometheus), haproxy $(command -v haproxy), mooncake $("$PY" -m pip show mooncake-transfer-engine-non-cuda 2>/dev/null | awk '/^Version/{print $2}'), mooncake_master $(command -v mooncake_master))"
