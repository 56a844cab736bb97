"""The Grafana dashboard against real SGLang workers (test-only helper for the `sglang` tier).

`run_dashboard_check(stack_up, workdir)` takes the tier's running PD stack (two real SGLang
prefill workers and one decode worker, KV events on) and adds, for the length of the check:

- a real ``mooncake_master`` with its metrics port (the tier's pair moves KV over mooncake_tcp
  without a master), which a second router uses as its global tier (its existence checks are
  master requests the Mooncake panels show);
- that second ``smetric router`` in front of the same real workers, with client keys (the
  per-key panel) and the product's policy, so the tier's own router and its accounting are
  left alone;
- a real Prometheus (Debian's) scraping that router, the three SGLang workers (their series
  relabelled with ``worker`` = the worker's URL, as `smetric up --prometheus` does) and the
  master every second, and evaluating deploy/prometheus/alerts.yaml.

Then agent-like traffic (sessions of streamed and whole chats, a malformed body now and then)
through the second router, and every panel of deploy/grafana/stack-dashboard.json queried over
the traffic's window (`stack.dashboard.check`). Returns what the test asserts on.
"""

from __future__ import annotations

import copy
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from harness import start, stop_all, wait_ready

from stack import dashboard
from stack.launch.prometheus import ALERTS, MOONCAKE_JOB, ROUTER_JOB, WORKER_JOB, PrometheusServer, api_get
from stack.launch.sglang import resolved_config
from stack.launch.spec import ProcessSpec
from stack.ports import free_port

KEY = "sk-tier-dashboard"


@dataclass
class DashboardRun:
    results: dict[str, dashboard.PanelResult]
    statuses: dict[int, int]
    #: the scrape targets Prometheus had up, by job
    targets: dict[str, int]
    #: label sets of one SGLang gauge, as Prometheus stored them
    worker_series: list[dict[str, str]]
    rules_health: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    #: for each metric of a failed panel: its series in the window, as (labels, samples, last
    #: value), so a failure says whether SGLang exported nothing, zeros, or other labels
    probe: dict[str, list] = field(default_factory=dict)


def _master_spec() -> tuple[ProcessSpec, int, int, int]:
    rpc, http, metrics = free_port(), free_port(), free_port()
    argv = [
        "mooncake_master",
        f"--rpc_port={rpc}",
        "--rpc_address=127.0.0.1",
        "--enable_http_metadata_server=true",
        "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={http}",
        f"--metrics_port={metrics}",
        "--metrics_host=127.0.0.1",
        "--rpc_thread_num=2",
    ]
    spec = ProcessSpec("mooncake-master-dashboard", "mooncake_master", argv, ready_port=rpc)
    spec.env = {"GLOG_minloglevel": "1"}
    return spec, rpc, http, metrics


def _router_config(stack_up: dict, port: int, keys: Path, rpc: int, http: int) -> dict:
    rc = copy.deepcopy(resolved_config(copy.deepcopy(stack_up["cfg"])))
    rc["router"] = {
        **rc["router"],
        "port": port,
        "global_tier": "mooncake",
        "auth": {"keys_file": str(keys)},
        "admin_token_env": "SMETRIC_TIER_DASHBOARD_ADMIN",
    }
    rc["mooncake"] = {"master": f"127.0.0.1:{rpc}", "metadata_url": f"http://127.0.0.1:{http}/metadata"}
    rc.pop("launch", None)
    return rc


