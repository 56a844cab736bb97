"""README's "Try it in a minute", run as written against this checkout: `smetric up --detach`
(configs/local.yaml), then the curl and the Python block (the openai and anthropic SDKs).

Two things differ from a person's run, both to share a CI machine safely: the stack runs in a
temporary run dir on free ports (``--run-dir``, ``--ports auto``), and each snippet's
``http://127.0.0.1:8000`` is replaced by that router's URL. The snippets themselves are read
from README.md, so an edit that breaks them fails here."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHOWN_URL = "http://127.0.0.1:8000"

pytestmark = pytest.mark.timeout(300)


def _section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Try it in a minute")
    return text[start : text.index("\n## ", start + 1)]


def _blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section, re.DOTALL)


def _curl(section: str) -> str:
    """The curl command of the bash block: from ``curl`` to the block's end, as bash reads it."""
    [bash] = [b for b in _blocks(section, "bash") if "smetric up --detach" in b]
    return bash[bash.index("curl ") :]


def test_readme_names_what_it_runs():
    section = _section()
    bash = "\n".join(_blocks(section, "bash"))
    assert "smetric up --detach" in bash and "curl " in bash
    [py] = _blocks(section, "python")
    assert "from openai import OpenAI" in py and "from anthropic import Anthropic" in py


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("readme-try")
    up = [sys.executable, "-m", "stack.cli", "up", "--detach", "--ports", "auto", "--run-dir", str(run_dir)]
    r = subprocess.run(up, cwd=ROOT, capture_output=True, text=True, timeout=240)
    try:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        state = json.loads((run_dir / "state.json").read_text())
        yield state["router_url"]
    finally:
        subprocess.run(
            [sys.executable, "-m", "stack.cli", "down", "--run-dir", str(run_dir)],
            cwd=ROOT,
            capture_output=True,
            timeout=120,
        )


def test_the_curl_as_written(router):
    cmd = _curl(_section()).replace(SHOWN_URL, router)
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
    assert body["model"] == "qwen3-coder-30b-a3b" and 1 <= body["usage"]["completion_tokens"] <= 16


def test_the_sdk_calls_as_written(router):
    [py] = _blocks(_section(), "python")
    r = subprocess.run(
        [sys.executable, "-c", py.replace(SHOWN_URL, router)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "ChatCompletionMessage(" in out and "role='assistant'" in out  # the openai SDK's message
    assert "TextBlock(" in out and "type='text'" in out  # the anthropic SDK's content
