"""TEST-ONLY patch: SGLang HiCache on a CPU-only machine (never shipped; tests/ only).

Active only when ``SMETRIC_TEST_HICACHE_CPU_PATCH=1`` (the CPU tier's HiCache case sets it on the
one worker that needs it). SGLang 0.5.23's HiCache host pool assumes a GPU in two places:

1. ``pool_host/common.py`` pins the host pool with ``cudaHostRegister`` (torch.cuda.cudart()),
   which raises "Found no NVIDIA driver" here. Patched to a no-op: on CPU the "device" KV pool
   is host memory already, there is nothing to pin for.
2. ``pool_host/mha.py`` imports its host<->device copy ops from ``sgl_kernel.kvcacheio`` only
   for CUDA/ROCm (and from the XPU wheel on XPU), so on CPU the names are undefined. With
   ``--hicache-io-backend direct`` the page_first_direct layout (the one the Mooncake store
   needs) uses ``transfer_kv_per_layer_direct_pf_lf`` (load) and
   ``transfer_kv_all_layer_direct_lf_pf`` (backup), plus ``transfer_kv_direct`` for layer_first;
   they are given here in plain torch.

The patch is applied by an import hook right after each module executes, in every SGLang
process (the scheduler is a spawned interpreter that reads PYTHONPATH again).
"""

from __future__ import annotations

import importlib.abc
import os
import sys


def _noop_register(buffer, registration_granularity_bytes=None):
    buffer._sglang_cuda_host_registered_ranges = []


def _noop_unregister(*args, **kwargs):
    return None


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """layer_first: copy token rows src[src_indices] -> dst[dst_indices], layer by layer."""
    import torch

    si = src_indices.to(device="cpu", dtype=torch.long)
    di = dst_indices.to(device="cpu", dtype=torch.long)
    for s, d in zip(src_layers, dst_layers):
        d[di] = s[si].to(d.dtype)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    """host page_first_direct [page, layer, page_size, head, dim] -> device layer [token, head, dim]."""
    import torch

    si = src_indices.to(device="cpu", dtype=torch.long)
    di = dst_indices.to(device="cpu", dtype=torch.long)
    for host, dev in zip(src_ptrs, dst_ptrs):
        dev[di] = host[si // page_size, layer_id, si % page_size].to(dev.dtype)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """device layers (all K layers, then all V layers) -> host page_first_direct buffers [K, V]."""
    import torch

    si = src_indices.to(device="cpu", dtype=torch.long)
    di = dst_indices.to(device="cpu", dtype=torch.long)
    n = len(src_ptrs) // len(dst_ptrs)
    for j, host in enumerate(dst_ptrs):
        for layer in range(n):
            host[di // page_size, layer, di % page_size] = src_ptrs[j * n + layer][si].to(host.dtype)


def _patch_common(mod):
    mod._cuda_host_register = _noop_register
    mod._cuda_host_unregister = _noop_unregister


def _patch_pool(mod):
    if hasattr(mod, "_cuda_host_unregister"):
        mod._cuda_host_unregister = _noop_unregister
    for fn in (transfer_kv_direct, transfer_kv_per_layer_direct_pf_lf, transfer_kv_all_layer_direct_lf_pf):
        if fn.__name__ not in vars(mod):
            setattr(mod, fn.__name__, fn)


_TARGETS = {
    "sglang.srt.mem_cache.pool_host.common": _patch_common,
    "sglang.srt.mem_cache.pool_host.mha": _patch_pool,
    "sglang.srt.mem_cache.pool_host.base": _patch_pool,
}


class _PatchFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        orig = spec.loader.exec_module

        def exec_module(module, _orig=orig, _patch=_TARGETS[name]):
            _orig(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("SMETRIC_TEST_HICACHE_CPU_PATCH") == "1":
    sys.meta_path.insert(0, _PatchFinder())
