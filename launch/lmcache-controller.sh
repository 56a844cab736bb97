#!/usr/bin/env bash
# launch/lmcache-controller.sh: start, stop or show the lmcache_controller role of a deployment on this node (launch/README.md).
# The commands come from the Python launcher (python -m stack.launch.role lmcache_controller): the same
# processes `smetric up`, its --dry-run and the Kubernetes manifests have.
# Usage and options: launch/<this script> --help.
set -euo pipefail

root="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${root}${PYTHONPATH:+:${PYTHONPATH}}"
exec "${SMETRIC_PYTHON:-python3}" -m stack.launch.role lmcache_controller "$@"
