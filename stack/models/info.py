"""SGLang's ``/model_info`` answer for a text-only model, shared by the router and the
emulated worker so both describe a model the way SGLang 0.5.23 does (field names and the
fixed values of a text generation model without parsers)."""

from __future__ import annotations

from typing import Any


def sglang_model_info(
    model_path: str | None, served_name: str | None, tokenizer_path: str | None, disaggregation_mode: str
) -> dict[str, Any]:
    """The fields SGLang's ``/model_info`` returns; callers may add their own."""
    return {
        "model_path": model_path,
        "served_model_name": served_name,
        "tokenizer_path": tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": None,
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": disaggregation_mode,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": None,
        "architectures": None,
    }
