"""One entry for both agent APIs: validate a body and convert it to chat (``convert``).

Kept apart from :mod:`.chat_step` so the shared chat step never imports the APIs built on it.
"""

from __future__ import annotations

from typing import Any

from stack.agent_apis import anthropic, responses
from stack.agent_apis.chat_step import ChatRequest, inline_system


def convert(api: str, body: dict[str, Any], template: str | None, count_only: bool = False) -> ChatRequest:
    """Validate and convert an ``api`` ("anthropic" | "responses") body; :class:`AgentError`
    when it is not valid."""
    if api == "anthropic":
        anthropic.validate(body, count_only)
        return anthropic.to_chat(body, inline_system(template))
    responses.validate(body)
    return responses.to_chat(body, inline_system(template))
