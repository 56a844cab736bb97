"""sglang-router (PyPI ``sglang-router``) in PD mode as a process in front of an emulated pool:
its command line (the documented 0.3.x flags), its readiness, its stop."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

PEER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


def sglang_router_cmd(
    prefill: list[tuple[str, int | None]],
    decode: list[str],
    policy: str,
    port: int,
    prom_port: int,
    request_timeout: float,
) -> list[str]:
    """The command line of sglang-router in PD mode (its documented flags, 0.3.x)."""
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for url, boot in prefill:
        cmd += ["--prefill", url, str(boot) if boot is not None else "none"]
    for url in decode:
        cmd += ["--decode", url]
    # the policy under test routes prefill; decode (one worker in the default pool) round-robin:
    # `--policy power_of_two` would also apply to a single decode worker
    cmd += ["--prefill-policy", policy, "--decode-policy", "round_robin"]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom_port)]
    cmd += ["--request-timeout-secs", str(max(1, int(math.ceil(request_timeout))))]
    cmd += ["--log-level", "warn"]
    return cmd


def start_sglang_router(
    run_dir: str | Path, policy: str, port: int, request_timeout: float, log_dir: Path
) -> subprocess.Popen:
    """sglang-router with ``policy`` on ``port`` in front of the pool ``smetric up`` started in
    ``run_dir`` (its router-config.yaml), logging to ``log_dir``; returns once it is ready."""
    from stack.ports import free_port

    rcfg = yaml.safe_load((Path(run_dir) / "router-config.yaml").read_text())
    prefill = [(w["url"], w.get("bootstrap_port")) for w in rcfg["prefill"]]
    decode = [w["url"] for w in rcfg["decode"]]
    cmd = sglang_router_cmd(prefill, decode, policy, port, free_port(), request_timeout)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / f"sglang-router-{policy}.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1", RUST_LOG_STYLE="never", NO_COLOR="1"),
    )
    log.close()
    try:
        wait_sglang_router(f"http://127.0.0.1:{port}", proc, len(prefill) + len(decode))
    except BaseException:
        stop(proc)
        raise
    return proc


def wait_sglang_router(url: str, proc: subprocess.Popen, n_workers: int, timeout: float = 60.0) -> None:
    """Until /health answers and every worker is registered (/workers), or fail."""
    import httpx

    t0 = time.monotonic()
    last = ""
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"sglang-router exited with {proc.returncode}")
        try:
            h = httpx.get(url + "/health", timeout=2.0)
            w = httpx.get(url + "/workers", timeout=2.0)
            if h.status_code == 200 and w.status_code == 200:
                data = w.json()
                workers = data.get("workers", data) if isinstance(data, dict) else data
                n = len(workers) if isinstance(workers, list) else 0
                if n >= n_workers:
                    return
                last = f"{n} of {n_workers} workers registered"
            else:
                last = f"/health {h.status_code}, /workers {w.status_code}"
        except (httpx.HTTPError, ValueError) as e:
            last = str(e)
        time.sleep(0.25)
    raise RuntimeError(f"sglang-router not ready after {timeout:.0f} s ({last})")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the router's process group, SIGKILL after 10 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def sglang_router_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("sglang-router")
    except Exception:  # noqa: BLE001
        return None
