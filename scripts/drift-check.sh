#!/usr/bin/env bash
# Meet new versions on purpose: install the newest versions pyproject.toml allows into a fresh
# virtualenv, WITHOUT the lock, and run the main suite there (requirements/README.md).
#
#   bash scripts/drift-check.sh            fresh venv, `pip install -e '.[dev,ray,mooncake]'` unlocked,
#                                          print what differs from the lock, run `pytest -m "not sglang"`
#   bash scripts/drift-check.sh --write    ... and when the suite passes, rewrite the lock with the
#                                          newest allowed versions (bash scripts/lock.sh --upgrade)
#   extra arguments after --               go to pytest (e.g. -- tests/unit/test_sim.py -x)
#
# The real-SGLang and LMCache venvs keep their own locks (scripts/lock.sh --sglang / --lmcache).
# Exit status: the suite's. The venv is left in $SMETRIC_DRIFT_VENV (default ~/.cache/smetric/drift-venv).
set -uo pipefail
cd "$(dirname "$0")/.."
write=0
if [ "${1:-}" = "--write" ]; then write=1; shift; fi
if [ "${1:-}" = "--" ]; then shift; fi
VENV=${SMETRIC_DRIFT_VENV:-$HOME/.cache/smetric/drift-venv}
t0=$(date +%s)
rm -rf "$VENV" && "${PYTHON:-python3}" -m venv "$VENV" || exit $?
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e '.[dev,ray,mooncake]' \
  2> >(grep -v "^WARNING: Location" >&2) || exit $?
echo "drift-check: newest allowed versions installed in $VENV in $(($(date +%s) - t0)) s; against the lock:"
"$VENV/bin/python" scripts/check_lock.py requirements/project.lock.txt | sed 's/^check_lock: /  /'
PATH="$VENV/bin:$PATH" PYTHON="$VENV/bin/python" bash .ci/install-system.sh >/dev/null || exit $?
PATH="$VENV/bin:$PATH" "$VENV/bin/python" -m pytest -m "not sglang" -p no:cacheprovider -q "$@"
rc=$?
echo "drift-check: main suite on the newest allowed versions: exit $rc"
if [ "$rc" = 0 ] && [ "$write" = 1 ]; then PYTHON="$VENV/bin/python" bash scripts/lock.sh --upgrade; fi
exit $rc
