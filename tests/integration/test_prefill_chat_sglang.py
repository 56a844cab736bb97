"""The PD prefill half of an Anthropic Messages request, sent as a chat request for its
``meta_info`` (``stack.decode_router.prefill_meta.messages_as_chat``), is the request SGLang
0.5.23 itself makes of the Messages body: the same fields (sampling, tools, tool choice) and,
through SGLang's own chat step, the same prompt token ids, so the decode half (the client's
Messages body) gets exactly the KV it expects. Runs SGLang's code under its interpreter
(``tests/agent_sglang/sglang_prefill_chat.py``; no engine); skipped without it (a failure
under CI=true)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from stack.decode_router.prefill_meta import messages_as_chat
from stack.models.tiny import build_tiny_model

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "sglang_cpu"))
sys.path.insert(0, str(HERE / "agent_sglang"))
from _locate import sglang_python, skip_or_fail, skip_reason  # noqa: E402
from cases import CASES  # noqa: E402

HELPER = HERE / "agent_sglang" / "sglang_prefill_chat.py"
PD = {"bootstrap_host": "10.0.0.7", "bootstrap_port": 8998, "bootstrap_room": 42, "rid": "smr-2a"}
pytestmark = pytest.mark.timeout(300)

#: sampling and tool-choice fields the shared cases leave out
EXTRA = [
    (
        "a-sampling",
        {
            "model": "tiny",
            "max_tokens": 7,
            "temperature": 0.2,
            "top_p": 0.9,
            "top_k": 5,
            "stop_sequences": ["END"],
            "stream": True,
            "messages": [{"role": "user", "content": "count"}],
        },
    ),
    (
        "a-no-parallel",
        {
            "model": "tiny",
            "max_tokens": 7,
            "messages": [{"role": "user", "content": "list"}],
            "tools": [{"name": "ls", "description": "list", "input_schema": {"properties": {}}}],
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        },
    ),
]


def test_prefill_chat_request_equals_sglangs_own(tmp_path):
    py = sglang_python()
    if py is None:
        skip_or_fail(skip_reason())
    cases = [(n, b) for n, api, b in CASES if api == "anthropic"] + EXTRA
    pairs, names = [], []
    for name, body in cases:
        chat = messages_as_chat(orjson.dumps({**body, **PD}))
        if chat is not None:
            pairs.append({"messages": body, "chat": orjson.loads(chat)})
            names.append(name)
    assert len(names) >= 12 and "a-inline-system" not in names and "a-effort" not in names
    model = build_tiny_model(tmp_path / "tiny")
    spec = {"model_dir": str(model), "pairs": pairs}
    r = subprocess.run([py, str(HELPER)], input=json.dumps(spec), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"SGLang helper failed:\n{r.stderr[-3000:]}"
    for name, pair, got in zip(names, pairs, json.loads(r.stdout)):
        assert "error" not in got, (name, got)
        assert got["differ"] == {}, (name, got["differ"])
        assert got["ids"] == got["chat_ids"], name
        assert all(pair["chat"][k] == v for k, v in PD.items()) and pair["chat"]["return_meta_info"]
