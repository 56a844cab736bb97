"""Build a tiny local model directory (tokenizer + chat template). No hub.

Used by ``smetric up`` (emulated, ``launch.tokenizer: tiny``, no model path), the benchmarks and the
tests.

The tokenizer is a byte-level BPE trained in-process on a fixed corpus (deterministic),
with Qwen-style special tokens and a Qwen-style (ChatML) chat template, so the router's
features code runs exactly as it would on a real model directory.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n' }}{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- elif message.content %}{%- for part in message.content %}"
    "{%- if part.type == 'text' %}{{- part.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message.tool_calls %}{%- for tc in message.tool_calls %}"
    "{{- '\\n<tool_call>\\n' + (tc.function | tojson) + '\\n</tool_call>' }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def main(argv):\n    return run(parse(argv))\n",
    "You are a helpful coding agent. Read the file, fix the bug, run the tests.",
    "tool_call tool_response function arguments name path content result error",
    "import os, sys, json; print(json.dumps({'ok': True, 'value': 42}))",
    "assistant user system hello world session turn prefix cache router worker",
]

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tiny_model(
    path: str | Path,
    vocab_size: int = 600,
    context_length: int = 131072,
    chat_template: str = CHAT_TEMPLATE,
) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``config.json`` under ``path``.

    Only ``tokenizers`` is needed, so the real-SGLang tier's model builder (which runs inside
    the SGLang venv) loads this file by path and adds random weights on top.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    tok.save(str(p / "tokenizer.json"))
    (p / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": context_length,
                "chat_template": chat_template,
            },
            indent=1,
        )
    )
    (p / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": tok.get_vocab_size(),
                "max_position_embeddings": context_length,
            },
            indent=1,
        )
    )
    return p


if __name__ == "__main__":  # pragma: no cover
    import sys

    print(build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-model"))
