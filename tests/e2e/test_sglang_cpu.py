"""CPU integration tier: real SGLang prefill + decode workers behind our router.

Selected with `pytest -m sglang` (`scripts/test.sh` runs it after the main suite; CI too).
Without an interpreter that has sglang every check skips with the reason on a developer's
machine, and fails under `CI=true`: `bash .ci/install-sglang.sh` installs it into
/opt/sglang-venv (see docs/deploy/cpu-tier.md).

What runs, one group at a time so that few CPU workers share the two cores:
a tiny random-weight Llama built here (tests/sglang_cpu/build_tiny_llama.py, no hub); first one
plain (non-disaggregated) SGLang worker alone, which answers every request the checks compare
and is then stopped (`reference`); then two real SGLang prefill workers and one decode worker
over `mooncake_tcp`, KV events on, started from the very ProcessSpecs `stack.launch.sglang`
builds for `launch.device: cpu`, with `smetric router` in front reading the router config that
`resolved_config` derives (`TestPDStack`; its last check SIGKILLs a prefill worker); then a
HiCache -> Mooncake pair (`TestHiCache`). The test-only sgl_kernel stand-in
(tests/sglang_cpu/shim) is put on the workers' PYTHONPATH.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parents[1]  # tests/
sys.path.insert(0, str(HERE / "sglang_cpu"))
from _locate import sglang_python, skip_or_fail, skip_reason  # noqa: E402

pytestmark = pytest.mark.sglang

ADMIN = "sglang-tier-admin-token"
PAGE = 16
# Generous on purpose: CI runs this on 2 shared cores at load average 10-16, where one CPU
# worker takes 30-45 s to start alone and a 16-token request can take tens of seconds.
REQUEST_TIMEOUT_S = 300
STARTUP_TIMEOUT_S = 420


def _require_sglang() -> str:
    py = sglang_python()
    if py is None:
        skip_or_fail(skip_reason())
    r = subprocess.run(
        [py, "-c", "import mooncake.engine, transformers, torch"], capture_output=True, text=True
    )
    if r.returncode != 0:
        skip_or_fail(
            f"sglang found at {py} but not the CPU-tier extras (run .ci/install-sglang.sh without --args): {r.stderr[-300:]}"
        )
    return py


@pytest.fixture(scope="module")
def sg_python() -> str:
    return _require_sglang()


@pytest.fixture(scope="module")
def tiny_model(sg_python, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    r = subprocess.run(
        [sg_python, str(HERE / "sglang_cpu" / "build_tiny_llama.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def tier_config(py: str, model: Path, run_dir: Path, ports: dict) -> dict:
    return {
        # the parser as the shipped configs set it (configs/qwen3-coder-30b-*.yaml)
        "model": {
            "name": "tiny",
            "path": str(model),
            "page_size": PAGE,
            "context_length": 4096,
            "tool_call_parser": "qwen3_coder",
        },
        "router": {  # the router's default policy: the product's
            "host": "127.0.0.1",
            "port": ports["router"],
            "health_interval_s": 1.0,
            # SGLang's /health generates a token: on a busy 2-core machine a CPU worker can take
            # many seconds to answer it, and ejecting it for that turned requests into 503s
            # (the defaults, 5 s x 3, fit a GPU worker: test_health_answers_within_the_router_defaults).
            "health_timeout_s": 30.0,
            "health_failures": 5,
            "admin_token_env": "SMETRIC_TIER_ADMIN",
        },
        "launch": {
            "engine": "sglang",
            "device": "cpu",
            "python": py,
            "run_dir": str(run_dir),
            "nodes": [{"name": "local", "host": "127.0.0.1", "gpus": 0}],
            "prefill": {
                "count": 2,
                "port": ports["prefill"],
                "bootstrap_port": ports["bootstrap"],
                "kv_events_port": ports["kv"],
                # stride 1 leaves no kv + 1 free: the replay endpoints get a range of their own
                "kv_replay_port": ports["kv_replay"],
                "port_stride": 1,
                "transfer_backend": "mooncake_tcp",
            },
            "decode": {
                "count": 1,
                "port": ports["decode"],
                "port_stride": 1,
                "transfer_backend": "mooncake_tcp",
            },
            "mooncake_master": None,
            "router": {"command": [sys.executable, "-m", "stack.cli"], "node": "local"},
        },
    }


def single_config(cfg: dict, port: int) -> dict:
    """A plain (non-disaggregated) worker with the same model and flags: the reference."""
    c = copy.deepcopy(cfg)
    c["launch"]["prefill"] = {"count": 1, "port": port, "disaggregation": False, "kv_events_port": None}
    c["launch"]["decode"] = {"count": 0}
    c["launch"]["router"] = False
    return c


def _get(url: str, headers: dict | None = None, timeout: float = 30) -> dict:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _post(url: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _post_status(url: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, dict | str]:
    """(status, JSON body or raw text): an HTTP error answer is a result here, not an exception."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def _stream(url: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> list[str]:
    """The `data:` payloads of an event stream, up to and including `[DONE]`."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    out = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data:"):
                out.append(line[5:].strip())
                if out[-1] == "[DONE]":
                    break
    return out


def _anthropic_events(url: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> list[dict]:
    """The events of a Messages stream (``data:`` payloads as objects) up to ``message_stop``."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    out = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data:"):
                out.append(json.loads(line[5:]))
                if out[-1].get("type") in ("message_stop", "error"):
                    break
    return out


def _stream_text(payloads: list[str]) -> str:
    chunks = [json.loads(p) for p in payloads if p != "[DONE]"]
    return "".join(
        (c["choices"][0].get("delta") or {}).get("content") or "" for c in chunks if c.get("choices")
    )


def _workers(router: str) -> list[dict]:
    return _get(router + "/admin/workers", {"authorization": f"Bearer {ADMIN}"})["workers"]


