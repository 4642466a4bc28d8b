"""The Triton backend's metadata: one step's addressing as int32 device tensors, built once per
step from `CommonAttentionMetadata` (host lists packed into one buffer, uploaded once), and the
static version a CUDA graph replays (`graph_decode_metadata` / `fill_graph_decode` in
`nanokv.attention.backend`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanokv.attention.common import CommonAttentionMetadata, PrefillChunk
from nanokv.transfer import upload, upload_parts


@dataclass
class PrefillChunks:
    """The step's prefill chunks (int32, [C] each)."""

    query_start: torch.Tensor
    query_len: torch.Tensor
    context_lens: torch.Tensor  # cached slots after this step
    block_tables: torch.Tensor  # [C, max_blocks]
    max_query_len: int  # the longest chunk's (the kernel's grid)


@dataclass
class TritonStep:
    """Decodes first (rows [0, num_rows)), then the prefill chunks."""

    slot_mapping: torch.Tensor  # [>= T] int64 slot of each new token (< 0: not written)
    num_rows: int  # decode rows
    block_tables: torch.Tensor  # [>= num_rows, max_blocks] int32
    context_lens: torch.Tensor  # [>= num_rows] int32 cached slots after this step (0: padding)
    num_splits: int  # decode splits over each request's context
    prefill: PrefillChunks | None = None
    flat_layers: bool = False  # block ids are flat layer-slice ids (per-layer block tables)
    per_layer: list[TritonStep] | None = None  # one step per layer instead of this one
    # a CUDA graph's static buffer [max_batch, max_blocks + 1]: tables, then context lengths
    graph_buffer: torch.Tensor | None = None


def padded_rows(tables: list[list[int]], extra: list[int] | None = None) -> np.ndarray:
    """Block tables as one zero-padded int32 array [n, width] (+ a column `extra` if given)."""
    width = max((len(t) for t in tables), default=0)
    out = np.zeros((len(tables), width + (extra is not None)), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    if extra is not None:
        out[:, width] = extra
    return out


def build_step(common: CommonAttentionMetadata, device: torch.device,
               slot_mapping: torch.Tensor | None, splits, flat_layers: bool = False
               ) -> TritonStep:
    """The step's tensors; `splits(rows, max_context)` gives the decode split count;
    slot_mapping: the step's slots as a device tensor when the caller has one."""
    if slot_mapping is None:
        slot_mapping = upload(np.asarray(common.slot_mapping, dtype=np.int64), device)
    nd = common.num_decodes
    chunks = common.prefills
    parts = []  # int32 arrays, packed into one upload
    decode = padded_rows(common.decode_block_tables, common.decode_context_lens)
    parts.append(decode)  # [nd, width + 1]
    tables = padded_rows([p.block_table for p in chunks])  # [C, max_blocks]
    if chunks:
        parts += chunk_parts(chunks, tables)
    views = upload_parts(parts, device, np.int32)  # one copy, no wait for queued work
    decode_view = views[0].view(nd, decode.shape[1])  # [nd, width + 1]
    prefill = chunk_views(chunks, tables, views[1:]) if chunks else None
    max_context = max(common.decode_context_lens, default=0)
    return TritonStep(slot_mapping, nd, decode_view[:, :-1], decode_view[:, -1],
                      splits(nd, max_context) if nd else 1, prefill, flat_layers)


def chunk_parts(chunks: list[PrefillChunk], tables: np.ndarray) -> list:
    """A step's prefill chunks as parts of an int32 upload (`upload_parts`): query starts,
    lengths and context lengths [C] each, then `tables` [C, width] (the chunks' block tables,
    or rows of another cache)."""
    return [[p.query_start for p in chunks], [p.query_len for p in chunks],
            [p.context_len for p in chunks], tables]


def chunk_views(chunks: list[PrefillChunk], tables: np.ndarray, views: list[torch.Tensor]
                ) -> PrefillChunks:
    """`chunk_parts`' uploaded views as the prefill kernel's chunk tensors."""
    return PrefillChunks(views[0], views[1], views[2], views[3].view(tables.shape),
                         max(p.query_len for p in chunks))


def graph_step(max_batch: int, max_blocks: int, device: torch.device) -> TritonStep:
    """Static tensors for decode-only steps of up to max_batch rows of up to max_blocks blocks:
    slot_mapping [max_batch] int64, block_tables [max_batch, max_blocks] and context_lens
    [max_batch] int32 (views of one buffer, so a step fills both with one copy)."""
    if max_batch < 1 or max_blocks < 1:
        raise ValueError(f"max_batch and max_blocks must be >= 1, got {max_batch}, {max_blocks}")
    buf = torch.zeros(max_batch, max_blocks + 1, dtype=torch.int32, device=device)
    slots = torch.full((max_batch,), -1, dtype=torch.long, device=device)
    return TritonStep(slots, 0, buf[:, :max_blocks], buf[:, max_blocks], 1, graph_buffer=buf)


def fill_graph_step(meta: TritonStep, common: CommonAttentionMetadata, batch: int,
                    num_splits: int) -> None:
    """This step's decodes into meta's static tensors, rows [n, batch) padded (slot -1,
    context 0), in place; meta.num_rows = batch."""
    fill_graph_tables(meta, common, batch, num_splits)
    n = common.num_decodes
    slots = np.full(batch, -1, dtype=np.int64)
    slots[:n] = common.slot_mapping
    meta.slot_mapping[:batch].copy_(torch.from_numpy(slots), non_blocking=True)


def fill_graph_tables(meta: TritonStep, common: CommonAttentionMetadata, batch: int,
                      num_splits: int) -> None:
    """`fill_graph_step` without the slots (for a backend whose KV cache plans its own
    writes): the block tables and context lengths, num_rows and num_splits."""
    if meta.graph_buffer is None:
        raise ValueError("fill_graph_decode needs metadata from graph_decode_metadata")
    max_batch, width = meta.graph_buffer.shape[0], meta.graph_buffer.shape[1] - 1
    n = common.num_decodes
    if common.prefills or common.per_layer is not None or len(common.slot_mapping) != n:
        raise ValueError("a CUDA-graph step holds decodes only, on shared block tables "
                         f"(got {len(common.prefills)} prefill chunks, "
                         f"per-layer tables: {common.per_layer is not None})")
    if not n <= batch <= max_batch:
        raise ValueError(f"batch must be between the step's {n} decodes and max_batch "
                         f"{max_batch}, got {batch}")
    longest = max((len(t) for t in common.decode_block_tables), default=0)
    if longest > width:
        raise ValueError(f"a decode's block table has {longest} blocks, more than the graph's "
                         f"max_blocks {width}")
    host = np.zeros((batch, width + 1), dtype=np.int32)
    for i, t in enumerate(common.decode_block_tables):
        host[i, :len(t)] = t
    host[:n, width] = common.decode_context_lens
    # a pageable source: staged at once, the copy does not wait for the device's queued work
    meta.graph_buffer[:batch].copy_(torch.from_numpy(host), non_blocking=True)
    meta.num_rows = batch
    meta.num_splits = num_splits
