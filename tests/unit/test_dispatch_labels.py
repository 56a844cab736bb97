"""Every dispatch label the manual, the README, the benchmarks and the tests write parses into
the one model (stack/dispatch/spec.py) and round-trips: the model's label parses back to the
same spec, and a label already in canonical form prints as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stack.dispatch import ORDERS, DispatchSpec

ROOT = Path(__file__).resolve().parents[2]
_ORDER = "|".join(sorted(map(re.escape, ORDERS), key=len, reverse=True))
#: an order with at least one key=value (a bare order name is no label worth scanning for)
LABEL = re.compile(rf"(?<![\w-])(?:{_ORDER})(?::[A-Za-z_][\w-]*=[-+\w.]+)+")
SOURCES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "benchmarks").rglob("*.py")),
]
SOURCES += [p for p in sorted((ROOT / "tests").rglob("*.py")) if p.name != Path(__file__).name]


def _labels() -> dict[str, str]:
    found: dict[str, str] = {}
    for path in SOURCES:
        for m in LABEL.finditer(path.read_text(errors="replace")):
            label = m.group(0).rstrip(".")
            if not label.endswith("="):  # "slack:slo_k=..." in prose
                found.setdefault(label, str(path.relative_to(ROOT)))
    return found


LABELS = _labels()
#: labels written to show an error (tests/unit/test_dispatch_spec.py and friends)
INVALID = re.compile(
    r"=fast|=x$|=-1|=gossip|T=0$|^fifo:age_k|^fifo:replicas=1\.5|slo_window=(0|2\.5)$|slo_q=1\.5|slo_k=inf"
    r"|^immediate:(T|max_queue|slo_k|replicas|bypass|affinity)=|prio=2$"
)


def test_the_scan_finds_the_labels_in_use():
    assert len(LABELS) > 50, len(LABELS)


@pytest.mark.parametrize("label", sorted(LABELS), ids=lambda x: x[:80])
def test_every_label_round_trips_through_the_model(label):
    try:
        spec = DispatchSpec.parse(label)
    except ValueError:
        if INVALID.search(label):
            return  # written to show the error it gets
        raise AssertionError(f"{label} (in {LABELS[label]}) does not parse") from None
    assert DispatchSpec.parse(spec.label()) == spec
    if spec.label() == label:
        assert str(spec) == label