def _wait_router_workers(router: str, n: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if sum(w["healthy"] for w in _workers(router)) >= n:
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise AssertionError(f"router did not see {n} healthy workers: {_workers(router)}")


def _pd_direct(prefill: str, decode: str, bootstrap_port: int, text: str, sp: dict) -> tuple[dict, dict]:
    """The dual POST SGLang's PD hand-off expects, straight to a pair (no router): (prefill, decode)."""
    body = {
        "text": text,
        "sampling_params": sp,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": random.randrange(2**63),
    }
    res: dict = {}

    def run_prefill() -> None:
        try:
            res["p"] = _post(prefill + "/generate", body)
        except Exception as e:  # surfaced below, not lost in the thread
            res["p_err"] = e

    t = threading.Thread(target=run_prefill)
    t.start()
    d = _post(decode + "/generate", body)
    t.join(REQUEST_TIMEOUT_S)
    assert "p_err" not in res, res.get("p_err")
    assert "p" in res, "the prefill half of the dual POST did not answer"
    return res["p"], d


PROMPT = (
    "You are a helpful coding agent. Read the file, fix the bug, run the tests. "
    "def main(argv):\n    return run(parse(argv))\n" * 4
)
SP = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
# every request whose answer a check compares with one plain worker's: asked of the reference
# worker first (alone), then of the PD pair through our router, sglang-router and smg
GENERATE = {
    "pd": PROMPT + " session turn prefix cache",
    "sglang-router": PROMPT + " cross-check with sglang-router",
    "smg": PROMPT + " cross-check with smg",
}
CHATS = {
    "chat": [{"role": "user", "content": PROMPT}],
    "stream": [{"role": "user", "content": PROMPT + " stream"}],
}


#: a tool whose call the tier forces (no parameters: nothing for a random model to ramble in)
TOOL_CALL_TOOLS = [
    {"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}
]


def _chat_body(messages: list[dict], **kw) -> dict:
    return {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, **kw}


# agent APIs: a Claude Code-like tool_use -> tool_result turn, a Codex-like function call turn
ANTHROPIC_BODY = {
    "model": "tiny",
    "max_tokens": 8,
    "temperature": 0,
    "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
    "tools": [
        {
            "name": "read_file",
            "description": "Read a file",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
        }
    ],
    "messages": [
        {"role": "user", "content": PROMPT},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "main.py"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "def main(): pass"}],
        },
    ],
}
COUNT_BODY = {k: v for k, v in ANTHROPIC_BODY.items() if k not in ("max_tokens", "temperature")}
RESPONSES_BODY = {
    "model": "tiny",
    "max_output_tokens": 8,
    "temperature": 0,
    "store": False,
    "instructions": "You are a coding agent.",
    "tools": [{"type": "function", "name": "ls", "parameters": {"type": "object", "properties": {}}}],
    "input": [
        {"role": "user", "content": PROMPT},
        {"type": "function_call", "call_id": "call_1", "name": "ls", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py b.py"},
    ],
}


def _anthropic_input(usage: dict) -> int:
    return usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)


def _responses_text(r: dict) -> str:
    return "".join(
        part.get("text", "")
        for item in r["output"]
        if item.get("type") == "message"
        for part in item["content"]
    )


@pytest.fixture(scope="module")
def reference(sg_python, tiny_model, tmp_path_factory) -> dict:
    """One plain SGLang worker, alone: its greedy answers to every compared request; then stopped.

    Asked before the PD stack starts, so at most three CPU workers ever run at once."""
    from harness import start, stop_all, wait_ready

    from stack.launch.sglang import sglang_process_specs
    from stack.ports import free_port

    run_dir = tmp_path_factory.mktemp("sglang-reference")
    port = free_port()
    cfg = single_config(tier_config(sg_python, tiny_model, run_dir, _ports()), port)
    [spec] = sglang_process_specs(cfg)
    spec.name = "single-0"
    spec.env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    t0 = time.monotonic()
    proc = start(spec, run_dir / "logs")
    try:
        wait_ready([proc], timeout=STARTUP_TIMEOUT_S)
        startup_s = time.monotonic() - t0
        url = f"http://127.0.0.1:{port}"
        out = {"startup_s": startup_s, "generate": {}, "chat": {}}
        for name, text in GENERATE.items():
            out["generate"][name] = _post(url + "/generate", {"text": text, "sampling_params": SP})[
                "output_ids"
            ]
        for name, messages in CHATS.items():
            r = _post(url + "/v1/chat/completions", _chat_body(messages))
            out["chat"][name] = r["choices"][0]["message"]["content"]
        out["messages"] = _post(url + "/v1/messages", ANTHROPIC_BODY)
        out["count_tokens"] = _post(url + "/v1/messages/count_tokens", COUNT_BODY)
        out["responses"] = _post(url + "/v1/responses", RESPONSES_BODY)
        return out
    finally:
        stop_all([proc])


def _ports() -> dict:
    """Every port the tier's PD stack binds, each pool's run of two (``port_stride: 1``) free and
    below the kernel's ephemeral range (a port in that range can be taken by any outgoing
    connection before the worker binds it: a KV-event endpoint at 33897 once was)."""
    from stack.ports import free_port, free_port_run

    return {
        "router": free_port(),
        "prefill": free_port_run(2),
        "bootstrap": free_port_run(2),
        "kv": free_port_run(2),
        "kv_replay": free_port_run(2),
        "decode": free_port_run(2),
    }


@pytest.fixture(scope="class")
def stack_up(sg_python, tiny_model, reference, tmp_path_factory):
    from harness import start, stop_all, wait_ready

    from stack.launch.sglang import resolved_config, router_config_path, sglang_process_specs

    run_dir = tmp_path_factory.mktemp("sglang-run")
    ports = _ports()
    cfg = tier_config(sg_python, tiny_model, run_dir, ports)
    specs = sglang_process_specs(cfg)
    path = Path(router_config_path(cfg))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(resolved_config(cfg), sort_keys=False))
    logs = run_dir / "logs"
    workers = [s for s in specs if s.role in ("prefill", "decode")]
    for s in workers:  # three CPU workers on two cores: one compute thread each
        s.env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    t0 = time.monotonic()
    procs = [start(s, logs) for s in workers]
    router = None
    try:
        wait_ready(procs, timeout=STARTUP_TIMEOUT_S)
        startup_s = time.monotonic() - t0
        rspec = next(s for s in specs if s.role == "router")
        router = start(rspec, logs, {"SMETRIC_TIER_ADMIN": ADMIN})
        wait_ready([router], timeout=120)
        _wait_router_workers(f"http://127.0.0.1:{ports['router']}", 3)
        yield {
            "cfg": cfg,
            "specs": specs,
            "ports": ports,
            "router": f"http://127.0.0.1:{ports['router']}",
            "router_proc": router,
            "prefill": [f"http://127.0.0.1:{ports['prefill'] + i}" for i in range(2)],
            "decode": f"http://127.0.0.1:{ports['decode']}",
            "ref": reference,
            "startup_s": startup_s,
            "procs": procs,
            "logs": logs,
        }
    finally:
        stop_all(([router] if router else []) + procs)


@contextlib.contextmanager
def _peer_router(name: str, argv: list[str], port: int, logs: Path):
    """A peer router process (sglang-router, smg) in front of the pair, ready to serve /generate."""
    log_path = logs / f"{name}.log"
    log = open(log_path, "wb")
    p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        # /health can answer before the workers are registered: wait for a served request
        deadline = time.monotonic() + 180
        probe = {"text": "ready?", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        last = None
        while True:
            if p.poll() is not None:
                raise AssertionError(f"{name} exited with {p.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                last = _post_status(url + "/generate", probe, timeout=60)
                if last[0] == 200:
                    break
            except Exception as e:  # not listening yet
                last = repr(e)
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{name} did not serve within 180 s (last: {last}):\n{log_path.read_text()[-3000:]}"
                )
            time.sleep(1.0)
        yield url
    finally:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(15)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)  # a loaded 2-core machine took longer than 5 s to reap it once
        log.close()


