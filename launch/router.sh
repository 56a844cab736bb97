#!/usr/bin/env bash
# launch/router.sh: start, stop or show the router role of a deployment on this node (launch/README.md).
# The commands come from the Python launcher (python -m stack.launch.role router): the same
# processes `smetric up`, its --dry-run and the Kubernetes manifests have.
# Usage and options: launch/<this script> --help.
set -euo pipefail

root="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${root}${PYTHONPATH:+:${PYTHONPATH}}"
exec "${SMETRIC_PYTHON:-python3}" -m stack.launch.role router "$@"
