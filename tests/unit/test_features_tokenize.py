"""Request features: segment-cached tokenization is exact, turn / est_hit, bad input."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stack.kv_tier.hashing import block_hashes
from stack.models.tiny import build_tiny_model
from stack.prefill_router.errors import ClientError
from stack.prefill_router.features import FeatureExtractor, turn_of
from stack.prefill_router.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _conv(n_turns: int, size: int = 40):
    msgs = [{"role": "system", "content": "You are a helpful coding agent. " * 3}]
    for t in range(n_turns):
        msgs.append({"role": "user", "content": f"turn {t}: fix the bug in main.py " * size})
        msgs.append({"role": "assistant", "content": f"done {t}"})
        msgs.append({"role": "tool", "content": f"result {t} ok " * size})
    msgs.append({"role": "user", "content": "and now the tests " * size})
    return msgs


def test_segment_cached_encoding_equals_whole(model_dir):
    tok = Tokenizer(model_dir, cache_tokens=10**6)
    msgs = _conv(5)
    text = tok.render(msgs)
    whole = tok.hf.encode(text, add_special_tokens=False).ids
    ids, ends, cached, *_ = tok.encode(text)
    assert ids.tolist() == whole and cached == 0
    assert len(ends) > 5  # really segmented
    ids2, _, cached2, *_ = tok.encode(text)
    assert ids2.tolist() == whole and cached2 == len(whole)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    contents=st.lists(
        st.lists(
            st.sampled_from(
                [
                    "a",
                    "b",
                    " ",
                    "  ",
                    "\n",
                    "\t",
                    "<|im_start|>",
                    "<|im_end|>",
                    "<|endoftext|>",
                    "é",
                    "漢",
                    "🙂",
                    "<|",
                ]
            ),
            max_size=30,
        ).map("".join),
        min_size=1,
        max_size=6,
    )
)
def test_segmentation_exact_on_adversarial_text(model_dir, contents):
    tok = _TOK.setdefault("t", Tokenizer(model_dir, cache_tokens=10**5))
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)]
    text = tok.render(msgs) * 3  # long enough to be segmented
    ids = tok.encode(text).tokens
    assert ids.tolist() == tok.hf.encode(text, add_special_tokens=False).ids


_TOK: dict = {}


def test_cache_is_bounded(model_dir):
    tok = Tokenizer(model_dir, cache_tokens=500)
    for i in range(30):
        tok.encode(tok.render([{"role": "user", "content": f"message number {i} " * 30}]))
    assert tok.cache.tokens <= 500


def test_turn_and_est_hit(model_dir):
    fx = FeatureExtractor(model_dir, block_size=16)
    first = fx.chat({"messages": _conv(0)})
    assert first.turn == 1 and first.est_hit == 0
    msgs = _conv(3)
    f = fx.chat({"messages": msgs})
    assert f.turn == 4
    # est_hit = tokens of the history up to and including the last assistant message
    last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    hist = fx.tok.render(msgs[: last + 1], add_generation_prompt=False)
    n_hist = len(fx.tok.hf.encode(hist, add_special_tokens=False).ids)
    assert 0 < f.est_hit <= n_hist and n_hist - f.est_hit < 5
    assert f.hashes == block_hashes(f.tokens, 16)
    assert turn_of([{"role": "user"}, {"role": "assistant"}, {"role": "tool"}]) == (2, 1)


def test_follow_up_reuses_cache(model_dir):
    fx = FeatureExtractor(model_dir, block_size=16)
    msgs = _conv(4, size=200)
    fx.chat({"messages": msgs[:-3]})
    f = fx.chat({"messages": msgs})
    assert f.cache_hit_tokens > 0.6 * f.prompt_tokens


def test_prompts_and_errors(model_dir):
    fx = FeatureExtractor(model_dir, block_size=16)
    assert fx.prompt([1, 2, 3] * 10).prompt_tokens == 30
    assert fx.prompt("hello world " * 20).prompt_tokens > 10
    assert fx.prompt(["hello", "hello world again"]).prompt_tokens >= 2
    for bad, code in [
        ({}, "missing_required_parameter"),
        ({"messages": "hi"}, "invalid_type"),
        ({"messages": []}, "empty_array"),
        ({"messages": [1]}, "invalid_type"),
        ({"messages": [{"content": "x"}]}, "invalid_type"),
        ({"messages": [{"role": "user", "content": 5}]}, "invalid_type"),
    ]:
        with pytest.raises(ClientError) as e:
            fx.chat(bad)
        assert e.value.code == code and e.value.status == 400
    for bad in ["", [], [-1], {"a": 1}, 3]:
        with pytest.raises(ClientError):
            fx.prompt(bad)


def test_no_tokenizer_approximates():
    fx = FeatureExtractor(None, block_size=16)
    f = fx.chat({"messages": [{"role": "user", "content": "x" * 400}]})
    assert f.prompt_tokens == 100 and f.hashes == []