def _peer_pd_args(stack_up: dict, port: int) -> list[str]:
    bp = stack_up["ports"]["bootstrap"]
    return [
        "--pd-disaggregation",
        "--prefill",
        stack_up["prefill"][0],
        str(bp),
        "--prefill",
        stack_up["prefill"][1],
        str(bp + 1),
        "--decode",
        stack_up["decode"],
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefill-policy",
        "cache_aware",
        # as for our router: SGLang's /health generates a token, slow on busy CPU workers, and
        # a 5 s health timeout ejected both prefill workers (503 "No prefill workers available")
        "--health-check-timeout-secs",
        "30",
        "--health-failure-threshold",
        "5",
        # re-check a worker that is not registered yet every second, not every 30 s (both
        # routers' default), which was most of the cross-check's time
        "--worker-startup-check-interval",
        "1",
    ]


def _require_module(py: str, module: str, what: str) -> None:
    r = subprocess.run([py, "-c", f"import {module}"], capture_output=True, text=True)
    if r.returncode != 0:
        skip_or_fail(
            f"{what} is not installed in {py} (.ci/install-sglang.sh installs it): {r.stderr[-300:]}"
        )


class TestPDStack:
    """Two real prefill workers and one decode worker (mooncake_tcp, KV events) behind our router."""

    def test_startup_time_recorded(self, stack_up):
        print(
            f"\nreference worker ready in {stack_up['ref']['startup_s']:.0f} s (alone); "
            f"PD stack (2 P + 1 D) ready in {stack_up['startup_s']:.0f} s"
        )
        assert stack_up["startup_s"] < STARTUP_TIMEOUT_S

    def test_chat_completion_equals_single_worker(self, stack_up):
        r = _post(stack_up["router"] + "/v1/chat/completions", _chat_body(CHATS["chat"]))
        assert r["object"] == "chat.completion"
        assert r["usage"]["completion_tokens"] >= 1
        assert r["choices"][0]["message"]["content"] == stack_up["ref"]["chat"]["chat"], r

    def test_streamed_chat_completion_equals_single_worker(self, stack_up):
        payloads = _stream(
            stack_up["router"] + "/v1/chat/completions", _chat_body(CHATS["stream"], stream=True)
        )
        assert payloads and payloads[-1] == "[DONE]", payloads
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert not [c for c in chunks if "error" in c], chunks
        finishes = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
        assert any(f in ("length", "stop") for f in finishes), chunks
        assert _stream_text(payloads) == stack_up["ref"]["chat"]["stream"]

    def test_pd_tokens_equal_single_worker(self, stack_up):
        """Greedy decode through P->D (KV over mooncake_tcp) equals one plain worker token for token."""
        ref = stack_up["ref"]["generate"]["pd"]
        text = GENERATE["pd"]
        got = _post(stack_up["router"] + "/generate", {"text": text, "sampling_params": SP})
        assert got["output_ids"] == ref, (got, ref)
        # and the same directly against the pair (our router out of the loop)
        _, d = _pd_direct(
            stack_up["prefill"][0], stack_up["decode"], stack_up["ports"]["bootstrap"], text, SP
        )
        assert d["output_ids"] == ref

    def test_failed_hand_off_is_an_error_the_router_reads(self, stack_up):
        """A decode worker whose prefill twin cannot be reached (the hand-off's bootstrap address
        answers nothing) gives up and answers as the emulator does: a stream gets an error event
        with a 5xx code, then ``[DONE]``; a collected answer a 5xx error body. The router's
        check reads that first event as a failure of the pair (``pd.failure_of``), which it
        retries on another prefill worker instead of passing on an empty answer."""
        from stack.decode_router.sse import failure_of
        from stack.ports import free_port

        boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": free_port()}
        body = _chat_body(CHATS["chat"])
        res: dict = {}

        def collected() -> None:
            res["collected"] = _post_status(
                stack_up["decode"] + "/v1/chat/completions",
                {**body, **boot, "bootstrap_room": random.randrange(2**63)},
            )

        t = threading.Thread(target=collected)
        t.start()
        payloads = _stream(
            stack_up["decode"] + "/v1/chat/completions",
            {**body, **boot, "bootstrap_room": random.randrange(2**63), "stream": True},
        )
        t.join(REQUEST_TIMEOUT_S)
        assert payloads[-1] == "[DONE]" and len(payloads) == 2, payloads
        got = failure_of(json.loads(payloads[0]))
        assert got is not None and got[0] >= 500, payloads
        status, err = res["collected"]
        assert status >= 500 and isinstance(err, dict) and err.get("message"), (status, err)
        # the pair serves on
        assert _post(stack_up["router"] + "/v1/chat/completions", body)["choices"][0]["message"]["content"]

    def test_anthropic_messages_equal_single_worker(self, stack_up):
        """/v1/messages through our router to the real PD pair == one real worker (greedy), and
        our router's count_tokens == SGLang's own."""
        ref = stack_up["ref"]["messages"]
        got = _post(stack_up["router"] + "/v1/messages", ANTHROPIC_BODY)
        assert got["type"] == "message" and got["content"] == ref["content"], (got, ref)
        assert got["stop_reason"] == ref["stop_reason"]
        assert _anthropic_input(got["usage"]) == _anthropic_input(ref["usage"])
        assert got["usage"]["output_tokens"] == ref["usage"]["output_tokens"]
        ours = _post(stack_up["router"] + "/v1/messages/count_tokens", COUNT_BODY)
        assert ours == stack_up["ref"]["count_tokens"]
        assert ours["input_tokens"] == _anthropic_input(ref["usage"])

    def test_responses_equal_single_worker(self, stack_up):
        """/v1/responses (stateless) through our router to the real PD pair == one real worker."""
        ref = stack_up["ref"]["responses"]
        got = _post(stack_up["router"] + "/v1/responses", RESPONSES_BODY)
        assert got["object"] == "response" and _responses_text(got) == _responses_text(ref), (got, ref)
        assert got["status"] == ref["status"]
        assert got["usage"]["input_tokens"] == ref["usage"]["input_tokens"]

    # -- tool calls: the workers run --tool-call-parser qwen3_coder, as the shipped configs set it.
    # A random-weight model does not choose to call a tool, so each request forces one
    # (tool_choice required / named; Anthropic any / tool): SGLang constrains the output to the
    # parser's format and answers a call. The call's name is what the constraint fixes; its
    # arguments are whatever the random model writes inside it (often cut by max_tokens), so the
    # checks hold the name and the shape, and that the arguments are a JSON object.
    def test_tool_calls_chat(self, stack_up):
        url = stack_up["router"] + "/v1/chat/completions"
        body = _chat_body(
            [{"role": "user", "content": PROMPT + " list the files"}], tools=TOOL_CALL_TOOLS, max_tokens=24
        )
        r = _post(url, {**body, "tool_choice": "required"})
        choice = r["choices"][0]
        [call] = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "ls", r
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
        assert choice["finish_reason"] in ("tool_calls", "length"), r
        payloads = _stream(
            url, {**body, "tool_choice": {"type": "function", "function": {"name": "ls"}}, "stream": True}
        )
        assert payloads[-1] == "[DONE]", payloads
        deltas = [
            tc
            for c in (json.loads(p) for p in payloads[:-1])
            for ch in c.get("choices") or []
            for tc in (ch.get("delta") or {}).get("tool_calls") or []
        ]
        names = [tc["function"]["name"] for tc in deltas if (tc.get("function") or {}).get("name")]
        assert names == ["ls"] and deltas[0]["id"].startswith("call_"), payloads

    def test_tool_calls_anthropic_messages(self, stack_up):
        url = stack_up["router"] + "/v1/messages"
        body = {
            "model": "tiny",
            "max_tokens": 24,
            "temperature": 0,
            "tools": [{"name": "ls", "input_schema": {"type": "object", "properties": {}}}],
            "messages": [{"role": "user", "content": PROMPT + " list the files, Messages"}],
        }
        r = _post(url, {**body, "tool_choice": {"type": "any"}})
        [block] = [b for b in r["content"] if b["type"] != "text" or b["text"]]
        assert block["type"] == "tool_use" and block["name"] == "ls" and block["id"], r
        assert isinstance(block["input"], dict) and r["stop_reason"] in ("tool_use", "max_tokens"), r
        events = _anthropic_events(
            url, {**body, "tool_choice": {"type": "tool", "name": "ls"}, "stream": True}
        )
        starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
        assert [b["name"] for b in starts if b["type"] == "tool_use"] == ["ls"], events
        assert events[-1]["type"] == "message_stop", events

    def test_health_answers_within_the_router_defaults(self, stack_up):
        """Real SGLang's /health runs a one-token forward and answers after >= 1 s (it polls once
        a second): the router's default health timeout (docs/deploy/bare-metal.md, "Health and readiness")
        must leave room above that floor. Measured on each idle worker of the pair."""
        from stack.config import RouterConfig

        took = []
        for w in [*stack_up["prefill"], stack_up["decode"]]:
            for _ in range(2):
                t0 = time.monotonic()
                with urllib.request.urlopen(w + "/health", timeout=60) as r:
                    assert r.status == 200
                took.append(time.monotonic() - t0)
        print(f"\n/health of the real workers: {', '.join(f'{x:.3f}' for x in took)} s")
        assert min(took) >= 0.9  # the floor the default must clear
        assert max(took) < RouterConfig().health_timeout_s

    def test_router_index_fed_by_real_kv_events(self, stack_up):
        events_chat = [{"role": "user", "content": PROMPT + " events"}]
        _post(stack_up["router"] + "/v1/chat/completions", _chat_body(events_chat, max_tokens=2))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ws = [w for w in _workers(stack_up["router"]) if w["role"] == "prefill"]
            if any(w.get("index_blocks", 0) > 0 and w.get("kv_source") == "events" for w in ws):
                break
            time.sleep(0.5)
        assert any(w.get("kv_source") == "events" for w in ws), ws
        assert sum(w.get("index_blocks", 0) for w in ws) > 0, ws

    def test_kv_event_gap_recovered_from_real_sglang_replay(self, stack_up):
        """A real prefill worker's replay endpoint (``replay_endpoint`` in --kv-events-config,
        as the launcher sets it) covers a gap: a subscriber that loses one live batch asks for
        it and gets it back in order, without dropping the index; the router's own
        subscriber (started after the worker) replayed at start too."""
        import asyncio

        from stack.kv_tier.events import KVEventSubscriber

        ports = stack_up["ports"]
        applied: list[int] = []
        gaps: list[int] = []

        class LosesOne(KVEventSubscriber):
            lost = False
            replaying = False

            async def _recover(self, start, startup=False):
                self.replaying = True
                try:
                    await super()._recover(start, startup)
                finally:
                    self.replaying = False

            def _apply(self, seq, payload):
                if not self.lost and not self.replaying and self.received >= 1:
                    self.lost = True  # as if the network lost this live batch
                    return
                super()._apply(seq, payload)
                applied.append(seq)

        async def go() -> LosesOne:
            sub = LosesOne(
                f"tcp://127.0.0.1:{ports['kv']}",
                "kv",
                lambda b: None,
                lambda: gaps.append(1),
                replay=f"tcp://127.0.0.1:{ports['kv_replay']}",
                replay_timeout_s=10.0,
            )
            sub.start()
            await asyncio.sleep(1.0)
            for i in range(4):  # each a new prompt on the pair of prefill 0: new blocks, new batches
                text, sp = PROMPT + f" replay {i} " * 8, {"max_new_tokens": 1, "temperature": 0}
                await asyncio.to_thread(
                    _pd_direct, stack_up["prefill"][0], stack_up["decode"], ports["bootstrap"], text, sp
                )
                await asyncio.sleep(0.5)
            deadline = asyncio.get_running_loop().time() + 30
            while sub.recovered_gaps == 0 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.2)
            await sub.stop()
            return sub

        sub = asyncio.run(go())
        assert sub.lost and sub.recovered_gaps == 1 and sub.dropped_gaps == 0 and not gaps, (
            applied,
            sub.replayed,
        )
        live = [s for s in applied if s > applied[0]]
        assert live == list(range(applied[0] + 1, applied[0] + 1 + len(live)))  # in order, none missing

    def test_kv_events_wire_format_from_real_worker(self, stack_up):
        """Subscribe to a real prefill worker directly and decode with stack.kv_tier.events."""
        import zmq

        from stack.kv_tier.events import BlockStored, decode_payload

        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{stack_up['ports']['kv'] + 1}")
        time.sleep(1.0)  # slow joiner
        try:
            # a plain request to a PD prefill worker needs a decode twin: send the pair directly
            _pd_direct(
                stack_up["prefill"][1],
                stack_up["decode"],
                stack_up["ports"]["bootstrap"] + 1,
                PROMPT + " direct subscriber " * 8,
                {"max_new_tokens": 1, "temperature": 0},
            )
            stored = []
            poller = zmq.Poller()
            poller.register(sub, zmq.POLLIN)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not stored:
                if poller.poll(500):
                    parts = sub.recv_multipart()
                    batch = decode_payload(parts[-1])
                    stored += [e for e in batch.events if isinstance(e, BlockStored)]
            assert stored, "no BlockStored event from the real prefill worker"
            assert all(e.block_size == PAGE for e in stored)
        finally:
            sub.close(0)

    def test_follow_up_goes_to_prefix_holder(self, stack_up):
        router = stack_up["router"]

        def prefill_view() -> dict:
            return {w["url"]: w for w in _workers(router) if w["role"] == "prefill"}

        sys_msg = {"role": "system", "content": "You are a helpful coding agent. " * 12}
        turn1 = [sys_msg, {"role": "user", "content": "Read the file, fix the bug, run the tests. " * 10}]
        before = prefill_view()
        r1 = _post(router + "/v1/chat/completions", _chat_body(turn1, max_tokens=4))
        mid = prefill_view()
        first = [u for u in mid if mid[u]["dispatched"] > before[u]["dispatched"]]
        assert len(first) == 1
        # wait until turn 1's KV events have reached the router's index (not a fixed sleep:
        # on a loaded machine they can take seconds)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if prefill_view()[first[0]].get("index_blocks", 0) > before[first[0]].get("index_blocks", 0):
                break
            time.sleep(0.25)
        turn2 = turn1 + [
            {"role": "assistant", "content": r1["choices"][0]["message"]["content"] or "ok"},
            {"role": "user", "content": "Now run the tests again."},
        ]
        _post(router + "/v1/chat/completions", _chat_body(turn2, max_tokens=4))
        after = prefill_view()
        second = [u for u in after if after[u]["dispatched"] > mid[u]["dispatched"]]
        assert second == first, (before, mid, after)

    def test_real_sglang_router_in_front_of_the_same_pair(self, stack_up, sg_python):
        """Cross-check of our PD hand-off: sglang-router 0.3.2 gives the same greedy tokens."""
        from stack.ports import free_port

        _require_module(sg_python, "sglang_router", "sglang-router")
        port = free_port()
        argv = [sg_python, "-m", "sglang_router.launch_router", *_peer_pd_args(stack_up, port)]
        self._cross_check(stack_up, "sglang-router", argv, port)

    def test_smg_gateway_in_front_of_the_same_pair(self, stack_up, sg_python):
        """The same cross-check with smg 1.13 (the current SGLang model gateway, successor of
        sglang-router on PyPI), over HTTP in PD mode."""
        from stack.ports import free_port

        _require_module(sg_python, "smg", "smg")
        port = free_port()
        argv = [
            sg_python,
            "-m",
            "smg.launch_router",
            *_peer_pd_args(stack_up, port),
        ]
        self._cross_check(stack_up, "smg", argv, port)

    @staticmethod
    def _cross_check(stack_up: dict, name: str, argv: list[str], port: int) -> None:
        text = GENERATE[name]
        ref = stack_up["ref"]["generate"][name]
        with _peer_router(name, argv, port, stack_up["logs"]) as url:
            # what is compared is the tokens, not the peer's health checks: on a loaded machine
            # they can eject a slow worker for a while (503), so a 503 is asked again
            deadline = time.monotonic() + 120
            while True:
                status, theirs = _post_status(url + "/generate", {"text": text, "sampling_params": SP})
                if status != 503 or time.monotonic() > deadline:
                    break
                time.sleep(2.0)
            log_tail = (stack_up["logs"] / f"{name}.log").read_text(errors="replace")[-3000:]
            assert status == 200, (name, status, theirs, log_tail)
        ours = _post(stack_up["router"] + "/generate", {"text": text, "sampling_params": SP})
        assert theirs["output_ids"] == ref, (name, theirs, ref)
        assert ours["output_ids"] == ref, (ours, ref)

    def test_dashboard_returns_data_from_real_sglang(self, stack_up, tmp_path):
        """Every panel of deploy/grafana/stack-dashboard.json returns data from a real Prometheus
        scraping these real SGLang workers, a router with client keys in front of them and a
        Mooncake master (tests/sglang_cpu/dashboard_check.py); the alerting rules load there."""
        from dashboard_check import run_dashboard_check

        from stack import dashboard

        run = run_dashboard_check(stack_up, tmp_path)
        failed = {t: r.reasons for t, r in run.results.items() if not r.ok}
        assert not failed, (failed, run.statuses, run.probe)
        assert sorted(run.results) == sorted({q.panel for q in dashboard.queries(dashboard.load())})
        assert run.targets == {"smetric-router": 1, "smetric-workers": 3, "smetric-mooncake": 1}
        # SGLang labels its series by model and rank only: the scrape adds the worker's URL
        assert {s["worker"] for s in run.worker_series} == {*stack_up["prefill"], stack_up["decode"]}
        assert run.statuses.get(200, 0) >= 6 and run.statuses.get(400, 0) >= 1, run.statuses
        assert run.rules_health and set(run.rules_health.values()) == {"ok"}, run.rules_health

    def test_worker_drain_on_real_sglang(self, stack_up):
        """Drain a real prefill worker while a request is in its prefill (POST
        /admin/workers/drain): that request is answered, the worker leaves the pool, the next
        request is served by the other worker; then it is added back and serves again."""
        router = stack_up["router"]
        auth = {"authorization": f"Bearer {ADMIN}", "content-type": "application/json"}

        def admin(path: str, body: dict) -> tuple[int, dict]:
            req = urllib.request.Request(router + path, data=json.dumps(body).encode(), headers=auth)
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        body = _chat_body([{"role": "user", "content": _words(3000, 420)}], max_tokens=8)
        held: dict = {}
        t = threading.Thread(
            target=lambda: held.update(r=_post_status(router + "/v1/chat/completions", body)), daemon=True
        )
        t.start()
        busy, deadline = None, time.monotonic() + 120
        while busy is None and time.monotonic() < deadline:
            b = [w for w in _workers(router) if w["role"] == "prefill" and w["queued_tokens"] > 0]
            busy = b[0] if b else time.sleep(0.05)
        assert busy is not None, f"no prefill in flight within 120 s: {held}"
        status, info = admin("/admin/workers/drain", {"url": busy["url"], "role": "prefill"})
        assert status == 202 and info["draining"]["draining"] is True, info
        t.join(REQUEST_TIMEOUT_S)
        assert held["r"][0] == 200, held  # the request it held was answered
        deadline = time.monotonic() + 60
        while any(w["url"] == busy["url"] for w in _workers(router)):
            assert time.monotonic() < deadline, "the drained worker never left the pool"
            time.sleep(0.1)
        other = next(w for w in _workers(router) if w["role"] == "prefill")
        n = other["dispatched"]
        assert _post_status(router + "/v1/chat/completions", _chat_body(CHATS["chat"]))[0] == 200
        assert next(w for w in _workers(router) if w["url"] == other["url"])["dispatched"] == n + 1
        add = {k: busy[k] for k in ("url", "bootstrap_port", "kv_events", "kv_replay") if busy.get(k)}
        status, info = admin("/admin/workers", {"role": "prefill", **add})
        assert status == 201, info
        deadline = time.monotonic() + 90
        while not any(w["url"] == busy["url"] and w["healthy"] for w in _workers(router)):
            assert time.monotonic() < deadline, "the worker added back is not healthy"
            time.sleep(0.5)
        print(
            f"\nreal SGLang: prefill worker {busy['url']} drained with its request answered, and added back"
        )

    def test_prefill_killed_mid_request(self, stack_up):
        """SIGKILL a real prefill worker (its whole process group) while requests are in flight
        through our router: every client gets an answer (served, possibly by a retry on the
        other prefill worker, or a clean OpenAI-shaped error; a stream ends with [DONE]), none
        hangs, no request stays stuck on the decode worker, and the router keeps serving.
        Last in the class: the stack is torn down after it."""
        router = stack_up["router"]
        results: dict[int, tuple] = {}
        # long, distinct prompts (~2.5k tokens each) so that prefills queue up on both workers
        bodies = [
            _chat_body([{"role": "user", "content": _words(1000 + i, 420)}], max_tokens=32) for i in range(5)
        ]
        bodies[-1] = {**bodies[-1], "max_tokens": 64, "stream": True}

        def call(i: int) -> None:
            url = router + "/v1/chat/completions"
            try:
                if bodies[i].get("stream"):
                    results[i] = ("stream", 200, _stream(url, bodies[i]))
                else:
                    results[i] = ("json", *_post_status(url, bodies[i]))
            except Exception as e:
                results[i] = ("exc", None, repr(e))

        threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(bodies))]
        for t in threads:
            t.start()
        victim = None
        deadline = time.monotonic() + 120
        while victim is None and time.monotonic() < deadline:
            busy = [w for w in _workers(router) if w["role"] == "prefill" and w["queued_tokens"] > 0]
            if busy:
                victim = max(busy, key=lambda w: w["queued_tokens"])
            else:
                time.sleep(0.05)
        assert victim is not None, f"no prefill in flight within 120 s: {results}"
        proc = next(
            p
            for p in stack_up["procs"]
            if p.spec.role == "prefill" and p.spec.ready_url.startswith(victim["url"])
        )
        os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(30)
        t_kill = time.monotonic()
        for t in threads:
            t.join(max(1.0, t_kill + REQUEST_TIMEOUT_S + 30 - time.monotonic()))
        hung = [i for i, t in enumerate(threads) if t.is_alive()]
        assert not hung, (
            f"requests {hung} hung after the prefill worker was killed: {results}\n{_tails(stack_up)}"
        )
        served = errors = 0
        for i, (kind, status, body) in sorted(results.items()):
            assert kind != "exc", (
                f"request {i} did not get an HTTP answer: {body}\n{results}\n{_tails(stack_up)}"
            )
            if kind == "stream":
                assert body and body[-1] == "[DONE]", f"stream {i} did not end with [DONE]: {body}"
                events = [json.loads(p) for p in body[:-1]]
                if any("error" in e for e in events):
                    err = next(e for e in events if "error" in e)["error"]
                    assert isinstance(err.get("message"), str), err
                    errors += 1
                else:
                    assert any(
                        c["choices"][0].get("finish_reason") in ("length", "stop")
                        for c in events
                        if c.get("choices")
                    ), events
                    served += 1
            elif status == 200:
                assert isinstance(body["choices"][0]["message"]["content"], str), body
                served += 1
            else:
                assert status in (502, 503, 504), (i, status, body)
                assert isinstance(body, dict) and isinstance(body["error"]["message"], str), (i, status, body)
                errors += 1
        print(
            f"\nSIGKILLed {victim['url']} with {victim['queued_tokens']} prompt tokens queued: "
            f"{served} served, {errors} clean errors, 0 hung ({time.monotonic() - t_kill:.1f} s to settle)"
        )
        assert stack_up["router_proc"].alive(), "the router died with the prefill worker"
        # the router keeps serving: from the surviving prefill worker, or a clean 503
        status, body = _post_status(router + "/v1/chat/completions", _chat_body(CHATS["chat"]))
        if status == 200:
            assert body["choices"][0]["message"]["content"] == stack_up["ref"]["chat"]["chat"], body
        else:
            assert status == 503 and isinstance(body["error"]["message"], str), (status, body)
        # no lost request: nothing stays queued or in flight in the router's accounting, and the
        # decode worker itself (its /v1/loads, polled by the router) drains to idle
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ws = _workers(router)
            live = [w for w in ws if w["url"] != victim["url"]]
            if all(w["inflight"] == 0 and w["queued_tokens"] == 0 for w in live) and all(
                w["polled"]["running"] + w["polled"]["waiting"] == 0 for w in live
            ):
                break
            time.sleep(1.0)
        assert all(w["inflight"] == 0 and w["queued_tokens"] == 0 for w in live), ws
        assert all(w["polled"]["running"] + w["polled"]["waiting"] == 0 for w in live), ws
        # the killed worker is ejected: by its failed calls, else by its health checks (5 in a
        # row at 1 s here), which may still be running when the others have settled
        deadline = time.monotonic() + 60
        while (dead := next(w for w in _workers(router) if w["url"] == victim["url"]))["healthy"]:
            assert time.monotonic() < deadline, dead
            time.sleep(0.5)


