"""A real Prometheus beside a local stack: its scrape config, its ``smetric up --prometheus``
process, and :class:`PrometheusServer`, one on a free loopback port for tests and benchmarks
(as :mod:`stack.launch.redis_server` does for Redis).

Three scrape jobs: ``smetric-router`` (each router replica's ``/metrics``), ``smetric-workers``
(each prefill and decode worker's ``/metrics``: the emulator's, or SGLang's with
``--enable-metrics``) and ``smetric-mooncake`` (mooncake_master's ``--metrics_port``). Every worker
series gets a ``worker`` label holding the worker's URL (``http://host:port``, the value the
router's own per-worker series carry): SGLang labels its series by model and rank only, so the
dashboard's per-worker panels group by this label for the emulator and SGLang alike. The
dashboard in deploy/grafana/ selects the jobs with its ``router_job``, ``worker_job`` and
``mooncake_job`` variables; the alerting rules of deploy/prometheus/alerts.yaml are loaded when
given (``smetric up --prometheus`` loads them). ``prometheus`` is Debian's package (2.42;
``.ci/install-system.sh``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from stack.launch.spec import ProcessSpec
from stack.paths import repo_root
from stack.ports import free_port

ROUTER_JOB = "smetric-router"
WORKER_JOB = "smetric-workers"
MOONCAKE_JOB = "smetric-mooncake"
DEFAULT_PORT = 9090
#: the alerting rules every Prometheus of a local stack loads (a copy goes into its config dir)
ALERTS = repo_root() / "deploy" / "prometheus" / "alerts.yaml"
#: a worker's ``worker`` label: its URL, as the router labels its own series of that worker (an
#: emulator's own ``worker`` label, its name, is kept as ``exported_worker``)
WORKER_RELABEL = [{"source_labels": ["__address__"], "target_label": "worker", "replacement": "http://$1"}]
#: SGLang names its metrics ``sglang:*``, but its prometheus_client (0.26 in SGLang 0.5.23)
#: escapes the colon to ``sglang_*`` for a Prometheus that does not ask for UTF-8 names (2.x,
#: e.g. Debian's 2.42; 3.x asks and keeps the colon): the scrape renames them back, so the
#: dashboard and the alerts read SGLang's documented names under every Prometheus
WORKER_METRIC_RELABEL = [
    {
        "source_labels": ["__name__"],
        "regex": "sglang_(.+)",
        "target_label": "__name__",
        "replacement": "sglang:$1",
    }
]


def require_prometheus(binary: str = "prometheus") -> str:
    path = shutil.which(binary)
    if path is None:
        raise RuntimeError(
            f"{binary} is not on PATH: the dashboard needs a real Prometheus "
            "(run `bash .ci/install-system.sh`, which apt-installs prometheus)"
        )
    return path


def _job(name: str, targets: list[str]) -> dict[str, Any]:
    job: dict[str, Any] = {"job_name": name, "static_configs": [{"targets": list(targets)}]}
    if name == WORKER_JOB:
        job["relabel_configs"] = WORKER_RELABEL
        job["metric_relabel_configs"] = WORKER_METRIC_RELABEL
    return job


def scrape_config(
    jobs: dict[str, list[str]], interval_s: float = 5.0, rule_files: list[str] | None = None
) -> str:
    """prometheus.yml scraping ``jobs`` (job name -> ``host:port`` targets) every ``interval_s``,
    evaluating ``rule_files`` at the same interval."""
    ms = max(100, int(interval_s * 1000))
    cfg: dict[str, Any] = {
        "global": {
            "scrape_interval": f"{ms}ms",
            "scrape_timeout": f"{max(100, int(ms * 0.8))}ms",
            "evaluation_interval": f"{ms}ms",
        },
    }
    if rule_files:
        cfg["rule_files"] = list(rule_files)
    cfg["scrape_configs"] = [_job(job, targets) for job, targets in jobs.items() if targets]
    return yaml.safe_dump(cfg, sort_keys=False)


def argv(binary: str, config: Path | str, data: Path | str, host: str, port: int) -> list[str]:
    return [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={data}",
        f"--web.listen-address={host}:{port}",
        "--storage.tsdb.retention.time=2d",
        "--log.level=warn",
    ]


def _netloc(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc


def mooncake_targets(specs: Iterable[ProcessSpec]) -> list[str]:
    """``host:port`` of each launched mooncake_master's metrics server (``--metrics_port``)."""
    out = []
    for s in specs:
        if s.role != "mooncake_master":
            continue
        for a in s.argv:
            if a.startswith("--metrics_port="):
                out.append(f"{s.host}:{int(a.split('=', 1)[1])}")
    return out


