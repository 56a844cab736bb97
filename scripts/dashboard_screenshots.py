"""Screenshots of Prometheus's graph page for dashboard panels' queries, as the README shows them.

Starts a small emulated stack with `smetric up --prometheus` (free ports, a 1 s scrape), sends
agent-like traffic for a while, then renders Prometheus's own graph page (`/graph`) for the
queries of the named panels of deploy/grafana/stack-dashboard.json, Grafana's variables
substituted, in headless Chromium (Debian's `chromium`), and stops the stack.

    python scripts/dashboard_screenshots.py [--out docs/img] [--seconds 60]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stack import dashboard  # noqa: E402

#: panel title -> PNG name
PANELS = {
    "TTFT quantiles (router)": "prometheus-ttft.png",
    "Routing decisions by kind": "prometheus-decisions.png",
}
CONFIG = """
model: {name: tiny, page_size: 16, context_length: 32768}
router: {policy: smetric, global_tier: written}
launch:
  engine: emulate
  tokenizer: tiny
  prefill: {count: 4, workers_per_process: 4}
  decode: {count: 1}
  mooncake_master: null
  emulator: {time_factor: 0.05, stream_interval: 1, kv_transport: http}
  prometheus: {scrape_interval_s: 1}
"""


def traffic(router: str, seconds: float, sessions: int = 8) -> None:
    """Agent sessions (a growing history per session: first turns, then sticks and the odd
    migration), streamed."""
    import httpx

    stop = time.monotonic() + seconds

    def session(i: int) -> None:
        msgs = [{"role": "system", "content": f"You are coding agent {i}. " * 10}]
        with httpx.Client(base_url=router, timeout=60) as c:
            n = 0
            while time.monotonic() < stop:
                n += 1
                msgs.append({"role": "user", "content": f"session {i} turn {n}: fix module_{i}.py " * 60})
                c.post(
                    "/v1/chat/completions",
                    json={"model": "tiny", "messages": msgs, "max_tokens": 16, "stream": True},
                )
                msgs.append({"role": "assistant", "content": f"done {n}"})
                if n >= 8:  # a new session, with its first turn
                    msgs, n = msgs[:1], 0
                time.sleep(0.2)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def one_graph(exprs: list[tuple[str, str]]) -> str:
    """A panel's queries as one expression (Prometheus's graph page draws one per graph): each
    labelled ``query="<legend>"`` and joined with ``or``; a single query as it is."""
    if len(exprs) == 1:
        return exprs[0][0]
    return " or ".join(f'label_replace({e}, "query", "{legend}", "", "")' for e, legend in exprs)


def graph_url(prom: str, expr: str, range_s: int) -> str:
    q = {"g0.expr": expr, "g0.tab": "0", "g0.stacked": "0", "g0.range_input": f"{range_s}s"}
    return f"{prom}/graph?" + urllib.parse.urlencode(q)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"), help="where the PNGs go (docs/img)")
    ap.add_argument("--seconds", type=float, default=60.0, help="traffic before the screenshots")
    ap.add_argument("--chromium", default="chromium", help="the headless browser (Debian's chromium)")
    a = ap.parse_args()
    browser = shutil.which(a.chromium)
    if browser is None:
        print(f"{a.chromium} not found (apt install chromium)", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="smetric-shots-"))
    (tmp / "stack.yaml").write_text(CONFIG)
    run_dir = tmp / "run"
    cli = [sys.executable, "-m", "stack.cli"]
    up = subprocess.run(
        [
            *cli,
            "up",
            "--config",
            str(tmp / "stack.yaml"),
            "--prometheus",
            "--ports",
            "auto",
            "--run-dir",
            str(run_dir),
            "--detach",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if up.returncode != 0:
        print(up.stderr[-3000:], file=sys.stderr)
        return 1
    try:
        info = json.loads(up.stdout.strip().splitlines()[-1])
        t0 = time.time()
        traffic(info["router_url"], a.seconds)
        time.sleep(3)
        dash = dashboard.load()
        span = int(time.time() - t0) + 30
        values = {**dashboard.defaults(dash), **dashboard.grafana_vars(step_s=1, scrape_s=1, range_s=span)}
        for title, png in PANELS.items():
            (panel,) = [p for p in dash["panels"] if p.get("title") == title]
            exprs = [
                (dashboard.substitute(t["expr"], values), t.get("legendFormat") or t["refId"])
                for t in panel["targets"]
            ]
            url = graph_url(info["prometheus_url"], one_graph(exprs), span)
            subprocess.run(
                [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 "--window-size=1280,900", "--virtual-time-budget=15000",
                 f"--user-data-dir={tmp / 'chromium'}", f"--screenshot={out / png}", url],
                check=True,
                capture_output=True,
                timeout=120,
            )  # fmt: skip
            print(f"{out / png}: {title}")
        return 0
    finally:
        subprocess.run([*cli, "down", "--run-dir", str(run_dir)], capture_output=True, cwd=ROOT)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
