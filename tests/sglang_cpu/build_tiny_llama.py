"""Build a random-weight Llama + tokenizer locally (test-only; never from a hub).

Run under the sglang interpreter (needs torch, transformers, tokenizers):

    /opt/sglang-venv/bin/python tests/sglang_cpu/build_tiny_llama.py OUT_DIR [--size tiny|small]
    /opt/sglang-venv/bin/python tests/sglang_cpu/build_tiny_llama.py --cached --size small

Two shapes (SHAPES):
- ``tiny``: hidden 128, 2 layers, 4096 positions (~1 MB): the protocol checks of the CPU tier.
- ``small``: hidden 1024, 8 layers, GQA 16/4 heads, intermediate 2816, 8192 positions (~190 MB of
  bf16 weights), the shape of a small Llama/Qwen: large enough that prefill time on CPU grows
  with the tokens (the calibration and real-engine fidelity runs).

``--cached`` builds into ``~/.cache/smetric/sglang-cpu-models/<size>-<version>`` (or
``$SMETRIC_MODEL_CACHE``) and prints the path; later runs reuse it.

Deterministic: fixed corpus, fixed seed; a second run with the same OUT_DIR is a no-op.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
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
# bump when a shape changes, so a cached build of the old shape is not reused
VERSION = 1
SHAPES: dict[str, dict] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        weight_scale=4.0,
    ),
    "small": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        weight_scale=1.0,
    ),
}


def _tiny_model():
    """The project's tokenizer builder, loaded by path (the SGLang venv does not install stack)."""
    path = Path(__file__).resolve().parents[2] / "stack" / "models" / "tiny.py"
    spec = importlib.util.spec_from_file_location("_tiny_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cache_dir(size: str) -> Path:
    """Where ``--cached`` keeps a build of ``size`` between runs."""
    root = os.environ.get("SMETRIC_MODEL_CACHE") or str(
        Path.home() / ".cache" / "smetric" / "sglang-cpu-models"
    )
    return Path(root) / f"{size}-v{VERSION}"


def build(out: Path, size: str = "tiny") -> Path:
    if size not in SHAPES:
        raise SystemExit(f"unknown --size {size!r}: one of {', '.join(SHAPES)}")
    shape = dict(SHAPES[size])
    scale = shape.pop("weight_scale")
    out.mkdir(parents=True, exist_ok=True)
    done = out / "model.safetensors.index.json", out / "model.safetensors"
    if any(d.exists() for d in done) and (out / "tokenizer.json").exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    _tiny_model().build_tiny_model(out, VOCAB, shape["max_position_embeddings"], CHAT_TEMPLATE)
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    ids = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    special = {t["content"]: t["id"] for t in ids}
    cfg = LlamaConfig(
        vocab_size=max(vocab, VOCAB),
        **shape,
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
            p.mul_(scale) if p.dim() > 1 and scale != 1.0 else None
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return out


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="output directory (omit with --cached)")
    ap.add_argument("--size", default="tiny", choices=sorted(SHAPES), help="model shape (default tiny)")
    ap.add_argument("--cached", action="store_true", help="build into (or reuse) the cache directory")
    a = ap.parse_args(argv)
    if not a.out and not a.cached:
        ap.error("give OUT_DIR or --cached")
    print(build(cache_dir(a.size) if a.cached else Path(a.out), a.size))


if __name__ == "__main__":
    main(sys.argv[1:])
