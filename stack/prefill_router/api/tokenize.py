"""What a client asks to size its prompts for this router, answered as an SGLang worker does:
``GET /model_info`` (and the older ``/get_model_info``): the model, ``tokenizer_path`` (the
router's configured model dir) and ``max_model_len``; ``POST /v1/tokenize`` (and
``/tokenize``): ``{prompt: str | [str]}`` or ``{messages: [...]}``, exactly one, answered
``{tokens, count, max_model_len}``.

The counts are the router's own: a prompt through ``FeatureExtractor.prompt`` and messages
through ``FeatureExtractor.chat`` (the chat template, as for a chat completion), so what
``/v1/tokenize`` counts is what the router checks against the context length and routes
on. Tokenization runs in a worker thread, off the event loop. Errors are OpenAI-shaped
(400 for a bad body; 501 when the router has no tokenizer: no model path configured)."""

from __future__ import annotations

import asyncio

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from stack.models.info import sglang_model_info
from stack.prefill_router.api.errors import JSON, error_response
from stack.prefill_router.api.parse import read_json
from stack.prefill_router.errors import ClientError
from stack.prefill_router.features import FeatureExtractor
from stack.prefill_router.state import RouterState


def model_info(state: RouterState) -> dict:
    """SGLang's ``/model_info`` fields, for the router's configured model."""
    m = state.cfg.model
    return sglang_model_info(m.path or m.name, m.name, m.path, "null") | {
        "max_model_len": m.context_length,
        "context_length": m.context_length,
        "page_size": m.page_size,
    }


def tokenize(fx: FeatureExtractor, body: dict) -> tuple[list, list | int]:
    """(tokens, count) of a ``/v1/tokenize`` body, as SGLang shapes them (a list of prompts
    gives a list of each); raises :class:`ClientError` (400) on a bad body."""
    if not isinstance(body, dict):
        raise ClientError("the body must be a JSON object", status=400, code="invalid_request")
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise ClientError(
            "Exactly one of 'prompt' or 'messages' must be provided.", status=400, code="invalid_request"
        )
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise ClientError(
            "'add_special_tokens' must be a boolean",
            param="add_special_tokens",
            status=400,
            code="invalid_type",
        )
    tok = fx.tok
    if messages is not None:
        agp = body.get("add_generation_prompt")
        if agp is None:  # as for a chat completion: exactly what the router counts
            f = fx.chat(body)
            return [int(t) for t in f.tokens], f.prompt_tokens
        if not isinstance(agp, bool):
            raise ClientError(
                "'add_generation_prompt' must be a boolean",
                param="add_generation_prompt",
                status=400,
                code="invalid_type",
            )
        fx.chat(body)  # validates the messages
        extra = body.get("chat_template_kwargs")
        text = tok.render(messages, body.get("tools"), agp, extra)
        ids = tok.encode(text, add_special_tokens="add_special_tokens" in body and special).tokens
        return [int(t) for t in ids], len(ids)
    if isinstance(prompt, str):
        return _one(fx, prompt, special)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        pairs = [_one(fx, p, special) for p in prompt]
        return [t for t, _ in pairs], [n for _, n in pairs]
    raise ClientError(
        "'prompt' must be a string or a non-empty array of strings",
        param="prompt",
        status=400,
        code="invalid_type",
    )


def _one(fx: FeatureExtractor, text: str, special: bool) -> tuple[list[int], int]:
    if special:  # the router's own count of a completions prompt
        f = fx.prompt(text)
        return [int(t) for t in f.tokens], f.prompt_tokens
    ids = fx.tok.encode(text, add_special_tokens=False).tokens
    return [int(t) for t in ids], len(ids)


def tokenize_router(state: RouterState) -> APIRouter:
    """``/model_info`` and ``/v1/tokenize`` of ``state``'s router."""
    router = APIRouter()

    async def info():
        return Response(orjson.dumps(model_info(state)), media_type=JSON)

    async def tok(request: Request):
        fx = state.features
        if fx.tok is None:
            return error_response(
                501, "the router has no tokenizer (no model.path configured)", code="no_tokenizer"
            )
        got = await read_json(request, state.cfg.router.max_body_bytes)  # bounded, as inference bodies
        if isinstance(got, Response):
            return got
        body = got[0]
        try:
            tokens, count = await asyncio.to_thread(tokenize, fx, body)
        except ClientError as e:
            return error_response(400, e.message, param=e.param, code=e.code)
        out = {"tokens": tokens, "count": count, "max_model_len": state.cfg.model.context_length}
        return Response(orjson.dumps(out), media_type=JSON)

    for path in ("/model_info", "/get_model_info"):
        router.add_api_route(path, info, methods=["GET"])
    for path in ("/v1/tokenize", "/tokenize"):
        router.add_api_route(path, tok, methods=["POST"])
    return router
