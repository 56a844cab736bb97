"""What the router's routes do, for the routes whose endpoint function has no docstring.

:mod:`stack.reference.http_api` prefers an endpoint's own docstring; a route with neither a
docstring nor a note here fails the generator, and a note for a route that no longer exists
fails tests/unit/test_reference_docs.py, so this table cannot drift from the route table.
``REQUESTS``: the body or query a route reads (the router parses bodies by hand).
"""

from __future__ import annotations

#: (method, path) -> what the route does
SUMMARIES: dict[tuple[str, str], str] = {
    (
        "POST",
        "/v1/chat/completions",
    ): "OpenAI Chat Completions, streamed or not: routed, then forwarded to the chosen workers' same path",
    (
        "POST",
        "/v1/completions",
    ): "OpenAI Completions: routed, then forwarded to the chosen workers' same path",
    (
        "POST",
        "/generate",
    ): "SGLang's native generate (no `model` field): routed, then forwarded to the chosen workers' same path",
    ("POST", "/v1/embeddings"): "OpenAI Embeddings: routed to a prefill worker alone (no decode half)",
    (
        "POST",
        "/v1/messages",
    ): "Anthropic Messages (Claude Code and other agents): routed, then forwarded to the chosen workers' same path",
    (
        "POST",
        "/v1/messages/count_tokens",
    ): "Anthropic's token count, answered by the router from its own tokenization (never forwarded)",
    ("POST", "/v1/responses"): "OpenAI Responses: routed, then forwarded to the chosen workers' same path",
    ("GET", "/model_info"): "the model, `tokenizer_path` and `max_model_len`, as an SGLang worker answers",
    ("GET", "/get_model_info"): "the older name of `GET /model_info`",
    (
        "POST",
        "/v1/tokenize",
    ): "the router's own token count (what it checks against the context length and routes on): `{tokens, count, max_model_len}`; 501 `no_tokenizer` with no `model.path`",
    ("POST", "/tokenize"): "the older name of `POST /v1/tokenize`",
}

_INFERENCE = (
    "the API's own request (JSON); the router reads and validates what it routes on (400 naming the field)"
)

#: (method, path) -> the request it reads
REQUESTS: dict[tuple[str, str], str] = {
    ("POST", "/v1/chat/completions"): _INFERENCE
    + ": `n` at most 1, token limits, roles, `tools`, `tool_choice`",
    ("POST", "/v1/completions"): _INFERENCE + ": `n` at most 1, token limits",
    ("POST", "/generate"): _INFERENCE + ": `text` or `input_ids`, `sampling_params`",
    ("POST", "/v1/embeddings"): _INFERENCE,
    ("POST", "/v1/messages"): _INFERENCE + " (converted to chat as SGLang converts it, for the features)",
    ("POST", "/v1/messages/count_tokens"): _INFERENCE,
    ("POST", "/v1/responses"): _INFERENCE + " (converted to chat as SGLang converts it, for the features)",
    ("POST", "/admin/workers"): '`{"role": "prefill" | "decode" (default prefill), "url", "bootstrap_port" '
    '(prefill: default 8998), "kv_events" (e.g. "tcp://host:5557"), "kv_topic" (default "kv")}`; 422 naming '
    "a bad field (the URL's host, and the KV-events host, within `router.admin.worker_networks` when set); "
    "409 when the worker is there already",
    ("DELETE", "/admin/workers"): '`{"id": N}` or `{"url", "role"}` (role optional)',
    ("POST", "/admin/workers/drain"): '`{"id": N}` or `{"url", "role"}`, and `"timeout_s"` (optional); 202',
    ("POST", "/admin/workers/{wid}/drain"): "`?timeout_s=` (optional); 202",
    ("GET", "/admin/cost_model/observations"): "`?format=jsonl` (default) or `?format=csv`",
    ("POST", "/v1/tokenize"): '`{"prompt": str | [str]}` or `{"messages": [...]}` (exactly one), '
    '`"add_special_tokens"` (default true), `"add_generation_prompt"`',
    ("POST", "/tokenize"): "as `POST /v1/tokenize`",
}
