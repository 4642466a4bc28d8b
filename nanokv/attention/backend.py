"""The attention-backend contract.

A backend owns one way of computing attention over the engine's KV cache. It is chosen once, at
start-up (`selector.select_backend`), and then every step goes

    metadata = backend.build(common)                       # once per step, all layers
    out = backend.forward(layer, q, k, v, k_pre, metadata, scale)   # per layer

`forward` writes the step's new K/V into the cache (through the KV cache's `write_layer`, or its
own in-place write) and returns the attention output. q: [T, Hq, D] and k: [T, Hkv, D] after
RoPE, k_pre: the keys before RoPE (a store may keep those), v: [T, Hkv, D]; out: [T, Hq, D].

A model with an attention logit soft-cap (Gemma 2: scores c * tanh(scores / c) before the
softmax) gets a backend that applies it (`supports_soft_cap`), constructed with `soft_cap=c`.

Each backend says why it cannot serve a KV cache on a device (`why_not`): None when it can,
else (reason, structural) where structural means "not made for this cache or device" (no
warning when auto passes it over) rather than "made for it but not usable here" (a failed build,
an unsupported dtype: auto warns).

Policy views: a backend that decodes a quantized store's blocks faster than the store's own
`read_blocks` installs that reader on the store when it is built (`store.use_block_reader`); KV
policies' `policy_view` then reads through it (the C reader on CPU, the Triton read on CUDA), and
`read_blocks` stays the reference. The reader gives the same values within float rounding.

CUDA graphs for decode (a backend that sets `supports_cuda_graphs = True`):

    meta = backend.graph_decode_metadata(max_batch, max_blocks)   # once, before capture
    # per step, before replaying the graph captured for a batch of `batch` rows:
    backend.fill_graph_decode(meta, common, batch)
    out = backend.forward(layer, q, k, v, k_pre, meta, scale)      # the captured call

`graph_decode_metadata` makes static device tensors for a decode-only step of up to `max_batch`
requests, each with up to `max_blocks` blocks: at least slot_mapping [max_batch] int64,
block_tables [max_batch, max_blocks] int32 and context_lens [max_batch] int32, plus whatever the
backend's forward needs; `num_rows` (the batch being run) is a field of the metadata, set by
`fill_graph_decode`. `fill_graph_decode` copies the step's decode addressing into those tensors
in place (rows from len(common.decode_context_lens) up to `batch` are padding: slot -1 and
context length 0, so they write nothing and attend to nothing, output zeros) and sets any per-step
state the write path needs, without allocating. `forward` with such metadata does no host
synchronisation (no .item(), .tolist(), value-dependent shapes or grids): its launches depend
only on (batch, max_blocks) and constants fixed at construction. One metadata object may serve
graphs of several batch sizes (each graph reads the first `batch` rows of the same tensors).
Kernels may compile on their first call for a shape (Triton does): run fill + forward once for
each batch size outside the capture (a warm-up) before capturing it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from nanokv.attention.common import CommonAttentionMetadata


class AttentionBackend(ABC):
    name: ClassVar[str] = ""  # the attention_backend option that selects it
    description: ClassVar[str] = ""  # for the start-up log
    # True: it dequantizes the blocks it reads into transient buffers (the memory plan reserves
    # the KV cache spec's decode scratch for them); False: it reads the cache in place
    dequantizes_blocks: ClassVar[bool] = False
    supports_cuda_graphs: ClassVar[bool] = False  # graph_decode_metadata / fill_graph_decode
    # device types on which "auto" may choose it (None: any); a name still selects it elsewhere
    # when why_not allows (the Triton backend on CPU under the interpreter, for tests)
    auto_devices: ClassVar[tuple[str, ...] | None] = None
    # True: it applies a model's attention logit soft-cap (`soft_cap`, module doc)
    supports_soft_cap: ClassVar[bool] = False

    def __init__(self, kv_cache, device: torch.device, soft_cap: float | None = None) -> None:
        if soft_cap is not None and not self.supports_soft_cap:
            raise ValueError(f"attention backend {self.name!r} applies no attention logit "
                             f"soft-cap (the model's is {soft_cap})")
        self.kv_cache = kv_cache
        self.device = device
        self.soft_cap = soft_cap

    @classmethod
    @abstractmethod
    def why_not(cls, kv_cache, device: torch.device) -> tuple[str, bool] | None:
        """None when this backend can serve `kv_cache` on `device`, else (reason, structural)."""

    @abstractmethod
    def build(self, common: CommonAttentionMetadata):
        """This backend's metadata for the step (device tensors made here, once)."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_pre: torch.Tensor, metadata, scale: float) -> torch.Tensor:
        """Write the layer's new K/V, attend; returns [T, Hq, D]."""

    def graph_decode_metadata(self, max_batch: int, max_blocks: int):
        """Static device tensors for decode-only steps of up to max_batch rows (module doc)."""
        raise NotImplementedError(f"attention backend {self.name!r} does not support CUDA graphs")

    def fill_graph_decode(self, meta, common: CommonAttentionMetadata, batch: int) -> None:
        """Copy the step's decode addressing into `meta` in place, rows up to `batch` padded."""
        raise NotImplementedError(f"attention backend {self.name!r} does not support CUDA graphs")
