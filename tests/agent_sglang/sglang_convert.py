"""Run under SGLang's interpreter: SGLang's own Anthropic / Responses conversion plus its chat
template step, on a list of request bodies (stdin JSON: {"model_dir": ..., "cases": [{"api":
"anthropic"|"responses", "body": {...}}]}). Prints one JSON list: per case either
{"ids": [...], "messages": [...], "tools": [...]} (what the template got, and the prompt ids) or
{"error": "..."} (SGLang refused it). Test-only helper for tests/integration/test_agent_sglang_parity.py.

The serving objects are built on a stub tokenizer manager around the model dir's HF tokenizer
(no engine, no GPU): exactly SGLang's OpenAIServingChat / OpenAIServingResponses /
AnthropicServing code runs from the request model to the prompt ids.
"""

from __future__ import annotations

import json
import logging
import sys
import types

logging.disable(logging.CRITICAL)


def main() -> None:
    spec = json.load(sys.stdin)
    import sglang.srt.entrypoints.openai.serving_chat as sc
    import sglang.srt.entrypoints.openai.serving_responses as sr
    from sglang.srt.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from sglang.srt.entrypoints.anthropic.serving import AnthropicServing
    from sglang.srt.entrypoints.openai.protocol import ResponsesRequest
    from sglang.srt.entrypoints.openai.serving_responses import OpenAIServingResponses
    from sglang.srt.parser.template_manager import TemplateManager
    from transformers import AutoTokenizer

    # the process-wide config a launched server publishes: only what these classes read
    bag = types.SimpleNamespace(default_chat_template_kwargs=None, enable_response_store=False)
    for mod in (sc, sr):
        if hasattr(mod, "get_serving"):
            mod.get_serving = lambda: bag
    if hasattr(sr, "get_disagg"):
        sr.get_disagg = lambda: types.SimpleNamespace(disaggregation_mode="null")
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    hf_config = types.SimpleNamespace(model_type="llama", architectures=["LlamaForCausalLM"])
    model_config = types.SimpleNamespace(
        hf_config=hf_config, is_multimodal=False, get_default_sampling_params=lambda: {}
    )
    tm = types.SimpleNamespace(
        tokenizer=tokenizer,
        processor=None,
        model_config=model_config,
        server_args=None,
        served_model_name="tiny",
        config_value=lambda name: None,
    )
    template_manager = TemplateManager()
    template_manager.load_chat_template(tm, None, spec["model_dir"])
    serving = OpenAIServingResponses(tm, template_manager)
    anthropic = AnthropicServing(serving)

    captured: dict = {}
    orig = serving._render_and_encode_chat_template

    def spy(messages, *, tools, **kw):
        captured["messages"] = json.loads(json.dumps(messages, default=str))
        captured["tools"] = json.loads(json.dumps(tools, default=str))
        return orig(messages, tools=tools, **kw)

    serving._render_and_encode_chat_template = spy

    out = []
    for case in spec["cases"]:
        captured.clear()
        try:
            if case["api"] == "anthropic":
                req = AnthropicMessagesRequest(**case["body"])
                chat = anthropic._convert_to_chat_completion_request(req)
                res = serving._process_messages(chat, False)
            else:
                req = ResponsesRequest(**case["body"])
                _, _, prompts, res = _run(serving._make_request(req, None, tokenizer))
            ids = res.prompt_ids if isinstance(res.prompt_ids, list) else tokenizer.encode(res.prompt_ids)
            out.append(
                {
                    "ids": list(ids),
                    **captured,
                    "inline_system": serving.supports_inline_system,
                    "content_format": template_manager.jinja_template_content_format,
                }
            )
        except Exception as e:  # SGLang refused the request
            out.append({"error": f"{type(e).__name__}: {e}"})
    json.dump(out, sys.stdout)


def _run(coro):
    import asyncio

    return asyncio.run(coro)


if __name__ == "__main__":
    main()