def _tails(stack: dict, n: int = 6000) -> str:
    """The last ``n`` characters of the router's and every worker's log: what a failed fault
    check needs to be read after the run (the stack is torn down with its run directory)."""
    procs = [stack["router_proc"], *stack["procs"]]
    return "\n".join(f"--- {p.spec.name} ---\n{p.tail(n)}" for p in procs)


# ---------------------------------------------------------------------------------------------
# HiCache: device -> host -> Mooncake store, against a real mooncake_master

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def _words(seed: int, n: int = 60) -> str:
    r = random.Random(seed)
    return " ".join(r.choice(WORDS) + str(r.randrange(100)) for _ in range(n))


@pytest.fixture(scope="class")
def hicache_pair(sg_python, tiny_model, tmp_path_factory):
    """A PD pair whose prefill worker runs HiCache with the Mooncake store, as in production.

    Prefill: `--enable-hierarchical-cache --hicache-ratio 2 --hicache-io-backend direct
    --hicache-storage-backend mooncake`, KV events on, device pool 1024 tokens (host pool 2x),
    a 256 MiB Mooncake store behind a real mooncake_master; decode over mooncake_tcp. The prefill
    needs the test-only HiCache CPU patch (tests/sglang_cpu/shim/sitecustomize.py).
    """
    from harness import start, stop_all, wait_ready

    from stack.launch.sglang import sglang_process_specs
    from stack.ports import free_port

    master_bin = Path(sg_python).parent / "mooncake_master"
    if not master_bin.exists():
        pytest.skip(f"no mooncake_master next to {sg_python} (mooncake-transfer-engine-non-cuda)")
    run_dir = tmp_path_factory.mktemp("hicache-run")
    cfg = {
        "model": {"name": "tiny", "path": str(tiny_model), "page_size": PAGE, "context_length": 4096},
        "launch": {
            "engine": "sglang",
            "device": "cpu",
            "python": sg_python,
            "nodes": [{"name": "local", "host": "127.0.0.1", "gpus": 0}],
            "prefill": {
                "count": 1,
                "port": free_port(),
                "bootstrap_port": free_port(),
                "kv_events_port": free_port(),
                "transfer_backend": "mooncake_tcp",
                "max_total_tokens": 1024,
                "hicache": {"ratio": 2, "storage_backend": "mooncake"},
                "extra_args": ["--enable-cache-report"],
            },
            "decode": {"count": 1, "port": free_port(), "transfer_backend": "mooncake_tcp"},
            "mooncake_master": {
                "binary": str(master_bin),
                "rpc_port": free_port(),
                "http_metadata_port": None,
                "metrics_port": free_port(),
            },
            "mooncake_store": {"global_segment_size": 256 * 1024 * 1024},
            "router": False,
        },
    }
    specs = sglang_process_specs(cfg)
    assert [s.role for s in specs] == ["mooncake_master", "prefill", "decode"]
    logs = run_dir / "logs"
    procs = []
    try:
        procs.append(start(specs[0], logs))
        wait_ready(procs, timeout=30)
        procs += [start(s, logs, {"SMETRIC_TEST_HICACHE_CPU_PATCH": "1"}) for s in specs[1:]]
        wait_ready(procs, timeout=STARTUP_TIMEOUT_S)
        pool = cfg["launch"]
        yield {
            "prefill": f"http://127.0.0.1:{pool['prefill']['port']}",
            "decode": f"http://127.0.0.1:{pool['decode']['port']}",
            "bootstrap_port": pool["prefill"]["bootstrap_port"],
            "logs": logs,
        }
    finally:
        stop_all(procs[::-1])


