"""Fuzzed client input never yields a 500; the `smetric router` command serves end to end."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import orjson
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stack.models.tiny import build_tiny_model
from stack.ports import free_port
from stack.worker.fake import FakeWorker, ServerThread
from support.router_harness import Cluster

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cluster(model_dir):
    c = Cluster(model_dir, n_prefill=2, n_decode=1)
    yield c
    c.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "assistant", "system", "tool"]) | json_values,
        "content": st.text(max_size=50) | json_values,
        "tool_calls": json_values,
    },
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "messages": st.lists(message, max_size=4) | json_values,
        "prompt": st.text(max_size=30) | st.lists(st.integers(-3, 500), max_size=20) | json_values,
        "text": st.text(max_size=30) | json_values,
        "input_ids": st.lists(st.integers(-3, 500), max_size=20) | json_values,
        "stream": st.booleans() | json_values,
        "max_tokens": st.integers(-2, 100) | json_values,
        "model": st.text(max_size=10) | json_values,
        "tools": json_values,
        "sampling_params": json_values,
        "chat_template_kwargs": json_values,
    },
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/generate"]), body=bodies)
def test_fuzzed_bodies_never_500(cluster, path, body):
    r = cluster.client.post(path, content=orjson.dumps(body))
    assert r.status_code in (200, 400, 404, 413), (r.status_code, r.text)
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        if r.status_code == 404:  # a model the router does not serve (router.models)
            assert err["code"] == "model_not_found" and body["model"] != "tiny"
    elif body.get("stream") is True:
        assert r.headers["content-type"].startswith("text/event-stream")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64))
def test_fuzzed_bytes_never_500(cluster, raw):
    r = cluster.client.post("/v1/chat/completions", content=raw)
    assert r.status_code in (200, 400), (r.status_code, r.text)


def test_smetric_router_command_serves(tmp_path, model_dir):
    p = ServerThread(FakeWorker(mode="prefill", name="p")).start()
    d = ServerThread(FakeWorker(mode="decode", name="d", tokens=3)).start()
    port = free_port()
    cfg = {
        "model": {"name": "tiny", "path": str(model_dir), "page_size": 16, "context_length": 4096},
        "router": {"port": port, "log_level": "warning"},
        "prefill": [{"url": p.url, "bootstrap_port": 9001}],
        "decode": [{"url": d.url}],
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "stack.cli", "router", "--config", str(tmp_path / "r.yaml")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() - t0 < 30, "router did not come up"
            time.sleep(0.1)
        r = httpx.post(
            url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        p.stop()
        d.stop()


def test_router_command_rejects_bad_config(tmp_path):
    (tmp_path / "bad.yaml").write_text("router: {port: 'x'}\nprefill: [{url: 'nope'}]\n")
    r = subprocess.run(
        [sys.executable, "-m", "stack.cli", "router", "--config", str(tmp_path / "bad.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "router.port" in r.stderr and "prefill.0.url" in r.stderr and "Traceback" not in r.stderr
