"""Check a built router image: start a small emulated PD stack inside it (``smetric up``: two
prefill workers, one decode worker and the router, all from the image's venv), then ask the router
from outside the container, over loopback, for a chat completion, a streamed one and its metrics.

    python deploy/image/check.py localhost/smetric/stack:latest

The container runs under ``buildah run --isolation chroot``, which shares this machine's network:
the router's port is reachable here as it would be through a published port. Exit status 0 when
every answer is right; what was asked and answered is printed. ``deploy/image/build.sh --check``
runs this after the build.
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
import urllib.request
from pathlib import Path

CONFIG = """
model: {name: tiny, page_size: 16, context_length: 8192}
router: {policy: smetric-global, host: 127.0.0.1}
launch:
  engine: emulate
  tokenizer: tiny
  bind_host: 127.0.0.1
  prefill: {count: 2}
  decode: {count: 1}
  mooncake_master: null
  emulator: {time_factor: 0.05}
"""
#: inside the container: the stack up, kept until the checker drops a file, then down again
INSIDE = (
    "smetric up --config /cfg/stack.yaml --ports auto --run-dir /tmp/smetric-run --detach"
    " && while [ ! -e /cfg/stop ]; do sleep 0.5; done;"
    " smetric down --run-dir /tmp/smetric-run"
)


def _buildah(*args: str, timeout: float = 120) -> str:
    r = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"buildah {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout.strip()


def _post(url: str, body: dict, timeout: float = 60) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


def _router_url(proc: subprocess.Popen, timeout: float) -> str:
    """The router URL from ``smetric up --detach``'s JSON line (its stdout)."""
    found: dict[str, str] = {}
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("{") and "router_url" in line:
                found["url"] = json.loads(line)["router_url"]

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while "url" not in found:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the stack inside the image did not come up:\n" + "".join(lines)[-3000:])
        time.sleep(0.2)
    return found["url"]


def check(image: str, timeout: float = 180) -> list[str]:
    """Start the stack in ``image``, ask its router; the answers, as printable lines."""
    out: list[str] = []
    cfg = Path(tempfile.mkdtemp(prefix="smetric-image-check-"))
    cfg.chmod(0o755)  # the image runs as its own user (uid 10001)
    (cfg / "stack.yaml").write_text(CONFIG)
    (cfg / "stack.yaml").chmod(0o644)
    ctr = _buildah("from", image)
    proc = None
    try:
        proc = subprocess.Popen(
            [
                "buildah",
                "run",
                "--isolation",
                "chroot",
                "-v",
                f"{cfg}:/cfg:ro",
                ctr,
                "--",
                "sh",
                "-c",
                INSIDE,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        url = _router_url(proc, timeout)
        out.append(f"router inside the image: {url}")
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            out.append(f"GET /health -> {r.status} {r.read()[:120].decode()}")
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
        status, data = _post(url + "/v1/chat/completions", body)
        answer = json.loads(data)
        text = answer["choices"][0]["message"]["content"]
        out.append(f"POST /v1/chat/completions -> {status}, {answer['usage']}, text {text!r}")
        if status != 200 or not text:
            raise AssertionError(f"chat completion: {status} {data[:300]!r}")
        status, data = _post(url + "/v1/chat/completions", {**body, "stream": True})
        events = [ln for ln in data.decode().splitlines() if ln.startswith("data: ")]
        out.append(
            f"POST /v1/chat/completions (stream) -> {status}, {len(events)} events, last {events[-1]!r}"
        )
        if status != 200 or events[-1] != "data: [DONE]":
            raise AssertionError(f"streamed chat: {status} {data[-300:]!r}")
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            served = [ln for ln in r.read().decode().splitlines() if ln.startswith("smetric_requests_total{")]
        out.append("GET /metrics -> " + "; ".join(served))
        if not served:
            raise AssertionError("no smetric_requests_total in the router's /metrics")
        return out
    finally:
        (cfg / "stop").touch()
        if proc is not None:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        _buildah("rm", ctr)
        shutil.rmtree(cfg, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("image", help="the image to check, e.g. localhost/smetric/stack:latest")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds for the stack to come up")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        lines = check(a.image, a.timeout)
    except (RuntimeError, AssertionError, OSError) as e:
        print(f"image check FAILED: {e}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    print(f"image check ok: {a.image} answered ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
