"""The repository names no file outside itself: no absolute machine path, no `../` that leaves
the checkout, and no relative markdown link to a file that does not exist.

Walks the code, docs, configs and launch scripts a user gets when cloning (text files only).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stack.paths import repo_relative, repo_root

ROOT = repo_root()
WALKED = ("stack", "benchmarks", "docs", "configs", "launch", "README.md")
SKIP_DIRS = {"__pycache__", ".ruff_cache", ".pytest_cache"}
BINARY = {".gz", ".png", ".jpg", ".jpeg", ".gif", ".pdf", ".pyc", ".so", ".whl", ".zip"}

# a home directory or a development machine's work area; not preceded by a word character
# or a dot, so URLs (https://host/work/...) and names like `my/work/` do not match
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|root|home/[\w.-]+|Users/[\w.-]+)/")
UP_PATH = re.compile(r"(?<![\w.])(?:\.\./)+[\w.-]*")
MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|#|//)", re.IGNORECASE)


def _files() -> list[Path]:
    out: list[Path] = []
    for name in WALKED:
        top = ROOT / name
        if top.is_file():
            out.append(top)
            continue
        for p in top.rglob("*"):
            if p.is_file() and p.suffix.lower() not in BINARY and not SKIP_DIRS & set(p.parts):
                out.append(p)
    return sorted(out)


def _text(p: Path) -> str | None:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def _inside(target: Path) -> bool:
    try:
        target.resolve().relative_to(ROOT)
    except ValueError:
        return False
    return True


def _problems(p: Path, text: str) -> list[str]:
    rel = p.relative_to(ROOT).as_posix()
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in MACHINE_PATH.finditer(line):
            found.append(f"{rel}:{n}: absolute machine path {m.group(0)!r}")
        links = list(MD_LINK.finditer(line)) if p.suffix == ".md" else []
        for m in UP_PATH.finditer(line):
            # commands and code name paths from the repository root (where they run);
            # a markdown link's target is checked below, from the page's folder
            if any(k.start(1) <= m.start() < k.end(1) for k in links):
                continue
            if not _inside(ROOT / m.group(0)):
                found.append(f"{rel}:{n}: {m.group(0)!r} leaves the repository")
        if links:
            for m in links:
                target = m.group(1)
                if EXTERNAL.match(target):
                    continue
                path = target.split("#", 1)[0].split("?", 1)[0]
                resolved = p.parent / path
                if not _inside(resolved):
                    found.append(f"{rel}:{n}: link {target!r} leaves the repository")
                elif not resolved.exists():
                    found.append(f"{rel}:{n}: link {target!r} names no file")
    return found


def test_no_path_outside_the_repository():
    problems: list[str] = []
    files = _files()
    assert len(files) > 50  # the walk found the tree
    for p in files:
        text = _text(p)
        if text is not None:
            problems.extend(_problems(p, text))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("line", "bad"),
    [
        ("see ../shared/DESIGN.md §5", True),
        ('default="/work/shared/traces/a.jsonl.gz"', True),
        ("cache in /home/alice/.cache/x", True),
        ("cd /root/src", True),
        ("/Users/bob/stack", True),
        ("[paper](../../paper.md)", True),
        ("[gone](no_such_file.md)", True),
        ("[ok](definitions.md#the-slo) and [web](https://github.com/work/x)", False),
        ("[data](../stack/data/README.md), `stack/data/x.jsonl.gz`, /tmp/run, /etc/hosts", False),
    ],
)
def test_the_checks_catch_what_they_should(line, bad):
    doc = ROOT / "docs" / "example.md"
    if "definitions.md" in line:
        assert (ROOT / "docs" / "definitions.md").exists()
    assert bool(_problems(doc, line)) is bad


def test_repo_relative():
    inside = ROOT / "stack" / "data" / "agentic_slice.jsonl.gz"
    assert repo_relative(inside) == "stack/data/agentic_slice.jsonl.gz"
    assert repo_relative(str(inside)) == "stack/data/agentic_slice.jsonl.gz"
    assert repo_relative("/tmp/elsewhere/out.json") == "/tmp/elsewhere/out.json"
