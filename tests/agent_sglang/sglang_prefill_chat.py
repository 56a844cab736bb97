"""Run under SGLang's interpreter: for each Anthropic Messages body and the chat body the router
sends as its PD prefill half (``stack.decode_router.prefill_meta.messages_as_chat``), SGLang
0.5.23's own conversion of the first (``AnthropicServing._convert_to_chat_completion_request``)
and its parse of the second (``ChatCompletionRequest``), each then through its chat step
(``OpenAIServingChat._process_messages``). stdin JSON: {"model_dir": ..., "pairs": [{"messages":
{...}, "chat": {...}}]}. Prints one JSON list: per pair {"ids": [..], "chat_ids": [..],
"differ": {field: [messages', chat's]}} (the requests' fields that differ, the ones that only
the prefill half sets left out) or {"error": "..."}. Test-only helper for
tests/integration/test_prefill_chat_sglang.py; no engine, no GPU.
"""

from __future__ import annotations

import json
import logging
import sys
import types

logging.disable(logging.CRITICAL)

#: fields only the prefill half sets (or that only change how the answer is sent)
_OWN = {
    "stream",
    "stream_options",
    "return_meta_info",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "rid",
}


def _serving(model_dir: str):
    import sglang.srt.entrypoints.openai.serving_chat as sc
    from sglang.srt.entrypoints.anthropic.serving import AnthropicServing
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.srt.parser.template_manager import TemplateManager
    from transformers import AutoTokenizer

    bag = types.SimpleNamespace(default_chat_template_kwargs=None, enable_response_store=False)
    if hasattr(sc, "get_serving"):
        sc.get_serving = lambda: bag
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
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
    templates = TemplateManager()
    templates.load_chat_template(tm, None, model_dir)
    chat = OpenAIServingChat(tm, templates)
    return tokenizer, chat, AnthropicServing(chat)


def _ids(tokenizer, res) -> list[int]:
    return list(res.prompt_ids if isinstance(res.prompt_ids, list) else tokenizer.encode(res.prompt_ids))


def main() -> None:
    from sglang.srt.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    spec = json.load(sys.stdin)
    tokenizer, chat, anthropic = _serving(spec["model_dir"])
    out = []
    for pair in spec["pairs"]:
        try:
            a = anthropic._convert_to_chat_completion_request(AnthropicMessagesRequest(**pair["messages"]))
            c = ChatCompletionRequest(**pair["chat"])
            da, dc = a.model_dump(), c.model_dump()
            differ = {
                k: [da.get(k), dc.get(k)]
                for k in set(da) | set(dc)
                if k not in _OWN and da.get(k) != dc.get(k)
            }
            ids = _ids(tokenizer, chat._process_messages(a, False))
            chat_ids = _ids(tokenizer, chat._process_messages(c, False))
            out.append(
                {"ids": ids, "chat_ids": chat_ids, "differ": json.loads(json.dumps(differ, default=str))}
            )
        except Exception as e:  # noqa: BLE001 - reported per pair
            out.append({"error": f"{type(e).__name__}: {e}"})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
