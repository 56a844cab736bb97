"""Agent APIs: our Anthropic / Responses conversion + chat step gives SGLang's prompt ids.

SGLang's converters import only in SGLang's environment, so a helper
(``tests/agent_sglang/sglang_convert.py``) runs SGLang 0.5.23's own ``AnthropicServing`` and
``OpenAIServingResponses`` code on the same bodies in that interpreter and prints the prompt
ids (and what it handed the template); each must equal the router's. Skips when no
interpreter has sglang (as tests/integration/test_sglang_args.py does).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stack.agent_apis import AgentError
from stack.agent_apis.chat_step import chat_body, content_format, inline_system
from stack.agent_apis.convert import convert
from stack.models.tiny import CHAT_TEMPLATE, build_tiny_model
from stack.prefill_router.errors import ClientError
from stack.prefill_router.features import FeatureExtractor

HERE = Path(__file__).resolve().parents[1]  # tests/
sys.path.insert(0, str(HERE / "sglang_cpu"))
from _locate import sglang_python, skip_reason  # noqa: E402

sys.path.insert(0, str(HERE / "agent_sglang"))
from cases import CASES  # noqa: E402

HELPER = HERE / "agent_sglang" / "sglang_convert.py"
pytestmark = pytest.mark.timeout(600)

#: a second template: ``string`` content format (no loop over a content list) and no inline
#: system messages (only a leading one renders), so SGLang's merging paths run too
STRING_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content }}"
    "{%- if tools %}{{- '\\n# Tools\\n' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'system' %}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>' + message.content + '</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content }}"
    "{%- if message.tool_calls %}{{- message.tool_calls | tojson }}{%- endif %}"
    "{%- if message.reasoning_content %}{{- '<think>' + message.reasoning_content + '</think>' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TEMPLATES = {"chatml-openai": CHAT_TEMPLATE, "string-leading-system": STRING_TEMPLATE}


def ours(fx: FeatureExtractor, api: str, body: dict) -> list[int] | str:
    tmpl = fx.tok.template_src
    try:
        req = convert(api, body, tmpl)
        try:
            f = fx.chat(chat_body(req, tmpl))
        except ClientError:
            if not req.tools:
                raise
            f = fx.chat(chat_body(req, tmpl, flat=True))
    except (AgentError, ClientError) as e:
        return f"error: {e}"
    return [int(t) for t in f.tokens]


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def sglang_answers(request, tmp_path_factory):
    py = sglang_python()
    if py is None:
        pytest.skip(skip_reason())
    model = build_tiny_model(tmp_path_factory.mktemp("tiny"), chat_template=TEMPLATES[request.param])
    spec = {"model_dir": str(model), "cases": [{"api": a, "body": b} for _, a, b in CASES]}
    r = subprocess.run([py, str(HELPER)], input=json.dumps(spec), capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, f"SGLang helper failed:\n{r.stderr[-3000:]}"
    return model, json.loads(r.stdout)


@pytest.mark.parametrize("i", range(len(CASES)), ids=[c[0] for c in CASES])
def test_prompt_ids_equal_sglang(sglang_answers, i):
    model, answers = sglang_answers
    fx = FeatureExtractor(model, 16)
    name, api, body = CASES[i]
    got, want = ours(fx, api, body), answers[i]
    if "error" in want:
        assert isinstance(got, str), f"{name}: SGLang refused it ({want['error']}), we did not"
    else:
        tmpl = fx.tok.template_src
        assert (want["content_format"], want["inline_system"]) == (content_format(tmpl), inline_system(tmpl))
        assert got == want["ids"], f"{name}: SGLang's template inputs: {json.dumps(want)[:3000]}"
