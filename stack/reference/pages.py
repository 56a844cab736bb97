"""The four pages: generate them, write them, or check the committed ones against the code."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path

from stack.paths import repo_root

#: where the pages live, relative to the repository
REFERENCE_DIR = Path("docs") / "reference"
#: the command that regenerates them (what a stale page's message says)
COMMAND = "python -m stack.reference"


def _renderers() -> dict[str, Callable[[], str]]:
    from stack.reference import cli, configuration, http_api, metrics

    return {
        "configuration.md": configuration.render,
        "cli.md": cli.render,
        "http-api.md": http_api.render,
        "metrics.md": metrics.render,
    }


def generate() -> dict[str, str]:
    """Page file name -> its text, as the code makes it now."""
    return {name: render().rstrip("\n") + "\n" for name, render in _renderers().items()}


def write(out: Path | None = None) -> list[Path]:
    """Write every page under ``out`` (default: the repository's docs/reference/); returns the paths."""
    out = out if out is not None else repo_root() / REFERENCE_DIR
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, body in generate().items():
        p = out / name
        p.write_text(body, encoding="utf-8")
        paths.append(p)
    return paths


def check(committed: Path | None = None, pages: dict[str, str] | None = None) -> list[str]:
    """The problems of the committed pages (missing, or not what the code generates now), each
    with a short diff; empty when they are current."""
    committed = committed if committed is not None else repo_root() / REFERENCE_DIR
    pages = pages if pages is not None else generate()
    problems = []
    for name, body in pages.items():
        p = committed / name
        if not p.exists():
            problems.append(f"{REFERENCE_DIR / name}: missing; run `{COMMAND}`")
            continue
        have = p.read_text(encoding="utf-8")
        if have != body:
            diff = difflib.unified_diff(
                have.splitlines(),
                body.splitlines(),
                f"committed/{name}",
                f"generated/{name}",
                lineterm="",
                n=1,
            )
            shown = "\n".join(list(diff)[:40])
            problems.append(f"{REFERENCE_DIR / name}: stale; run `{COMMAND}` and commit it\n{shown}")
    return problems
