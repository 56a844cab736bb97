"""The error every agent-API validator raises (answered in the API's own envelope)."""

from __future__ import annotations


class AgentError(ValueError):
    """A client error: ``status`` (400 unless said), Anthropic's ``type`` and a message;
    ``param`` names the offending field (used in OpenAI's envelope)."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, type_: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type_