class TestHiCache:
    """One PD pair (HiCache -> Mooncake store on the prefill worker), after the PD stack is down."""

    def test_hicache_prompt_comes_back_from_mooncake_store(self, hicache_pair):
        """Pushed out of device and host memory, a prompt's KV comes back from the Mooncake store
        on the prefill worker, crosses to the decode worker, and decodes to the same tokens."""

        def pd(text: str, n: int = 1) -> tuple[dict, dict]:
            sp = {"max_new_tokens": n, "temperature": 0}
            return _pd_direct(
                hicache_pair["prefill"], hicache_pair["decode"], hicache_pair["bootstrap_port"], text, sp
            )

        a = _words(0)
        _, first = pd(a, 8)
        p_again, _ = pd(a, 8)
        assert p_again["meta_info"]["cached_tokens_details"]["device"] > 0
        # push A out of device (1024 tokens) and host (2048 tokens) memory: ~14k tokens of others
        for i in range(1, 40):
            pd(_words(i))
        time.sleep(2.0)
        p_back, back = pd(a, 8)
        d = p_back["meta_info"]["cached_tokens_details"]
        assert d["storage_backend"] == "MooncakeStore"
        assert d["device"] == 0 and d["host"] == 0, d
        assert d["storage"] >= PAGE * ((p_back["meta_info"]["prompt_tokens"] - 1) // PAGE) - PAGE, d
        # the KV that came back from the store is the right KV: same greedy tokens on decode
        assert back["output_ids"] == first["output_ids"]


# ---------------------------------------------------------------------------------------------
# Work that stops when the client leaves, on real SGLang workers that require keys

WORKER_KEY = "tier-worker-api-key-0123"
WORKER_ADMIN_KEY = "tier-worker-admin-key-4567"
KEY_ENV = {"SMETRIC_TIER_WORKER_KEY": WORKER_KEY, "SMETRIC_TIER_WORKER_ADMIN": WORKER_ADMIN_KEY}


@pytest.fixture(scope="class")
def keyed_pair(sg_python, tiny_model, tmp_path_factory):
    """One real prefill and one decode worker started with ``--api-key`` and ``--admin-api-key``
    (``launch.sglang.api_key_env`` / ``admin_api_key_env``: the launcher substitutes the keys),
    and ``smetric router`` in front with the same env vars (the resolved router config names
    them): it sends the API key on every call and the admin key on ``/abort_request``."""
    from harness import start, stop_all, wait_ready

    from stack.launch.sglang import resolved_config, router_config_path, sglang_process_specs

    run_dir = tmp_path_factory.mktemp("sglang-keys")
    ports = _ports()
    cfg = tier_config(sg_python, tiny_model, run_dir, ports)
    cfg["launch"]["prefill"]["count"] = 1
    cfg["launch"]["sglang"] = {
        "api_key_env": "SMETRIC_TIER_WORKER_KEY",
        "admin_api_key_env": "SMETRIC_TIER_WORKER_ADMIN",
    }
    specs = sglang_process_specs(cfg)
    path = Path(router_config_path(cfg))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(resolved_config(cfg), sort_keys=False))
    logs = run_dir / "logs"
    workers = [s for s in specs if s.role in ("prefill", "decode")]
    for s in workers:
        s.env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    procs = [start(s, logs, KEY_ENV) for s in workers]
    router = None
    try:
        wait_ready(procs, timeout=STARTUP_TIMEOUT_S)
        rspec = next(s for s in specs if s.role == "router")
        router = start(rspec, logs, {"SMETRIC_TIER_ADMIN": ADMIN, **KEY_ENV})
        wait_ready([router], timeout=120)
        url = f"http://127.0.0.1:{ports['router']}"
        _wait_router_workers(url, 2)
        yield {
            "router": url,
            "prefill": f"http://127.0.0.1:{ports['prefill']}",
            "decode": f"http://127.0.0.1:{ports['decode']}",
            "procs": {p.spec.role: p for p in procs},
            "router_proc": router,
        }
    finally:
        stop_all(([router] if router else []) + procs)


