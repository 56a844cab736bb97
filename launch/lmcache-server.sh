#!/usr/bin/env bash
# launch/lmcache-server.sh: start, stop or show the lmcache_server role of a deployment on this node (launch/README.md).
# The commands come from the Python launcher (python -m stack.launch.role lmcache_server): the same
# processes `smetric up`, its --dry-run and the Kubernetes manifests have.
set -euo pipefail

usage() {
  cat <<'USAGE'
usage: launch/lmcache-server.sh [start|stop|status] --config FILE [--node NAME] [--dry-run]
                 [--format text|json] [--run-dir DIR] [--ready-timeout S] [--grace S]

  The LMCache server of this node (launch.kv_tier: lmcache): the daemon SGLang workers with
  --enable-lmcache dial (mp_host/mp_port), the Mooncake store behind it as its L2.
  start (default)  start them here, wait until ready, return; PID files and logs under
                   launch.run_dir (or --run-dir): pids/<name>.json, logs/<name>.log
  stop             stop exactly those processes (SIGTERM, SIGKILL after --grace seconds)
  status           running / ready, per process (exit 3 if one is not running)
  --dry-run        print the exact commands and environment; start nothing
  --node NAME      this node's name or host in launch.nodes (default: the node whose name or
                   host is this machine's; needed when the role spans nodes and none matches)
USAGE
}

case "${1:-}" in
  -h | --help) usage; exit 0 ;;
esac

root="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${root}${PYTHONPATH:+:${PYTHONPATH}}"
exec "${SMETRIC_PYTHON:-python3}" -m stack.launch.role lmcache_server "$@"
