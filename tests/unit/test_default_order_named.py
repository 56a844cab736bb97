"""The docs and comments name the router's shipped default order, not an older one.

The default changed (``slack`` to ``deadline-defer``) and sentences that state the default
drifted. This scans README, docs/, configs/ and the package for the ways a sentence states a
default order (``the default order is X``, ``X by default``, ``X (the default)``, ``the
router's default queue (X``) and fails when X is another order, unless the line says the
statement is history (``then``, ``previous``, ``was``, ``when measured``, ``round``, ...) or
is about the simulator's default (``immediate``, :data:`stack.dispatch.SIM_DISPATCH`)."""

from __future__ import annotations

import re
from pathlib import Path

from stack.dispatch import ROUTER_DISPATCH
from stack.dispatch.orders import ORDERS

ROOT = Path(__file__).resolve().parents[2]
OTHERS = "|".join(re.escape(o) for o in ORDERS if o != ROUTER_DISPATCH.order)
NAME = rf"`*(?:{OTHERS})(?![\w-])(?::[\w=.:]*)?`*"
STATES_DEFAULT = re.compile(
    "|".join(
        (
            rf"\bdefault (?:order |queue |dispatch )?(?:is|:) {NAME}",
            rf"\border {NAME} by default",
            rf"(?<![\w-]){NAME} by default",
            rf"\bdefault (?:order|queue|dispatch(?: queue)?) \({NAME}",
            rf"(?<![\w-]){NAME} \((?:the )?(?:router's |product's )?default\)",
            rf"\b(?:router's|product's) default (?:order )?(?:is )?{NAME}",
        )
    ),
    re.IGNORECASE,
)
HISTORY = re.compile(
    r"\b(?:then|previous|previously|was|were|when measured|round|earlier|old|before|formerly|history)\b"
    r"|simulator|smetric sim\b|--dispatch",
    re.IGNORECASE,
)


def _files() -> list[Path]:
    out = [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "configs").glob("*.yaml")),
    ]
    return out + sorted((ROOT / "stack").rglob("*.py"))


def sentences(text: str) -> list[str]:
    """``text``'s sentences: paragraphs (split at blank lines) with their lines joined (comment
    marks dropped), split after each full stop."""
    out = []
    for para in re.split(r"\n\s*(?:#:?\s*)?\n", text):
        flat = " ".join(re.sub(r"^\s*(?:#:?|\*|-|>)?\s*", "", ln) for ln in para.splitlines())
        out += [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", flat) if s]
    return out


def drifted(text: str, by_line: bool = False) -> list[str]:
    """The sentences (``by_line``: the lines, for code, where a comment is a line) of ``text``
    that state another order as the current default."""
    units = text.splitlines() if by_line else sentences(text)
    return [s for s in units if STATES_DEFAULT.search(s) and not HISTORY.search(s)]


def test_the_patterns_catch_the_drift_they_are_for():
    assert ROUTER_DISPATCH.order == "deadline-defer"
    assert drifted("the router's default queue (`slack`, readiness from the SLOs)")
    assert drifted("#: the dispatch queue (order slack by default; immediate: no queue)", by_line=True)
    assert drifted("With ``immediate`` (no queue; the router's default is ``slack``)")
    assert drifted("| smetric-global+slack:T=4 (default) | 38,844 |")
    assert not drifted("the router's default queue (`deadline-defer`, readiness from the SLOs)")
    assert not drifted("`slack:T=4` rows were the product default when measured")
    assert not drifted("`immediate` by default in the simulator")


def test_docs_and_comments_name_the_shipped_default_order():
    found = [
        f"{p.relative_to(ROOT)}: {ln.strip()[:160]}"
        for p in _files()
        for ln in drifted(p.read_text(errors="replace"), by_line=p.suffix == ".py")
    ]
    assert not found, "\n".join(found)
