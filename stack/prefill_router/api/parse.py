"""Request parsing and validation: a body in, :class:`Features` out, or a client error.

Reading the body is bounded (``router.max_body_bytes``, whether or not the client sent a
``Content-Length``) and answers 413/400 itself; validating it raises
:class:`~stack.prefill_router.errors.ClientError`, which the caller answers as a 4xx.
Nothing here routes or counts: parsing a request never touches the pool.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import numpy as np
import orjson
from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from stack.prefill_router.api.errors import error_response
from stack.prefill_router.api.fields import check_chat_fields, check_generate_params, check_sampling
from stack.prefill_router.errors import Cancelled, ClientError, over_context
from stack.prefill_router.features import FeatureExtractor, Features, check_messages, turn_of
from stack.prefill_router.session_hints import session_hint

#: the chat template's bytes per message, at most, for :func:`light_features`' bound
TEMPLATE_BYTES_PER_MESSAGE = 64
TEMPLATE_BYTES = 4096
_NO_TOKENS = np.zeros(0, dtype="<u4")


@dataclass(slots=True)
class Parsed:
    """One valid inference request: its body (parsed and raw) and its features."""

    body: dict
    raw: bytes
    features: Features
    stream: bool
    hint_source: str | None = None  # where the session id came from (stack.prefill_router.session_hints)


async def read_json(request: Request, max_body: int) -> tuple[dict, bytes] | Response:
    """The request's JSON object and its raw bytes, or the error answer (413 over
    ``max_body`` bytes, 400 for a bad length, an empty body, bad JSON, or not an object).
    A client gone before its body was read (or cut off by the front door's body timeout)
    raises :class:`~stack.prefill_router.errors.Cancelled`: the client's doing, nobody to answer."""
    try:
        return await _read_json(request, max_body)
    except ClientDisconnect:
        raise Cancelled("client gone while its body was read") from None


async def _read_json(request: Request, max_body: int) -> tuple[dict, bytes] | Response:
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            if int(cl) > max_body:
                return error_response(
                    413, f"request body over {max_body} bytes", param=None, code="request_too_large"
                )
        except ValueError:
            return error_response(400, "bad Content-Length", code="invalid_request")
        raw = await request.body()
    else:
        chunks = []
        n = 0
        async for c in request.stream():
            n += len(c)
            if n > max_body:
                return error_response(413, f"request body over {max_body} bytes", code="request_too_large")
            chunks.append(c)
        raw = b"".join(chunks)
    if len(raw) > max_body:
        return error_response(413, f"request body over {max_body} bytes", code="request_too_large")
    if not raw:
        return error_response(400, "empty request body", code="invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return error_response(400, f"malformed JSON: {e.msg} at {e.pos}", code="invalid_json")
    if not isinstance(body, dict):
        return error_response(400, "the request body must be a JSON object", code="invalid_json")
    return body, raw


def disconnect_watcher(receive) -> Callable[[], Awaitable[None]]:
    """A factory of awaitables that return when the client has gone, over an ASGI ``receive``
    whose request body was already read: the next message is ``http.disconnect`` (cancel
    safe: no message is consumed when the wait is cancelled): the ``disconnected`` of
    :meth:`~stack.prefill_router.offload.FeaturePool.run` and of the dispatch queue's wait."""

    async def wait() -> None:
        while True:
            msg = await receive()
            if msg.get("type") == "http.disconnect":
                return

    return wait


def check_common(body: dict, native: bool) -> None:
    """Types of the fields every endpoint shares (``native``: SGLang's ``/generate``)."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ClientError("'stream' must be a boolean", param="stream", code="invalid_type")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ClientError("'model' must be a string", param="model", code="invalid_type")
    check_sampling(body)
    for key in ("temperature", "top_p"):
        v = body.get(key)
        if v is not None and (not isinstance(v, int | float) or isinstance(v, bool)):
            raise ClientError(f"'{key}' must be a number", param=key, code="invalid_type")
    if native:
        sp = body.get("sampling_params")
        if sp is not None and not isinstance(sp, dict):
            raise ClientError(
                "'sampling_params' must be an object", param="sampling_params", code="invalid_type"
            )
        if sp is not None:
            check_generate_params(sp)


def features_of(extractor: FeatureExtractor, endpoint: str, body: dict) -> Features:
    """Tokens, block hashes and turn of the prompt, by endpoint ("chat", "completions",
    "generate")."""
    if endpoint == "chat":
        check_common(body, False)
        check_chat_fields(body)
        return extractor.chat(body)
    if endpoint == "completions":
        check_common(body, False)
        if "prompt" not in body:
            raise ClientError("'prompt' is required", param="prompt", code="missing_required_parameter")
        return extractor.prompt(body.get("prompt"), "prompt")
    check_common(body, True)
    if body.get("input_ids") is not None:
        return extractor.prompt(body["input_ids"], "input_ids")
    if body.get("text") is not None:
        return extractor.prompt(body["text"], "text")
    raise ClientError("'text' or 'input_ids' is required", param="text", code="missing_required_parameter")


def light_features(endpoint: str, body: dict, raw: bytes, context_length: int) -> Features | None:
    """Features without tokenizing, for a policy that needs none
    (``Policy.needs_prompt_features`` False), or None when the prompt might not fit the
    context (then the caller derives the full features, and the exact count decides).

    A token covers at least one byte of the rendered prompt, so a body of B bytes renders to
    at most about B + the template's own bytes tokens; when that is under the context the
    prompt fits and is not tokenized. ``prompt_tokens`` is then an estimate (a quarter of
    the body's bytes, or the exact count of token ids), for the metrics and the load
    accounting; no block hashes, no hit estimate. The body is validated as on the full
    path."""
    if endpoint == "chat":
        check_common(body, False)
        check_chat_fields(body)
        messages = check_messages(body.get("messages"))
        extra = body.get("chat_template_kwargs")
        if extra is not None and not isinstance(extra, dict):
            raise ClientError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        if len(raw) + TEMPLATE_BYTES_PER_MESSAGE * len(messages) + TEMPLATE_BYTES >= context_length:
            return None
        turn, _ = turn_of(messages)
        return Features(_NO_TOKENS, max(1, len(raw) // 4), turn)
    key = (
        "prompt"
        if endpoint == "completions"
        else ("input_ids" if body.get("input_ids") is not None else "text")
    )
    check_common(body, endpoint != "completions")
    prompt = body.get(key)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt)
    ):
        return None if len(prompt) >= context_length else Features(_NO_TOKENS, len(prompt), 1)
    if not isinstance(prompt, str) or not prompt or len(raw) + TEMPLATE_BYTES >= context_length:
        return None  # the full path validates it (and answers the errors) or counts it
    return Features(_NO_TOKENS, max(1, len(raw) // 4), 1)


def parse_inference(
    extractor: FeatureExtractor,
    endpoint: str,
    body: dict,
    raw: bytes,
    headers: Mapping[str, str],
    context_length: int,
    needs_features: bool = True,
) -> Parsed:
    """A valid inference request, or :class:`ClientError` (a prompt at or over the model's
    context length is a 400 ``context_length_exceeded``). The session id (header
    ``x-session-token``, an agent's session header, else body ``session_id``: see
    :func:`~stack.prefill_router.session_hints.session_hint`) rides on the features.
    ``needs_features`` False: :func:`light_features` where the prompt surely fits."""
    f = None if needs_features else light_features(endpoint, body, raw, context_length)
    if f is None:
        f = features_of(extractor, endpoint, body)
    stream = bool(body.get("stream"))
    if f.prompt_tokens >= context_length:
        raise over_context(f.prompt_tokens, context_length, "messages" if endpoint == "chat" else "prompt")
    sid, src = session_hint(headers, body)
    f.session_id = sid
    return Parsed(body, raw, f, stream, src)


def parse_embeddings(
    extractor: FeatureExtractor,
    endpoint: str,
    body: dict,
    raw: bytes,
    headers: Mapping[str, str],
    context_length: int,
    needs_features: bool = True,
) -> Parsed:
    """``/v1/embeddings`` (OpenAI's shape): ``input`` is a string, a list of strings, a list
    of token ids or a list of token-id lists, none empty; routed on its first prompt (a
    batch counts its longest). Never streamed. Every mistake is a 400 (:class:`ClientError`)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ClientError("'model' must be a string", param="model", code="invalid_type", status=400)
    if "input" not in body:
        raise ClientError("'input' is required", param="input", code="missing_required_parameter", status=400)
    inp = body["input"]
    if not _embedding_input(inp):
        raise ClientError(
            "'input' must be a non-empty string, or a non-empty array of strings, of token ids or of"
            " arrays of token ids",
            param="input",
            code="invalid_type",
            status=400,
        )
    try:
        f = extractor.prompt(inp, "input")
    except ClientError as e:
        raise ClientError(e.message, e.param, e.code, status=400) from None
    if f.prompt_tokens >= context_length:
        raise over_context(f.prompt_tokens, context_length, "input")
    sid, src = session_hint(headers, body)
    f.session_id = sid
    return Parsed(body, raw, f, False, src)


def _token_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _embedding_input(inp) -> bool:
    """Whether ``inp`` has one of the shapes of an embeddings ``input`` (ids checked >= 0 later)."""
    if isinstance(inp, str):
        return bool(inp)
    if not isinstance(inp, list) or not inp:
        return False
    return _token_ids(inp) or all(isinstance(x, str) and x for x in inp) or all(_token_ids(x) for x in inp)
