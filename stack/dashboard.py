"""Check the Grafana dashboard (deploy/grafana/stack-dashboard.json) against a live Prometheus:
every panel's every query, with Grafana's variables substituted, must select a router, worker or
Mooncake master metric (``smetric_*``, ``sglang:*``, ``master_*``; a constant such as
``vector(1)`` fails) that a scraped target declares, and must return at least one finite sample
over the window asked about.

A metric is declared when Prometheus holds a series of it or the metadata of its family (the
``# TYPE`` line of a target's exposition). A labelled counter has no series until its first event
(no KV-event gap yet, no upstream error): such a panel shows zeros through an ``or`` fallback on a
metric that has series, and a misspelt name still fails, declared by no target.

    python -m stack.dashboard --prometheus http://127.0.0.1:9090 [--since 15m]

Grafana is not needed: its variables are replaced as Grafana would for a time-series panel
(``$__rate_interval`` = max(4 x scrape interval, step + scrape interval), ``$__interval`` = the
step, ``$__range``; ``$router_job`` / ``${worker_job}`` from the dashboard's own defaults unless
given). tests/e2e/test_dashboard.py runs this against a real Prometheus scraping ``smetric up``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from stack.launch.prometheus import PrometheusError, api_get
from stack.paths import repo_root

DASHBOARD = repo_root() / "deploy" / "grafana" / "stack-dashboard.json"
#: what a panel must select: the router's metrics, the workers' (SGLang's names and ours) and the
#: Mooncake master's
METRIC = re.compile(r"\b(smetric_[A-Za-z0-9_:]*|sglang:[A-Za-z0-9_:]*|master_[A-Za-z0-9_]*)")
_SUFFIXES = ("_bucket", "_sum", "_count")
_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")


@dataclass
class Query:
    panel: str
    ref: str
    expr: str


@dataclass
class PanelResult:
    panel: str
    ok: bool
    #: why not (or, skipped, which pending metric it waits for)
    reasons: list[str] = field(default_factory=list)
    skipped: bool = False
    metrics: set[str] = field(default_factory=set)


def load(path: Path | str = DASHBOARD) -> dict:
    return json.loads(Path(path).read_text())


def queries(dash: dict) -> list[Query]:
    """Every query of every panel (rows' nested panels too), in the dashboard's order."""
    out: list[Query] = []

    def walk(panels: Iterable[dict]) -> None:
        for p in panels:
            if p.get("type") == "row":
                walk(p.get("panels") or [])
                continue
            for t in p.get("targets") or []:
                out.append(
                    Query(p.get("title", f"panel {p.get('id')}"), t.get("refId", "?"), t.get("expr", ""))
                )

    walk(dash.get("panels") or [])
    return out


def defaults(dash: dict) -> dict[str, str]:
    """The dashboard variables' current values (custom and constant variables)."""
    out = {}
    for v in (dash.get("templating") or {}).get("list") or []:
        cur = (v.get("current") or {}).get("value")
        if isinstance(cur, str) and cur:
            out[v["name"]] = cur
        elif v.get("type") in ("custom", "constant") and v.get("query"):
            out[v["name"]] = str(v["query"]).split(",")[0].strip()
    return out


def grafana_vars(step_s: float, scrape_s: float, range_s: float) -> dict[str, str]:
    """Grafana's built-in variables for a panel queried at ``step_s`` over ``range_s``."""
    rate = max(4 * scrape_s, step_s + scrape_s)
    return {
        "__rate_interval": f"{int(math.ceil(rate * 1000))}ms",
        "__interval": f"{int(math.ceil(step_s * 1000))}ms",
        "__interval_ms": str(int(math.ceil(step_s * 1000))),
        "__range": f"{int(range_s)}s",
        "__range_s": str(int(range_s)),
        "__range_ms": str(int(range_s * 1000)),
    }


def substitute(expr: str, values: dict[str, str]) -> str:
    """``expr`` with ``$name``, ``${name}`` and ``[[name]]`` replaced (ValueError: one unknown)."""

    def rep(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in values:
            raise ValueError(f"unknown dashboard variable ${name}")
        return values[name]

    return _VAR.sub(rep, expr)


def finite_samples(data: dict) -> int:
    """Finite values in a query_range (matrix) or query (vector) result."""
    n = 0
    for series in data.get("result") or []:
        for _t, v in series.get("values") or ([series["value"]] if "value" in series else []):
            try:
                if math.isfinite(float(v)):
                    n += 1
            except ValueError:
                pass
    return n


def declared(prometheus_url: str) -> set[str]:
    """Metric names a scraped target declares: every name with a series, every family in the
    targets' metadata, and a histogram family's ``_bucket``/``_sum``/``_count`` series."""
    names = set(api_get(prometheus_url, "label/__name__/values"))
    families = set(api_get(prometheus_url, "metadata"))
    return names | families | {f + s for f in families for s in _SUFFIXES}


def check(
    dash: dict,
    prometheus_url: str,
    start: float,
    end: float,
    step_s: float = 1.0,
    scrape_s: float = 1.0,
    variables: dict[str, str] | None = None,
    pending: dict[str, str] | None = None,
) -> list[PanelResult]:
    """One :class:`PanelResult` per panel. ``pending``: metric -> why it may be absent still (a
    panel whose missing metrics are all pending is skipped, not failed)."""
    pending = pending or {}
    values = {**defaults(dash), **grafana_vars(step_s, scrape_s, end - start), **(variables or {})}
    known = declared(prometheus_url)
    results: dict[str, PanelResult] = {}
    for q in queries(dash):
        r = results.setdefault(q.panel, PanelResult(q.panel, True))
        used = set(METRIC.findall(q.expr))
        r.metrics |= used
        if not used:
            r.reasons.append(f"{q.ref}: selects no router, worker or Mooncake metric: {q.expr}")
            continue
        missing = sorted(used - known)
        if missing and all(m in pending for m in missing):
            r.skipped = True
            r.reasons.append(f"{q.ref}: pending {', '.join(f'{m} ({pending[m]})' for m in missing)}")
            continue
        if missing:
            r.reasons.append(f"{q.ref}: declared by no scraped target: {', '.join(missing)}")
            continue
        try:
            expr = substitute(q.expr, values)
            data = api_get(prometheus_url, "query_range", query=expr, start=start, end=end, step=step_s)
        except (ValueError, PrometheusError) as e:
            r.reasons.append(f"{q.ref}: {e}")
            continue
        if finite_samples(data) == 0:
            r.reasons.append(f"{q.ref}: no data: {expr}")
    for r in results.values():
        r.ok = not r.reasons or (r.skipped and all("pending" in x for x in r.reasons))
    return list(results.values())


def _duration_s(v: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", v.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"a duration such as 90s, 15m or 1h (got {v!r})")
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m stack.dashboard",
        description="Check every panel of the Grafana dashboard against a live Prometheus: each "
        "query selects a router or worker metric that Prometheus knows and returns finite samples "
        "over the window. Exit status 1 when a panel fails.",
    )
    ap.add_argument("--prometheus", required=True, help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    ap.add_argument("--dashboard", default=str(DASHBOARD), help="dashboard JSON (default: the repository's)")
    ap.add_argument("--since", type=_duration_s, default=900.0, help="window ending now (default 15m)")
    ap.add_argument("--step", type=_duration_s, default=15.0, help="query step, Grafana's $__interval (15s)")
    ap.add_argument("--scrape", type=_duration_s, default=5.0, help="the scrape interval (default 5s)")
    ap.add_argument(
        "--var",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a dashboard variable, e.g. router_job=x",
    )
    a = ap.parse_args(argv)
    variables = dict(v.split("=", 1) for v in a.var)
    end = time.time()
    results = check(
        load(a.dashboard), a.prometheus.rstrip("/"), end - a.since, end, a.step, a.scrape, variables
    )
    for r in results:
        state = "skip" if r.skipped else ("ok" if r.ok else "FAIL")
        print(f"{state:4s}  {r.panel}" + "".join(f"\n      {x}" for x in r.reasons if not r.ok or r.skipped))
    bad = [r for r in results if not r.ok]
    print(f"{len(results) - len(bad)}/{len(results)} panels ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
