"""Build a tiny random-weight Llama + tokenizer locally (test-only; never from a hub).

Run under the sglang interpreter (needs torch, transformers, tokenizers):

    /opt/sglang-venv/bin/python tests/sglang_cpu/build_tiny_llama.py OUT_DIR

Deterministic: fixed corpus, fixed seed; a second run with the same OUT_DIR is a no-op.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- elif message.content %}{%- for part in message.content %}"
    "{%- if part.type == 'text' %}{{- part.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def main(argv):\n    return run(parse(argv))\n",
    "You are a helpful coding agent. Read the file, fix the bug, run the tests.",
    "tool_call tool_response function arguments name path content result error",
    "import os, sys, json; print(json.dumps({'ok': True, 'value': 42}))",
    "assistant user system hello world session turn prefix cache router worker",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 512


def build(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.save(str(out / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 4096,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
        )
    )
    cfg = LlamaConfig(
        vocab_size=max(vocab, VOCAB),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # larger logits spread: greedy outputs vary with the prompt
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-llama")))
