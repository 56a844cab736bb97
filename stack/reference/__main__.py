"""``python -m stack.reference [--out DIR] [--check]``: write (or check) docs/reference/."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stack.paths import repo_relative
from stack.reference.pages import COMMAND, check, write


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stack.reference", description=__doc__)
    p.add_argument("--out", type=Path, default=None, help="write the pages here instead of docs/reference/")
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 when a committed page differs from what the code generates",
    )
    args = p.parse_args(argv)
    if args.check:
        problems = check(args.out)
        for msg in problems:
            print(msg, file=sys.stderr)
        if problems:
            print(f"reference pages stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        print("reference pages are current")
        return 0
    for path in write(args.out):
        print(f"wrote {repo_relative(str(path))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
