"""One step's attention inputs as the runner describes them, before any backend shapes them.

The runner builds a `CommonAttentionMetadata` once per step from the scheduler's output (host
lists only, no device work); the chosen backend turns it into its own metadata (`build`), once per
step, shared by every layer (vLLM's CommonAttentionMetadata / AttentionMetadataBuilder split).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillChunk:
    """One request's prefill chunk inside the flattened batch."""

    query_start: int  # offset of its first token in the batch
    query_len: int
    context_len: int  # cached slots after this step (past + this chunk)
    block_table: list[int]  # covering context_len slots


@dataclass
class CommonAttentionMetadata:
    """Addressing of one step: decodes first (one token each), then prefill chunks."""

    slot_mapping: list[int]  # [T] flat slot of each new token
    num_decode_tokens: int
    decode_block_tables: list[list[int]]  # per decode request, covering its context
    decode_context_lens: list[int]  # per decode request: cached slots after this step
    prefills: list[PrefillChunk]
    # the KV cache's write plan for the step (`KVCache.begin_step`)
    write_plan: object = None
    # when a request has per-layer block tables (nanokv.cache.layer_slices): each layer's own
    # addressing, in flat layer-slice ids (`KVPool.flat_layers`); None: all layers share this one
    per_layer: list[CommonAttentionMetadata] | None = None

    @property
    def num_decodes(self) -> int:
        return len(self.decode_context_lens)


@dataclass
class StepAttention:
    """What the model's attention layers receive for one forward pass."""

    backend: object  # the engine's AttentionBackend
    metadata: object  # what `backend.build` made of the step
    # rows of the step's queries that KV policies asked for ([Tc] int64), or None; each layer
    # returns its post-RoPE q at these rows
    capture_rows: torch.Tensor | None = None
