"""Agent APIs: Anthropic Messages and OpenAI Responses, converted to chat as SGLang does.

SGLang 0.5.23 serves ``/v1/messages`` (+ ``/count_tokens``) and ``/v1/responses`` by
converting each request to a Chat Completions request and running its chat path. This
package holds that conversion (request -> chat messages + tools, then SGLang's chat-template
step) as pure functions, shared by the router (features: tokens, turn, est_hit) and the
emulated worker (its prompt), so both give the token count SGLang gives.

- :mod:`.anthropic`: validation and conversion of a Messages request.
- :mod:`.responses`: validation and conversion of a (stateless) Responses request.
- :mod:`.chat_step`: SGLang's chat step (message normalization, content format, tools).
- :mod:`.convert`: validate and convert either API's body (the one entry point).
"""

from stack.agent_apis.errors import AgentError

__all__ = ["AgentError"]
