#!/usr/bin/env bash
# The project's test command, and what .ci/run runs: set up, run the main suite (everything but
# the real-SGLang CPU tier; SGLang's argument checks run here against SGLang's own parser), then
# the real-SGLang CPU tier (`pytest -m sglang`: real SGLang workers over mooncake_tcp behind our
# router, sglang-router and smg; see docs/deploy/cpu-tier.md), with one line per check and its wall time.
# Both runs count: the exit status is non-zero if either fails, and the last line adds up both
# runs' closing lines. Under CI=true a tier that cannot run (no SGLang environment) fails.
#   SMETRIC_SGLANG_TIER=0   skip the tier (a developer's quick run; refused under CI=true)
# The environment tested is the lock's (requirements/README.md): under CI=true a fresh virtualenv is
# made each run (SMETRIC_TEST_VENV, default ~/.cache/smetric/test-venv) and filled from the lock, and
# the run fails unless that venv holds exactly the lock; elsewhere the current Python is set up from
# the lock and must hold every pin at its version.
#   SMETRIC_FRESH_VENV=1    a fresh venv outside CI too (what CI tests, ~1 min with a warm pip cache)
set -uo pipefail
cd "$(dirname "$0")/.."
in_ci() { case "${CI:-}" in true | TRUE | True | 1 | yes) return 0 ;; *) return 1 ;; esac; }
EXACT=()
if in_ci || [ "${SMETRIC_FRESH_VENV:-0}" = "1" ]; then
  VENV=${SMETRIC_TEST_VENV:-$HOME/.cache/smetric/test-venv}
  tv=$(date +%s)
  rm -rf "$VENV" && "${PYTHON:-python3}" -m venv "$VENV" || exit $?
  export PYTHON="$VENV/bin/python" PATH="$VENV/bin:$PATH" VIRTUAL_ENV="$VENV"
  EXACT=(--exact)
fi
bash scripts/setup.sh || exit $?
PY=${PYTHON:-python3}
"$PY" scripts/check_lock.py requirements/project.lock.txt "${EXACT[@]}" || exit $?
if [ -n "${tv:-}" ]; then echo "test.sh: fresh venv $VENV set up from the lock in $(($(date +%s) - tv)) s"; fi
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT

t0=$(date +%s)
"$PY" -m pytest -m "not sglang" "$@" 2>&1 | tee "$LOGS/main.log"
main_rc=${PIPESTATUS[0]}
main_s=$(($(date +%s) - t0))

tier_rc=0
tier_s=0
if [ "${SMETRIC_SGLANG_TIER:-1}" = "0" ] && ! in_ci; then
  echo "test.sh: real-SGLang CPU tier skipped (SMETRIC_SGLANG_TIER=0)"
  : >"$LOGS/tier.log"
else
  echo
  echo "test.sh: real-SGLang CPU tier (pytest -m sglang), one real-worker group at a time"
  t1=$(date +%s)
  "$PY" -m pytest -m sglang -rA --durations=0 --durations-min=1 "$@" 2>&1 | tee "$LOGS/tier.log"
  tier_rc=${PIPESTATUS[0]}
  tier_s=$(($(date +%s) - t1))
  # 5: no test selected (the caller named test files without tier checks in them); a failure in CI
  if [ "$tier_rc" = 5 ] && ! in_ci; then tier_rc=0; fi
fi

"$PY" - "$LOGS/main.log" "$main_rc" "$main_s" "$LOGS/tier.log" "$tier_rc" "$tier_s" <<'EOF'
import re
import sys

CLOSING = re.compile(r"^=+ (.*) in [0-9.]+s(?: \(.*\))? =+$")
ORDER = ["failed", "passed", "skipped", "xfailed", "xpassed", "warnings", "errors"]


def closing(path):
    lines = [ln.strip() for ln in open(path, errors="replace")]
    hits = [m.group(1) for m in map(CLOSING.match, lines) if m]
    return hits[-1] if hits else None


total = {}
parts = []
for path, rc, secs, name in ((sys.argv[1], sys.argv[2], sys.argv[3], "main suite"),
                             (sys.argv[4], sys.argv[5], sys.argv[6], "real-SGLang tier")):
    rc, secs = int(rc), int(secs)
    line = closing(path)
    counts = {}
    for n, word in re.findall(r"(\d+) (\w+)", line or ""):
        word = {"error": "errors", "warning": "warnings"}.get(word, word)
        if word != "deselected":
            counts[word] = counts.get(word, 0) + int(n)
    if rc not in (0, 5) and not (counts.get("failed") or counts.get("errors")):
        counts["errors"] = counts.get("errors", 0) + 1  # crashed or interrupted: count it
    if line is None and rc in (0, 5):
        line = "no tests ran" if secs else "not run (SMETRIC_SGLANG_TIER=0)"
    for k, v in counts.items():
        total[k] = total.get(k, 0) + v
    parts.append(f"{name}: exit {rc}, {line or 'no closing line'}, wall {secs // 60}m{secs % 60:02d}s")
print()
for p in parts:
    print("test.sh: " + p)
words = [
    f"{total[k]} {k[:-1] if total[k] == 1 and k in ('errors', 'warnings') else k}" for k in ORDER if total.get(k)
] or ["no tests ran"]
secs = int(sys.argv[3]) + int(sys.argv[6])
print(f"{'=' * 20} {', '.join(words)} in {secs}.00s (main suite + real-SGLang tier) {'=' * 20}")
EOF

if [ "$main_rc" != 0 ]; then exit "$main_rc"; fi
exit "$tier_rc"