def stack_jobs(
    rcfg: dict[str, Any], router_urls: list[str], mooncake: list[str] | None = None
) -> dict[str, list[str]]:
    """The scrape jobs of a stack: its routers, the workers of its router config, and the
    Mooncake masters' metrics servers (``host:port``)."""
    workers = [w["url"] for w in (rcfg.get("prefill") or []) + (rcfg.get("decode") or [])]
    return {
        ROUTER_JOB: [_netloc(u) for u in router_urls],
        WORKER_JOB: [_netloc(u) for u in workers],
        MOONCAKE_JOB: list(mooncake or []),
    }


def stack_spec(
    launch: dict[str, Any],
    rcfg: dict[str, Any],
    router_urls: list[str],
    host: str,
    specs: Iterable[ProcessSpec] = (),
) -> ProcessSpec:
    """``smetric up --prometheus``: the Prometheus process scraping the stack (the router(s), the
    workers, and the mooncake_master among ``specs``) and evaluating deploy/prometheus/alerts.yaml
    (``launch.prometheus``: ``port``, default 9090, a free one with ``ports: auto``;
    ``scrape_interval_s``, default 5; ``binary``), its config, rules and data under the run dir."""
    pc = launch.get("prometheus") or {}
    if not isinstance(pc, dict):
        pc = {}
    auto = str(launch.get("ports", "fixed")) == "auto"
    port = free_port(host) if auto else int(pc.get("port", DEFAULT_PORT))
    run_dir = Path(launch.get("run_dir", ".smetric/run")).resolve()
    conf = run_dir / "prometheus" / "prometheus.yml"
    files: dict[str, str] = {}
    rules: list[str] = []
    if ALERTS.is_file():  # an installed package without the repository's deploy/ has none
        rules.append(str(run_dir / "prometheus" / ALERTS.name))
        files[rules[0]] = ALERTS.read_text()
    jobs = stack_jobs(rcfg, router_urls, mooncake_targets(specs))
    files[str(conf)] = scrape_config(jobs, float(pc.get("scrape_interval_s", 5.0)), rules)
    return ProcessSpec(
        name="prometheus",
        role="prometheus",
        argv=argv(str(pc.get("binary", "prometheus")), conf, run_dir / "prometheus" / "data", host, port),
        host=host,
        ready_url=f"http://{host}:{port}/-/ready",
        ready_port=port,
        files=files,
    )


class PrometheusError(RuntimeError):
    """Prometheus answered a query with an error (its ``errorType`` and ``error``)."""


class PrometheusServer:
    """A ``prometheus`` process on a free loopback port, scraping ``jobs`` every ``interval_s``
    and evaluating ``rule_files`` (data in ``data_dir``, dropped with it)."""

    def __init__(
        self,
        jobs: dict[str, list[str]],
        data_dir: Path | str,
        interval_s: float = 1.0,
        port: int | None = None,
        binary: str = "prometheus",
        rule_files: list[str] | None = None,
    ) -> None:
        self.binary = require_prometheus(binary)
        self.port = port or free_port()
        self.dir = Path(data_dir)
        self.jobs = jobs
        self.interval_s = interval_s
        self.rule_files = list(rule_files or [])
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = self.dir / "prometheus.yml"
        conf.write_text(scrape_config(self.jobs, self.interval_s, self.rule_files))
        log = open(self.dir / "prometheus.log", "ab")  # noqa: SIM115 - the process holds it
        self.proc = subprocess.Popen(
            argv(self.binary, conf, self.dir / "data", "127.0.0.1", self.port),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = (self.dir / "prometheus.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"prometheus exited ({self.proc.returncode}):\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1.0) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"prometheus not ready on port {self.port} after {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def api(self, path: str, **params: Any) -> Any:
        """``GET /api/v1/<path>``'s ``data`` (raises :class:`PrometheusError`)."""
        return api_get(self.url, path, **params)

    def targets_up(self) -> dict[str, int]:
        """Job -> targets whose last scrape succeeded."""
        up: dict[str, int] = {}
        for t in self.api("targets")["activeTargets"]:
            if t.get("health") == "up":
                job = t["labels"].get("job", "")
                up[job] = up.get(job, 0) + 1
        return up

    def wait_scraped(self, timeout: float = 20.0) -> None:
        """Until every target of every job has been scraped once, successfully."""
        want = {j: len(t) for j, t in self.jobs.items() if t}
        deadline = time.monotonic() + timeout
        while True:
            got = self.targets_up()
            if all(got.get(j, 0) >= n for j, n in want.items()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"targets up {got}, wanted {want}")
            time.sleep(0.2)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def api_get(base_url: str, path: str, timeout: float = 10.0, **params: Any) -> Any:
    """``GET <base_url>/api/v1/<path>?params``'s ``data``; :class:`PrometheusError` on an
    error answer (a bad query is a 400 with the reason)."""
    q = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
    url = f"{base_url}/api/v1/{path}" + (f"?{q}" if q else "")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            body = json.loads(e.read())
        except ValueError:
            raise PrometheusError(f"HTTP {e.code} from {url}") from None
    if body.get("status") != "success":
        raise PrometheusError(f"{body.get('errorType')}: {body.get('error')}")
    return body["data"]
