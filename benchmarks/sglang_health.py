"""How long real SGLang takes to start and to answer ``/health``, idle and busy: the measurement
behind the router's health defaults and the launcher's readiness default (docs/deploy/bare-metal.md,
"Health and readiness").

    python benchmarks/sglang_health.py --out DIR [--calls 10] [--busy 4]

Builds the CPU tier's tiny random-weight Llama (tests/sglang_cpu/build_tiny_llama.py; no hub),
starts one plain SGLang 0.5.23 CPU worker from the launcher's own process spec (one compute
thread, ``--tool-call-parser qwen3_coder`` as the shipped configs set it), and prints: the
seconds until it was ready; ``/health``'s latency over ``--calls`` calls while idle, then while
``--busy`` clients each keep a 64-token generation running. DIR/health.json holds every figure.
Needs the SGLang interpreter (tests/sglang_cpu/_locate.py finds it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "sglang_cpu")]

from _locate import sglang_python  # noqa: E402
from harness import start, stop_all, wait_ready  # noqa: E402

PROMPT = "You are a coding agent. Read the file, fix the bug, run the tests. " * 12


def _post(url: str, body: dict) -> None:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def _health(url: str) -> float:
    t0 = time.monotonic()
    with urllib.request.urlopen(url + "/health", timeout=60) as r:
        r.read()
    return time.monotonic() - t0


def _summary(xs: list[float]) -> dict:
    return {"n": len(xs), "median_s": statistics.median(xs), "max_s": max(xs), "all_s": xs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (the model, logs, health.json)")
    ap.add_argument("--calls", type=int, default=10, help="/health calls in each state")
    ap.add_argument("--busy", type=int, default=4, help="concurrent generating clients in the busy state")
    a = ap.parse_args(argv)
    from stack.launch.sglang import sglang_process_specs
    from stack.ports import free_port

    py = sglang_python()
    if py is None:
        print("no SGLang interpreter (bash .ci/install-sglang.sh)", file=sys.stderr)
        return 2
    out = Path(a.out)
    model = out / "tiny"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run([py, str(ROOT / "tests/sglang_cpu/build_tiny_llama.py"), str(model)], check=True, env=env)
    port = free_port()
    cfg = {
        "model": {
            "name": "tiny",
            "path": str(model),
            "page_size": 16,
            "context_length": 4096,
            "tool_call_parser": "qwen3_coder",
        },  # fmt: skip
        "launch": {
            "engine": "sglang",
            "device": "cpu",
            "python": py,
            "run_dir": str(out / "run"),
            "nodes": [{"name": "local", "host": "127.0.0.1", "gpus": 0}],
            "prefill": {"count": 1, "port": port, "disaggregation": False, "kv_events_port": None},
            "decode": {"count": 0},
            "router": False,
        },
    }
    [spec] = sglang_process_specs(cfg)
    spec.env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = start(spec, out / "logs")
    res: dict = {"argv": spec.argv}
    try:
        wait_ready([proc], timeout=600)
        res["ready_s"] = time.monotonic() - t0
        res["idle"] = _summary([_health(url) for _ in range(a.calls)])
        stop = threading.Event()

        def client() -> None:
            body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
            while not stop.is_set():
                _post(url + "/generate", body)

        threads = [threading.Thread(target=client, daemon=True) for _ in range(a.busy)]
        for t in threads:
            t.start()
        time.sleep(3)
        res["busy"] = _summary([_health(url) for _ in range(a.calls)])
        stop.set()
        for t in threads:
            t.join(300)
    finally:
        stop_all([proc])
    (out / "health.json").write_text(json.dumps(res, indent=1))
    print(f"ready in {res['ready_s']:.1f} s")
    for k in ("idle", "busy"):
        s = res[k]
        print(f"/health {k:4s} ({s['n']} calls): median {s['median_s']:.3f} s, max {s['max_s']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
