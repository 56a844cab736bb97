"""TEST-ONLY stand-in for the CPU build of ``sgl_kernel`` (not on PyPI).

Never shipped: it lives under tests/ and is put on PYTHONPATH of CPU SGLang workers by the CPU
integration tier only. SGLang 0.5.23 with ``--device cpu`` imports two names from sgl_kernel at
module import time; they are implemented here in plain torch/ctypes (slow, correct). Any other
name resolves to a function that raises NotImplementedError when *called*, so a code path that
needs a real CPU kernel fails loudly instead of silently computing garbage.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+smetric-test-stand-in"
STAND_IN = True


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th slice of out_cache_loc."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    off = 0
    for row, s, e in zip(rows, starts, ends):
        n = e - s
        if n > 0:
            req_to_token[row, s:e] = out_cache_loc[off : off + n].to(req_to_token.dtype)
        off += n


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every layer buffer (raw pointer, bytes per token slot): copy slot src -> slot tgt."""
    ptrs = data_ptrs.tolist()
    strd = strides.tolist()
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist()))
    for ptr, stride in zip(ptrs, strd):
        for t, s in pairs:
            if t != s:
                ctypes.memmove(ptr + t * stride, ptr + s * stride, stride)


def _missing(name: str):
    def fn(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: not provided by the test-only stand-in (tests/sglang_cpu/shim); "
            "the real CPU build of sgl_kernel is not on PyPI"
        )

    fn.__name__ = name
    return fn


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)


torch.ops  # noqa: B018  (import torch eagerly, as the real package does)
