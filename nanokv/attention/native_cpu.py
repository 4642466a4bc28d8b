"""The C decode kernel (`nanokv/layers/csrc/decode_attention.c`) over a float32 pool on CPU.

Decodes read each request's K/V rows once, in place, in one pass with an online softmax, all
heads of a request in one work item; prefill chunks go through the PyTorch path. Usable where the
kernel builds (a C compiler with OpenMP) and the pool is float32.
"""

from __future__ import annotations

import torch

from nanokv.attention.common import CommonAttentionMetadata
from nanokv.attention.torch_paged import TorchPagedBackend
from nanokv.cache.kv_pool import KVPool
from nanokv.layers.attention import AttentionMetadata
from nanokv.layers.native_attention import (
    NativeKernelUnavailable,
    build_decode_runs,
    load_decode_kernel,
)


class NativeCPUBackend(TorchPagedBackend):
    name = "native"
    description = "C decode kernel, PyTorch prefill"

    @classmethod
    def why_not(cls, kv_cache, device: torch.device) -> tuple[str, bool] | None:
        if device.type != "cpu":
            return f"it runs on CPUs only (device {device.type})", True
        if not isinstance(kv_cache, KVPool):
            return "a quantized KV cache has its own attention", True
        if kv_cache.layout.dtype != torch.float32:
            return f"it reads float32 caches only (the pool is {kv_cache.layout.dtype})", False
        try:
            load_decode_kernel()
        except NativeKernelUnavailable as e:
            return str(e), False
        return None

    def _decode_metadata(self, meta: AttentionMetadata, c: CommonAttentionMetadata) -> None:
        meta.decode_runs = build_decode_runs(c.decode_block_tables, c.decode_context_lens,
                                             self.block_size, meta.window)
