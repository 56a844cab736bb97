"""Build a tiny random-weight Llama + tokenizer locally (test-only; never from a hub).

Run under the sglang interpreter (needs torch, transformers, tokenizers):

    /opt/sglang-venv/bin/python tests/sglang_cpu/build_tiny_llama.py OUT_DIR

Deterministic: fixed corpus, fixed seed; a second run with the same OUT_DIR is a no-op.
"""

from __future__ import annotations

import importlib.util
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
VOCAB = 512


def _tiny_model():
    """The project's tokenizer builder, loaded by path (the SGLang venv does not install stack)."""
    path = Path(__file__).resolve().parents[2] / "stack" / "models" / "tiny.py"
    spec = importlib.util.spec_from_file_location("_tiny_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    _tiny_model().build_tiny_model(out, VOCAB, 4096, CHAT_TEMPLATE)
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    ids = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    special = {t["content"]: t["id"] for t in ids}
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
        eos_token_id=special["<|im_end|>"],
        pad_token_id=special["<|endoftext|>"],
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
