"""The docs site (`mkdocs.yml`, MkDocs over docs/) builds in strict mode, every docs page the
README links is on it, and the pages outside docs/research/ state what is true now.

- The build: `mkdocs build --strict` into a temporary folder (about 2 s). Strict mode turns
  MkDocs' warnings into a failure: a broken link or anchor, a page under docs/ missing from the
  nav, a nav entry without its page. The test also fails on any WARNING line the build prints.
- The README: each link into docs/ must be a page (or file) of the built site, a page must be in
  the nav, and a `#fragment` must be a heading of that page. Links to repository files outside
  docs/ (launch/README.md, stack/data/README.md, code) are the repository's, not the site's.
- The history lint: the manual (every page outside docs/research/ and docs/results/) describes
  the system as it is. How a default was chosen, rounds of a study, what a setting used to be and
  what changed belong to the research pages, which keep their history. The lint is a list of the
  phrases study logs use; a page outside research/ that needs one says it differently or moves
  the passage to a research page.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stack.paths import repo_root

ROOT = repo_root()
DOCS = ROOT / "docs"
MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")

# Phrases of a study log or a changelog. Each is matched case-insensitively on word boundaries,
# over the page's text with line breaks folded into spaces. Kept to phrases that do not occur in a
# present-tense description ("no longer" alone does: "until it is no longer listed").
HISTORY = [
    r"previous default",
    r"old defaults?",
    r"the old (?:behaviou?r|tier|table|main job|path|version|code)",
    r"\w+ \(history\)",
    r"rounds? (?:one|two|three|four|five)",
    r"(?:first|second|third|fourth) round",
    r"used to (?:be|take|hold|cost|fail|send|run)\b",
    r"(?:was|were|has been|have been) changed",
    r"what changed",
    r"the changes below",
    r"no longer (?:holds|starts|ejects|needs|uses|blocks|waits|runs)",
    r"(?:is|are) now\b",
    r"\bnow (?:adds|defaults|is the default)",
    r"formerly",
    r"previously",
    r"an earlier (?:measurement|run|version)",
    r"the earlier [\w-]+ run",
    r"before the (?:change|fix)",
    r"this session",
    r"(?:was|were) (?:tried|kept|dropped|reverted)",
    r"not kept",
    r"the first version",
    r"a manual run before",
    r"not yet in the tier",
    r"manual, 20\d\d-\d\d",
    r"before [`\w.-]+ existed",
    r"exactly as before",
]
HISTORY_RE = re.compile(r"\b(?:" + "|".join(HISTORY) + r")", re.IGNORECASE)


def _nav_pages(nav) -> list[str]:
    out: list[str] = []
    for item in nav:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            for v in item.values():
                out.extend(_nav_pages(v) if isinstance(v, list) else [v])
    return out


@pytest.fixture(scope="module")
def config() -> dict:
    # mkdocs.yml may carry !ENV / !!python tags; a plain load of the nav needs neither
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = proc.stdout + proc.stderr
    warnings = [line for line in log.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert proc.returncode == 0 and not warnings, "mkdocs build --strict failed:\n" + log
    return out


def test_site_builds_in_strict_mode(site: Path, config: dict):
    nav = _nav_pages(config["nav"])
    assert len(nav) == len(set(nav)), "a page is twice in mkdocs.yml's nav"
    on_disk = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(nav) == on_disk, "mkdocs.yml's nav and the pages under docs/ differ"
    for page in nav:
        assert (site / page).with_suffix(".html").is_file(), page


def test_every_docs_page_the_readme_links_is_on_the_site(site: Path, config: dict):
    nav = set(_nav_pages(config["nav"]))
    checked = 0
    for m in MD_LINK.finditer((ROOT / "README.md").read_text()):
        target = m.group(1)
        path, _, frag = target.partition("#")
        if not path.startswith("docs/"):
            continue
        rel = path[len("docs/") :]
        checked += 1
        if rel.endswith(".md"):
            assert rel in nav, f"README links {target}, which is not in mkdocs.yml's nav"
            html = (site / rel).with_suffix(".html")
            assert html.is_file(), f"README links {target}, which the site does not have"
            if frag:
                assert f'id="{frag}"' in html.read_text(), f"README links {target}: no such heading"
        else:
            assert (site / rel).exists(), f"README links {target}, which the site does not carry"
    assert checked >= 10


def _manual_pages() -> list[Path]:
    skip = {DOCS / "research", DOCS / "results"}
    return sorted(p for p in DOCS.rglob("*.md") if not skip & set(p.parents))


def history_phrases(text: str) -> list[str]:
    """The history phrases in `text`, with the words around each."""
    flat = re.sub(r"\s+", " ", text)
    return [flat[max(0, m.start() - 40) : m.end() + 40] for m in HISTORY_RE.finditer(flat)]


def test_the_manual_carries_no_history():
    pages = _manual_pages()
    assert any(p.name == "router.md" for p in pages)
    found = [f"{p.relative_to(ROOT)}: ...{hit}..." for p in pages for hit in history_phrases(p.read_text())]
    assert not found, (
        "history outside docs/research/ (say what is true now, or move the passage to a research "
        "page):\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "text",
    [
        "The previous default was slack.",
        "Round two measured the queue.",
        "a 64 MB header used to hold the event loop for seconds",
        "The old defaults (2 s, 2 failures)",
        "Live against simulated: the old main job (history)",
        "What changed for these figures",
        "One failed call no longer ejects a worker",
        "The first version fitted only lone prefills.",
        "a manual run before the busy-stretch fit and the Messages path, not yet in the tier",
        "The Messages path ran once through a real PD pair (manual, 2026-12-05).",
        "the three-term form (printed by that run, before `c_prefix` existed)",
        "unset: a single router, exactly as before",
        "## The main job's figures (history)",
    ],
)
def test_the_lint_catches_study_log_phrasing(text: str):
    assert history_phrases(text)


@pytest.mark.parametrize(
    "text",
    [
        "Watch GET /admin/workers until it is no longer listed.",
        "the first one that can no longer meet its SLO",
        "the key is used to sign the token",
        "the threshold used to decide readiness",
        "run `--rounds 4` of each",
        "the first token of the version string",
        "requests admitted and not yet answered",
        "the same greedy tokens as before the eviction",
        "see the manual, section 2",
    ],
)
def test_the_lint_passes_present_tense(text: str):
    assert not history_phrases(text)
