"""The official `openai` SDK against the router in front of emulated SGLang workers (the
local PD stack on loopback): chat and completions, streaming and not, and errors surfacing
as the SDK's own exception types."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def stack_info(tmp_path_factory):
    from stack.replay.localstack import local_stack

    with local_stack(
        prefill=1,
        decode=1,
        ports="auto",
        time_factor=0.001,
        mooncake=False,
        run_dir=tmp_path_factory.mktemp("run"),
    ) as info:
        yield info


@pytest.fixture(scope="module")
def client(stack_info):
    c = openai.OpenAI(base_url=stack_info["router_url"] + "/v1", api_key="unused", max_retries=0, timeout=30)
    yield c
    c.close()


@pytest.fixture(scope="module")
def model(client):
    models = client.models.list()
    assert models.data and isinstance(models.data[0].id, str)
    return models.data[0].id


MSGS = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "fix the bug " * 40},
]


def test_chat_completion(client, model):
    r = client.chat.completions.create(
        model=model, messages=MSGS, max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert r.object == "chat.completion" and r.id
    ch = r.choices[0]
    assert ch.message.role == "assistant" and isinstance(ch.message.content, str) and ch.message.content
    assert ch.finish_reason == "length"
    assert r.usage.completion_tokens == 7 and r.usage.prompt_tokens > 40
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_chat_completion_streaming(client, model):
    stream = client.chat.completions.create(
        model=model,
        messages=MSGS,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, finish, usage, n = "", None, None, 0
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        for ch in chunk.choices:
            if ch.delta.content:
                text += ch.delta.content
                n += 1
            finish = ch.finish_reason or finish
        usage = chunk.usage or usage
    assert text and n == 6 and finish == "length"
    assert usage is not None and usage.completion_tokens == 6


def test_chat_multi_turn_follow_up(client, model):
    r1 = client.chat.completions.create(model=model, messages=MSGS, max_tokens=5)
    follow = MSGS + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "now run the tests " * 10},
    ]
    r2 = client.chat.completions.create(model=model, messages=follow, max_tokens=5)
    assert r2.usage.prompt_tokens > r1.usage.prompt_tokens
    details = r2.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens >= 64  # the first turn's prefix was reused


def test_completion(client, model):
    r = client.completions.create(model=model, prompt="def main(argv):" * 20, max_tokens=5)
    assert r.object == "text_completion"
    assert isinstance(r.choices[0].text, str) and r.choices[0].text
    assert r.usage.completion_tokens == 5


def test_completion_streaming(client, model):
    chunks = list(
        client.completions.create(model=model, prompt="hello world " * 20, max_tokens=4, stream=True)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text and any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_sdk_stream_helper_natural_stop(client, model):
    # the SDK's streaming helper accumulates the chunks into a final completion (it rejects
    # finish_reason "length", so let the emulator end the answer by itself)
    with client.chat.completions.stream(model=model, messages=MSGS, max_tokens=500) as s:
        final = s.get_final_completion()
    assert final.choices[0].finish_reason == "stop" and final.choices[0].message.content


def test_errors_surface_as_sdk_exceptions(client, model):
    # context length exceeded: 400
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=[5] * 1_100_000, max_tokens=1)  # > 1M context
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    assert "context length" in e.value.message
    # a malformed request body: 400, as OpenAI answers it, with an OpenAI-shaped error
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[], max_tokens=1)
    assert isinstance(e.value, openai.APIStatusError) and e.value.param == "messages"
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model=model, messages=MSGS, max_tokens=1, extra_body={"stream": "yes"})
    assert 400 <= e.value.status_code < 500
    # an unknown route: 404
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.status_code == 404
    # and a streaming request that fails before the first chunk raises too
    with pytest.raises(openai.BadRequestError):
        for _ in client.chat.completions.create(model=model, messages=[], max_tokens=1, stream=True):
            pass


def test_connection_errors_are_sdk_errors():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=5)
    with pytest.raises(openai.APIConnectionError):
        c.models.list()