def _busy(url: str) -> int:
    """Requests a real worker holds: running, waiting (its disaggregation queues included) and
    in its prefill in-flight queue (``/v1/loads``, which needs the worker's API key)."""
    loads = _get(url + "/v1/loads", {"authorization": f"Bearer {WORKER_KEY}"})["loads"]
    n = 0
    for ld in loads:
        n += int(ld.get("num_running_reqs") or 0) + int(ld.get("num_waiting_reqs") or 0)
        n += int((ld.get("disaggregation") or {}).get("prefill_inflight_queue_reqs") or 0)
    return n


def _leave_stream_after(url: str, body: dict, chunks: int, headers: dict | None = None) -> int:
    """Open a stream, read ``chunks`` lines of it and hang up; the lines read."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json", **(headers or {})}
    )
    n = 0
    r = urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S)
    try:
        for line in r:
            if line.strip():
                n += 1
            if n >= chunks:
                break
    finally:
        r.close()  # the client leaves: the connection is closed mid-stream
    return n


class TestCancelWithKeys:
    """A client that leaves frees the work on real SGLang workers run with both keys."""

    def test_client_leaving_frees_real_workers_with_api_and_admin_keys(self, keyed_pair):
        router, pre, dec = keyed_pair["router"], keyed_pair["prefill"], keyed_pair["decode"]
        # the keys are in force: nothing without the API key, and only the admin key aborts
        status, body = _post_status(
            pre + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1}}
        )
        assert status == 401, (status, body)
        req = urllib.request.Request(
            dec + "/abort_request",
            data=b'{"rid": "nothing"}',
            headers={"content-type": "application/json", "authorization": f"Bearer {WORKER_KEY}"},
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 401
        # the router sends the API key: served
        r = _post(router + "/v1/chat/completions", _chat_body(CHATS["chat"]))
        assert r["choices"][0]["message"]["content"] is not None

        def freed(what: str) -> float:
            t0 = time.monotonic()
            deadline = t0 + 120
            while _busy(pre) + _busy(dec) and time.monotonic() < deadline:
                time.sleep(0.1)
            left = (_busy(pre), _busy(dec))
            assert left == (0, 0), f"{what}: work left on (prefill, decode): {left}"
            return time.monotonic() - t0

        # 1. mid-stream: a long generation left after a few chunks
        long_gen = _chat_body(CHATS["stream"], max_tokens=3000, stream=True, ignore_eos=True)
        assert _leave_stream_after(router + "/v1/chat/completions", long_gen, 4) == 4
        t_mid = freed("mid-stream")
        # 2. before the first token: long prompts sent (OpenAI and Anthropic shape), and their
        #    clients hang up while the prefill worker holds them (nothing streamed yet)
        import http.client

        host, port = router.rsplit("/", 1)[1].split(":")
        conns = []
        for i in range(4):
            path = "/v1/messages" if i == 3 else "/v1/chat/completions"
            body = {"model": "tiny", "max_tokens": 64, "stream": True}
            body["messages"] = [{"role": "user", "content": _words(500 + i, 600)}]
            c = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT_S)
            c.request("POST", path, json.dumps(body), {"content-type": "application/json"})
            conns.append(c)
        deadline = time.monotonic() + 120
        while _busy(pre) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _busy(pre) > 0, "the prompts never reached the prefill worker"
        for c in conns:
            c.close()  # gone before the first token
        t_early = freed("before the first token")
        # the aborts reached both workers and SGLang took the admin key on them
        for role in ("prefill", "decode"):
            log = keyed_pair["procs"][role].tail(2_000_000)
            assert '"POST /abort_request HTTP/1.1" 200' in log, (role, log[-3000:])
            # the only refused abort is this test's own one with the API key (decode)
            assert log.count('"POST /abort_request HTTP/1.1" 401') == (role == "decode"), role
        router_log = keyed_pair["router_proc"].tail(200_000)
        assert "refused" not in router_log, router_log[-3000:]
        print(
            f"\nreal SGLang with --api-key/--admin-api-key: freed {t_mid:.1f} s after a client left mid-stream"
        )
        print(f"freed {t_early:.1f} s after clients left before their first token (the last one)")


# -- tracing: a real SGLang PD pair continues the router's trace --------------------------------


@pytest.fixture(scope="class")
def traced_pair(sg_python, tiny_model, tmp_path_factory):
    """One SGLang prefill and one decode worker with `--enable-trace` exporting over OTLP
    HTTP/protobuf to a receiver of this test, behind `smetric router` with `router.tracing` on
    (exporting to the same receiver); started after the other groups are down."""
    from harness import start, stop_all, wait_ready

    from stack.launch.sglang import resolved_config, router_config_path, sglang_process_specs
    from support.otlp_receiver import OTLPReceiver

    run_dir = tmp_path_factory.mktemp("sglang-trace")
    ports = _ports()
    with OTLPReceiver() as rx:
        cfg = tier_config(sg_python, tiny_model, run_dir, ports)
        cfg["launch"]["prefill"]["count"] = 1
        for role in ("prefill", "decode"):
            cfg["launch"][role]["extra_args"] = [
                "--enable-trace",
                "--otlp-traces-endpoint",
                rx.endpoint,
                "--otlp-service-name",
                f"sglang-{role}",
            ]
            # SGLang exports over gRPC unless told otherwise (sglang/srt/observability/trace.py)
            cfg["launch"][role]["env"] = {
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                "SGLANG_OTLP_EXPORTER_SCHEDULE_DELAY_MILLIS": "200",
            }
        cfg["router"]["tracing"] = {"enabled": True, "endpoint": rx.endpoint}
        specs = sglang_process_specs(cfg)
        path = Path(router_config_path(cfg))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(resolved_config(cfg), sort_keys=False))
        logs = run_dir / "logs"
        workers = [s for s in specs if s.role in ("prefill", "decode")]
        for s in workers:
            s.env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        procs = [start(s, logs) for s in workers]
        router = None
        try:
            wait_ready(procs, timeout=STARTUP_TIMEOUT_S)
            rspec = next(s for s in specs if s.role == "router")
            router = start(rspec, logs, {"SMETRIC_TIER_ADMIN": ADMIN})
            wait_ready([router], timeout=120)
            url = f"http://127.0.0.1:{ports['router']}"
            _wait_router_workers(url, 2)
            yield {"router": url, "rx": rx, "logs": logs}
        finally:
            stop_all(([router] if router else []) + procs)


class TestTracing:
    """Issue 29 item 2: a real SGLang worker's spans carry the router's trace id."""

    def test_sglang_spans_join_the_routers_trace(self, traced_pair):
        rx = traced_pair["rx"]
        r = _post(traced_pair["router"] + "/v1/chat/completions", _chat_body(CHATS["chat"]))
        assert r["choices"][0]["message"]["content"] is not None

        def router_spans(spans):
            return [s for s in spans if s.service == "smetric-router"]

        def joined(spans) -> bool:
            mine = router_spans(spans)
            roots = [s for s in mine if s.name == "POST /v1/chat/completions"]
            if not roots:
                return False
            tid = roots[0].trace_id
            roles = {s.service for s in spans if s.trace_id == tid and s.service.startswith("sglang-")}
            return roles == {"sglang-prefill", "sglang-decode"}

        try:
            spans = rx.wait_for(joined, timeout=120)
        except AssertionError:
            tails = "\n".join(
                f"{p.name}:\n{p.read_text()[-2000:]}" for p in traced_pair["logs"].glob("*.log")
            )
            raise AssertionError(
                f"no SGLang span in the router's trace; spans {rx.snapshot()}\n{tails}"
            ) from None
        mine = router_spans(spans)
        root = next(s for s in mine if s.name == "POST /v1/chat/completions")
        hand = {s.name: s for s in mine if s.trace_id == root.trace_id}
        assert {"smetric.prefill", "smetric.decode"} <= set(hand)
        theirs = [s for s in spans if s.trace_id == root.trace_id and s.service.startswith("sglang-")]
        # SGLang's request span (its root, "<role> Req <rid>") is a child of the router span
        # whose traceparent it received: prefill's of smetric.prefill, decode's of smetric.decode
        parents = {(s.service, s.parent_span_id) for s in theirs}
        assert ("sglang-prefill", hand["smetric.prefill"].span_id) in parents, parents
        assert ("sglang-decode", hand["smetric.decode"].span_id) in parents, parents