def _post(url: str, data: bytes, timeout: float = 300) -> int:
    req = urllib.request.Request(
        url, data=data, headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def _traffic(router: str, seconds: float, sessions: int = 3) -> dict[int, int]:
    """Sessions with growing histories (sticks, local hits), streamed and whole chats, and a
    malformed body every fifth turn; the count of each status."""
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def session(i: int) -> None:
        msgs = [{"role": "system", "content": f"You are coding agent {i}. " * 8}]
        n = 0
        while time.monotonic() < stop:
            n += 1
            msgs.append({"role": "user", "content": f"turn {n}: fix module_{i}.py line {n}"})
            if n % 5 == 0:
                status = _post(router + "/v1/chat/completions", b"{oops")
            else:
                body = {
                    "model": "tiny",
                    "messages": msgs,
                    "max_tokens": 6,
                    "temperature": 0,
                    "stream": n % 2 == 1,
                }
                status = _post(router + "/v1/chat/completions", json.dumps(body).encode())
                msgs.append({"role": "assistant", "content": f"done {n}"})
            with lock:
                statuses[status] = statuses.get(status, 0) + 1

    threads = [threading.Thread(target=session, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


def _scraped(prom_url: str, start: float, end: float) -> dict[str, int]:
    """Targets scraped successfully during the traffic's window, by job: one failed scrape (a
    real SGLang's /metrics past the 0.8 s scrape timeout on a busy 2-core machine) does not
    make a target missing, as an instant read of ``up`` did."""
    window = max(1, int(end - start))
    got = api_get(prom_url, "query", query=f"count by (job) (max_over_time(up[{window}s]) == 1)", time=end)
    return {r["metric"]["job"]: int(float(r["value"][1])) for r in got["result"]}


def _probe(prom_url: str, failed: list, start: float, end: float) -> dict[str, list]:
    out: dict[str, list] = {}
    for r in failed:
        for m in sorted(r.metrics):
            q = f'{{__name__=~"{m}(_count)?"}}'
            try:
                data = api_get(prom_url, "query_range", query=q, start=start, end=end, step=1.0)["result"]
            except Exception as e:  # noqa: BLE001 - diagnosis only
                out[m] = [repr(e)]
                continue
            out[m] = [
                (s["metric"], len(s.get("values") or []), (s.get("values") or [[0, None]])[-1][1])
                for s in data
            ]
    return out


def run_dashboard_check(stack_up: dict, workdir: Path, traffic_s: float = 25.0) -> DashboardRun:
    t0 = time.monotonic()
    logs = workdir / "logs"
    mspec, rpc, http, metrics = _master_spec()
    master = start(mspec, logs)
    router = None
    try:
        wait_ready([master], timeout=60)
        keys = workdir / "keys.yaml"
        keys.write_text(f"keys:\n  - {{name: dashboard, key: {KEY}}}\n")
        port = free_port()
        cfg = workdir / "router-config.yaml"
        cfg.write_text(yaml.safe_dump(_router_config(stack_up, port, keys, rpc, http), sort_keys=False))
        url = f"http://127.0.0.1:{port}"
        rspec = ProcessSpec(
            "router-dashboard",
            "router",
            [sys.executable, "-m", "stack.cli", "router", "--config", str(cfg)],
            ready_url=url + "/health",
        )
        router = start(rspec, logs)
        wait_ready([router], timeout=180)
        workers = [*stack_up["prefill"], stack_up["decode"]]
        jobs = {
            ROUTER_JOB: [f"127.0.0.1:{port}"],
            WORKER_JOB: [w.removeprefix("http://") for w in workers],
            MOONCAKE_JOB: [f"127.0.0.1:{metrics}"],
        }
        with PrometheusServer(jobs, workdir / "prometheus", interval_s=1.0, rule_files=[str(ALERTS)]) as prom:
            prom.wait_scraped(timeout=60)
            start_t = time.time()
            statuses = _traffic(url, traffic_s)
            time.sleep(3.0)  # the last scrapes
            end_t = time.time()
            results = dashboard.check(dashboard.load(), prom.url, start_t, end_t, step_s=1.0, scrape_s=1.0)
            # over the window, not an instant read: a failed scrape marks the series stale
            window = max(1, int(end_t - start_t))
            gauge = f'last_over_time(sglang:num_running_reqs{{job="{WORKER_JOB}"}}[{window}s])'
            series = api_get(prom.url, "query", query=gauge, time=end_t)["result"]
            rules = {r["name"]: r["health"] for g in prom.api("rules")["groups"] for r in g["rules"]}
            probe = _probe(prom.url, [r for r in results if not r.ok], start_t, end_t)
            return DashboardRun(
                results={r.panel: r for r in results},
                statuses=statuses,
                targets=_scraped(prom.url, start_t, end_t),
                worker_series=[s["metric"] for s in series],
                rules_health=rules,
                seconds=time.monotonic() - t0,
                probe=probe,
            )
    finally:
        stop_all(([router] if router else []) + [master])
