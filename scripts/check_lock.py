"""Check that an environment holds exactly the versions a lock file pins.

    python scripts/check_lock.py requirements/project.lock.txt            # every pin installed, same version
    python scripts/check_lock.py requirements/project.lock.txt --exact    # ... and nothing else installed
    python scripts/check_lock.py LOCK --list-extra                        # what the lock omits, by name

Run it with the interpreter of the environment to check (it reads that interpreter's installed
distributions). Exit 0 when the environment matches, 1 with one line per difference otherwise.
`--exact` also fails on a distribution the lock does not name, except the installer's own
(pip, setuptools, wheel) and the packages named with --allow (the project itself, `stack`,
is always allowed). The lock's format is pip's: `name==version` lines, `#` comments, `-c`/`-r`
and other options ignored.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
from pathlib import Path

ALWAYS_ALLOWED = {"pip", "setuptools", "wheel", "stack"}


def normalize(name: str) -> str:
    """PEP 503: case and runs of -_. do not matter."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        line = line.split(";", 1)[0].strip()  # environment markers: the lock is for one platform
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*==\s*([^\s\\]+)", line)
        if not m:
            raise SystemExit(f"check_lock: {path}: not a pin: {raw!r}")
        pins[normalize(m.group(1))] = m.group(2)
    return pins


def installed() -> dict[str, str]:
    found: dict[str, str] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(normalize(name), dist.version)
    return found


def differences(pins: dict[str, str], have: dict[str, str], exact: bool, allow: set[str]) -> list[str]:
    out = []
    for name, want in sorted(pins.items()):
        got = have.get(name)
        if got is None:
            out.append(f"missing: {name}=={want}")
        elif got != want:
            out.append(f"version: {name} is {got}, the lock says {want}")
    if exact:
        allowed = ALWAYS_ALLOWED | {normalize(a) for a in allow}
        for name in sorted(set(have) - set(pins) - allowed):
            out.append(f"not in the lock: {name}=={have[name]}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lock", type=Path, help="the lock file (pip requirements format, all pins ==)")
    ap.add_argument(
        "--exact", action="store_true", help="also fail on installed distributions the lock omits"
    )
    ap.add_argument("--allow", action="append", default=[], help="a distribution --exact lets through")
    ap.add_argument(
        "--list-extra",
        action="store_true",
        help="only print the installed names the lock omits (to uninstall)",
    )
    args = ap.parse_args(argv)
    pins = read_lock(args.lock)
    if args.list_extra:
        allowed = ALWAYS_ALLOWED | {normalize(a) for a in args.allow} | set(pins)
        print(" ".join(sorted(set(installed()) - allowed)))
        return 0
    diffs = differences(pins, installed(), args.exact, set(args.allow))
    for d in diffs:
        print(f"check_lock: {d}")
    where = sys.prefix
    if diffs:
        print(f"check_lock: {where} differs from {args.lock} in {len(diffs)} place(s)")
        return 1
    print(
        f"check_lock: {where} matches {args.lock} ({len(pins)} pins{', nothing else' if args.exact else ''})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
