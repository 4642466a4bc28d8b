"""Triton attention over the KVQuant and KIVI stores on CUDA: decode reads the codes in place
(`nanokv/kernels/triton/kvquant_decode.py`); a step's prefill chunks attend in decode's view
(as `reference_quantized_attention`: each token sees an earlier one as the store held it once
the token was written, so outputs do not depend on chunking or prefix-cache hits). Per layer:
the pasts' partial blocks read into a staged cache before the write (`kvquant_read.py`, from
their staging rows when the step began: the write quantizes a block the chunk fills), the
write, the chunks' tokens as staged (`staged_rows`) into the staged cache; then every block of
the chunks' contexts, their own included, decoded into a scratch float cache (each distinct
block once, so a shared cached prefix is decoded once for all its chunks) and all chunks
through the paged prefill kernel's STAGED view (`prefill.py`: a block full by then from the
scratch, a block still filling from the staged cache, the token itself fresh); past
`prefill_scratch_slots` slots, chunks go in groups, two launches each. The KV write is the
store's: on CUDA both stores quantize on write in Triton (`kernels/triton/kvquant_write.py`,
`kivi_write.py`).

Layers with a sliding window (`KVLayout.sliding_windows`) pass it to both kernels: a decode's
splits over the blocks from its window's first on, each token of a chunk over its newest W.

Serves KVQuant with per-channel keys (before RoPE over the whole head, or after it) and KIVI,
at power-of-two block sizes; per-token KVQuant keys (the ablation layout) stay on the PyTorch
backend. CUDA graphs for the decode steps of both with their Triton writes
(`supports_cuda_graphs`): the step's write plan is copied into static tensors, one entry a row,
padded entries skipped by the kernels (`graph_write_plan` / `fill_graph_write`,
`nanokv/quant/graph_write.py`); a KIVI store whose value groups are not a power of two channels
writes in PyTorch and runs eagerly. On CPU only
under Triton's interpreter (TRITON_INTERPRET=1: the tests, against
`reference_quantized_attention`); "auto" chooses it on CUDA only. The decode kernel ran on an
H200 (docs/results/gpu/); the write and read kernels have not yet run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanokv.attention.backend import AttentionBackend
from nanokv.attention.common import CommonAttentionMetadata
from nanokv.attention.triton_metadata import (
    PrefillChunks,
    TritonStep,
    chunk_parts,
    chunk_views,
    fill_graph_tables,
    graph_step,
    padded_rows,
)
from nanokv.attention.triton_paged import SPLIT_CAP, TritonPagedBackend, interpreter_on
from nanokv.kernels.triton import triton_unavailable
from nanokv.layers.rotary import halves_repeat
from nanokv.quant.kivi_store import KIVIStore
from nanokv.quant.kvquant import centroid_table, uniform_grid
from nanokv.quant.graph_write import GraphWritePlan
from nanokv.quant.kvquant_store import KVQuantStore
from nanokv.quant.staging import staging_rows_before
from nanokv.transfer import upload, upload_parts
from nanokv.utils import cdiv


@dataclass
class PrefixGroup:
    """Prefill chunks whose blocks fit the scratch cache together: one read launch and one
    prefill launch a layer."""

    chunks: PrefillChunks  # block tables: rows of the scratch cache, not the store's blocks
    read_ids: torch.Tensor  # [n] int32 the chunks' distinct blocks: block i -> scratch row i
    stage_tables: torch.Tensor  # [C, w] int32 rows of the staged cache (`QuantPrefill`)


@dataclass
class QuantPrefill:
    """A step's prefill chunks in groups, each group's blocks (every block of a chunk's context,
    its own included) decoded into the scratch cache in turn (each layer, after the write); and
    each chunk's blocks from the one holding its first new token as a read of a partial block
    returns them (the staged cache, for the whole step): the past's partial block read before
    the write (which quantizes it if the chunk fills it), the chunk's tokens from their fresh
    K/V (`staged_rows`)."""

    groups: list[PrefixGroup]
    k_scratch: torch.Tensor  # [max(most rows of a group, 1), B, Hkv, D] in the layout's dtype
    v_scratch: torch.Tensor
    staged_ids: torch.Tensor  # [P] int32 the pasts' partial blocks -> staged rows [0, P)
    staging_rows: torch.Tensor  # [P] int32 their staging rows when the step began
    token_rows: torch.Tensor  # [N] int64 the chunks' batch rows (in chunk order)
    token_slots: torch.Tensor  # [N] int64 their flat slots (row * B + slot) in the staged cache
    k_staged: torch.Tensor  # [staged rows, B, Hkv, D] in the layout's dtype
    v_staged: torch.Tensor


@dataclass
class TritonQuantStep:
    write_plan: object
    num_decode_tokens: int
    prefill: QuantPrefill | None  # the step's prefill chunks, None if none
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32, the decode rows'
    context_lens: torch.Tensor | None = None  # [B] int32, cached slots incl. the new token
    num_splits: int = 1
    # a CUDA graph's static tables (block tables and context lengths) and write plan
    graph: tuple[TritonStep, GraphWritePlan] | None = None


def kernel_unfit(kv_cache) -> str | None:
    """Why the kernel cannot read this store, or None."""
    if not isinstance(kv_cache, (KVQuantStore, KIVIStore)):
        return (f"its kernel reads the kvquant and kivi stores (the cache is "
                f"{getattr(kv_cache, 'kv_cache_dtype', 'the float pool')})")
    bs = kv_cache.block_size
    if bs & (bs - 1):
        return f"its kernel takes power-of-two block sizes (block_size {bs})"
    if isinstance(kv_cache, KVQuantStore):
        if not kv_cache.staged:
            return "its kernel reads per-channel kvquant keys (per_channel_keys is off)"
        rotary = kv_cache.rotary if kv_cache.rope is not None else None
        if rotary is not None and rotary.cos.shape[-1] != kv_cache.layout.head_dim:
            return "its kernel rotates keys stored before RoPE over the whole head only"
        if rotary is not None and not (halves_repeat(rotary.cos) and halves_repeat(rotary.sin)):
            return ("its decode kernel rotates keys with RoPE tables whose two halves repeat "
                    "(cat(freqs, freqs), as every Hugging Face rope type makes them)")
    return None


class TritonQuantizedBackend(AttentionBackend):
    name = "triton"
    description = "Triton over the kvquant / kivi codes (decode in place, prefix decoded once)"
    auto_devices = ("cuda",)
    num_warps = 4
    num_stages = None  # the pipelining depth of a split's block loop (None: Triton's)
    unroll = 1  # blocks a loop iteration (2, 4: each block's loads independent of the last's)
    # the most prefix slots a step's prefill decodes into its scratch cache at once (2 x this x
    # Hkv x D elements of the layout's dtype: 256 MiB at 8 KV heads of 128 in bfloat16); more
    # are read and attended in groups
    prefill_scratch_slots = 1 << 16

    def __init__(self, kv_cache, device: torch.device, soft_cap: float | None = None) -> None:
        why = kernel_unfit(kv_cache)  # the selector asks why_not first; built directly, too
        if why is not None:
            raise ValueError(f"attention backend 'triton' cannot serve this cache: {why}")
        super().__init__(kv_cache, device, soft_cap)
        # these read TRITON_INTERPRET when defined
        from nanokv.kernels.triton import kvquant_decode, kvquant_read, prefill
        from nanokv.kernels.triton.paged_kv import PagedKV

        self._kernels, self._read, self._prefill, self._paged = (kvquant_decode, kvquant_read,
                                                                 prefill, PagedKV)
        self.tile_n, self.block_rows = TritonPagedBackend.tiles_for(kv_cache.layout.dtype)
        self.block_size = kv_cache.block_size
        self.num_kv_heads = kv_cache.layout.num_kv_heads
        self.target_programs = (2 * torch.cuda.get_device_properties(device).multi_processor_count
                                if device.type == "cuda" else 1)
        self._layers: dict[int, object] = {}
        kv_cache.use_block_reader(self.read_blocks)  # policy views read through the kernel

    @property
    def supports_cuda_graphs(self) -> bool:
        """KVQuant and KIVI with their Triton writes: every launch of a decode step is the same
        whatever its rows hold (the PyTorch writes change shape with the step)."""
        return self.kv_cache.triton_write

    @classmethod
    def why_not(cls, kv_cache, device: torch.device) -> tuple[str, bool] | None:
        if device.type != "cuda" and not (device.type == "cpu" and interpreter_on()):
            return (f"it runs on CUDA GPUs (device {device.type}; on CPU only under "
                    f"TRITON_INTERPRET=1)"), True
        why = kernel_unfit(kv_cache)
        if why is not None:
            return why, True
        why = triton_unavailable()
        if why is not None:
            return why, False
        if device.type == "cuda" and torch.cuda.is_available():
            capability = torch.cuda.get_device_capability(device)
            if capability < (8, 0):
                return (f"it needs a GPU of compute capability 8.0 or newer (this one has "
                        f"{capability[0]}.{capability[1]})"), False
        return None

    # ---- metadata ------------------------------------------------------------------------------
    def decode_splits(self, rows: int, max_context: int) -> int:
        """Splits (runs of whole blocks) of each decode's context: enough programs to fill the
        GPU, no more than the longest context's blocks, at most SPLIT_CAP."""
        wanted = cdiv(self.target_programs, max(1, rows * self.num_kv_heads))
        return max(1, min(wanted, cdiv(max_context, self.block_size), SPLIT_CAP))

    def build(self, common: CommonAttentionMetadata) -> TritonQuantStep:
        if common.per_layer is not None:
            raise RuntimeError("per-layer block tables need the float KV pool")
        step = TritonQuantStep(common.write_plan, common.num_decode_tokens,
                               self.prefill_chunks(common) if common.prefills else None)
        if common.num_decodes:  # tables and context lengths in one upload (as triton_paged)
            lens = common.decode_context_lens
            rows = upload(padded_rows(common.decode_block_tables, lens), self.device)
            step.block_tables, step.context_lens = rows[:, :-1], rows[:, -1]  # [B, width], [B]
            step.num_splits = self.decode_splits(len(lens), max(lens))
        return step

    def prefill_chunks(self, common: CommonAttentionMetadata) -> QuantPrefill:
        """The chunks in groups over one scratch cache, and the staged cache (two uploads: the
        int32 tables, the int64 token indexes). A block several chunks share (a cached common
        prefix) is read once per group; a group takes chunks in order while its distinct blocks
        stay within `prefill_scratch_slots` (a chunk whose blocks alone are more gets a group
        of its own). Staged rows: the pasts' partial blocks first, then the chunks' others."""
        chunks, bs = common.prefills, self.block_size
        cap = max(1, self.prefill_scratch_slots // bs)  # blocks
        # (chunks, their tables into the scratch, store block -> scratch row, staged tables)
        groups: list[tuple[list, list, dict[int, int], list]] = [([], [], {}, [])]
        firsts = [(c.context_len - c.query_len) // bs for c in chunks]  # each's first staged
        partial = [c.context_len - c.query_len > f * bs for c, f in zip(chunks, firsts)]
        staged_ids = [c.block_table[f] for c, f, p in zip(chunks, firsts, partial) if p]
        next_row = len(staged_ids)
        rows_of_partial = iter(range(len(staged_ids)))
        token_rows, token_slots = [], []
        for c, first, p in zip(chunks, firsts, partial):
            blocks = c.block_table[:cdiv(c.context_len, bs)]
            members, _, rows, _ = groups[-1]
            new = len(set(blocks).difference(rows))  # blocks the group does not read yet
            if members and new and len(rows) + new > cap:
                groups.append(([], [], {}, []))
            members, tables, rows, stage_tables = groups[-1]
            members.append(c)
            tables.append([rows.setdefault(b, len(rows)) for b in blocks])
            stage = [next(rows_of_partial)] if p else []
            stage += range(next_row, next_row + len(blocks) - first - len(stage))
            next_row += len(blocks) - first - p
            stage_tables.append(stage)
            past = c.context_len - c.query_len
            token_rows += range(c.query_start, c.query_start + c.query_len)
            token_slots += [stage[j // bs - first] * bs + j % bs
                            for j in range(past, c.context_len)]
        parts, shapes = [], []
        for members, tables, rows, stage_tables in groups:
            table, stage = padded_rows(tables), padded_rows(stage_tables)  # [C_g, widest]
            parts += chunk_parts(members, table) + [list(rows), stage]
            shapes.append((table, stage))
        before = staging_rows_before(self.kv_cache, common.write_plan, staged_ids)
        views = upload_parts(parts + [staged_ids, before], self.device, np.int32)
        tokens = upload_parts([token_rows, token_slots], self.device)  # int64 indexes
        prefix_groups = [PrefixGroup(chunk_views(members, table, views[6 * g:6 * g + 4]),
                                     views[6 * g + 4], views[6 * g + 5].view(stage.shape))
                         for g, ((members, *_), (table, stage)) in enumerate(zip(groups, shapes))]
        lay = self.kv_cache.layout

        def cache(num_rows):  # [num_rows, B, Hkv, D]
            return torch.empty((num_rows, bs, lay.num_kv_heads, lay.head_dim), dtype=lay.dtype,
                               device=self.device)

        most = max(len(rows) for _, _, rows, _ in groups)
        return QuantPrefill(prefix_groups, cache(most), cache(most), *views[-2:], *tokens,
                            cache(next_row), cache(next_row))

    def graph_decode_metadata(self, max_batch: int, max_blocks: int) -> TritonQuantStep:
        if not self.supports_cuda_graphs:
            raise NotImplementedError("CUDA graphs need a kvquant or kivi store with its Triton "
                                      "write")
        tables = graph_step(max_batch, max_blocks, self.device)
        return TritonQuantStep(None, 0, None, tables.block_tables, tables.context_lens,
                               graph=(tables, self.kv_cache.graph_write_plan(max_batch)))

    def fill_graph_decode(self, meta: TritonQuantStep, common: CommonAttentionMetadata,
                          batch: int) -> None:
        if meta.graph is None:
            raise ValueError("fill_graph_decode needs metadata from graph_decode_metadata")
        tables, plan = meta.graph
        max_blocks = tables.block_tables.shape[1]
        fill_graph_tables(tables, common, batch,  # the slots: the store's write plan
                          self.decode_splits(batch, max_blocks * self.block_size))
        meta.write_plan = self.kv_cache.fill_graph_write(plan, common.write_plan, batch)
        meta.num_decode_tokens, meta.num_splits = batch, tables.num_splits

    # ---- one layer -----------------------------------------------------------------------------
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_pre: torch.Tensor, step: TritonQuantStep, scale: float) -> torch.Tensor:
        """The store writes the step's K/V, then the prefill rows and the decode rows
        [0, num_decode_tokens) of out [T, Hq, D] are attended, each token as it would decode
        (`reference_quantized_attention`): its earlier tokens as stored once it was written,
        itself with its fresh K/V."""
        pre = step.prefill
        if pre is not None:
            self.read_staged_pasts(layer, pre)
        self.kv_cache.write_layer(layer, step.write_plan, k, v, k_pre)
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        out = torch.empty_like(q)
        window = self.kv_cache.layout.window(layer)
        if pre is not None:
            self.attend_prefill(layer, q, k, v, k_pre, step.write_plan.positions, pre, out,
                                scale, window)
        nd = step.num_decode_tokens
        if nd:
            self._kernels.kvquant_decode_attention(
                q[:nd], k[:nd], v[:nd], self.layer_views(layer), step.block_tables,
                step.context_lens, out[:nd], scale, step.num_splits, self.num_warps,
                self.num_stages, self.unroll, window)
        return out

    def read_staged_pasts(self, layer: int, pre: QuantPrefill) -> None:
        """The pasts' partial blocks into the staged cache, as staged when the step began:
        before the layer's write, which quantizes a block its chunk fills."""
        if pre.staged_ids.numel():
            self._read.kvquant_read_blocks(self.layer_views(layer), pre.staged_ids,
                                           pre.k_staged, pre.v_staged,
                                           staging_rows=pre.staging_rows)

    def attend_prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       k_pre: torch.Tensor, positions: torch.Tensor, pre: QuantPrefill,
                       out: torch.Tensor, scale: float, window: int | None = None) -> None:
        """The prefill chunks' rows of out (after the write; the pasts' partial blocks already
        in the staged cache): the chunks' tokens as staged into the staged cache, then group by
        group the group's blocks decoded into the scratch cache and its chunks in one launch of
        the paged prefill kernel (its STAGED view; with a sliding `window`, each token over its
        newest `window`)."""
        rows, heads, dim = pre.token_rows, k.shape[1], k.shape[2]
        k_stg, v_stg = self.kv_cache.staged_rows(k[rows], v[rows], k_pre[rows], positions[rows])
        for cache, x in ((pre.k_staged, k_stg), (pre.v_staged, v_stg)):  # x: [N, Hkv, D]
            if x is not None:  # (None: values are read from their codes)
                cache.view(-1, heads, dim).index_copy_(0, pre.token_slots, x.to(cache.dtype))
        paged = self._paged(pre.k_scratch, pre.v_scratch)
        for group in pre.groups:
            self._read.kvquant_read_blocks(self.layer_views(layer), group.read_ids,
                                           pre.k_scratch, pre.v_scratch)
            chunks = group.chunks
            self._prefill.prefill_attention(
                q, k, v, paged, chunks.query_start, chunks.query_len, chunks.context_lens,
                chunks.block_tables, chunks.max_query_len, out, scale, self.block_rows,
                self.tile_n, self.num_warps, group.stage_tables, pre.k_staged,
                None if v_stg is None else pre.v_staged, window)

    def read_blocks(self, layer: int, block_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks block_ids [n] decoded by the read kernel: (k, v) each [n, B, Hkv, D] in
        the layout's dtype, keys after RoPE: the store's `read_blocks(layer, ids, store.rope)`
        (the block reader of its policy views)."""
        lay = self.kv_cache.layout
        shape = (block_ids.numel(), self.block_size, lay.num_kv_heads, lay.head_dim)
        k = torch.empty(shape, dtype=lay.dtype, device=self.device)
        v = torch.empty(shape, dtype=lay.dtype, device=self.device)
        self._read.kvquant_read_blocks(self.layer_views(layer), block_ids.to(self.device), k, v)
        return k, v

    def layer_views(self, layer: int):
        """The layer's buffers as the kernel reads them (views of the store's, made once)."""
        if layer not in self._layers:
            store = self.kv_cache
            make = kivi_views if isinstance(store, KIVIStore) else kvquant_views
            self._layers[layer] = make(store, layer, self._kernels.QuantLayerViews)
        return self._layers[layer]


def kivi_views(store: KIVIStore, layer: int, views):
    """KIVI as the kernel's layout: per-channel keys (min as offset, scale as half, a code's own
    value as its centroid: the grid of step 1 from 0), per-token values in groups, a partial
    block's keys and values staged, no outliers or sinks."""
    buf = store.buffers
    levels = torch.arange(2 ** store.bits, dtype=torch.float32, device=buf["k_codes"].device)
    return views(k_codes=buf["k_codes"][layer], v_codes=buf["v_codes"][layer],
                 k_off=buf["k_min"][layer], k_half=buf["k_scale"][layer],
                 v_off=buf["v_min"][layer], v_half=buf["v_scale"][layer], k_lut=levels,
                 v_lut=levels, k_bits=store.bits, v_bits=store.bits, k_grid=(1.0, 0.0),
                 v_grid=(1.0, 0.0),
                 staging_index=buf["staging_index"], k_stage=buf["staging_k"][layer],
                 v_stage=buf["staging_v"][layer])


def kvquant_views(store: KVQuantStore, layer: int, views):
    buf, codec = store.buffers, store.codecs[layer]
    device = buf[f"k_codes{layer}"].device

    def lut(book) -> torch.Tensor:  # [2^bits] the centroid of each code
        return centroid_table(codec.bits, book).to(device)

    def grid(book) -> tuple[float, float] | None:  # the uniform grid, or None: the table
        return None if book is not None else uniform_grid(codec.bits)

    rope = store.rope is not None
    sinks = store.num_sinks > 0
    return views(
        k_codes=buf[f"k_codes{layer}"], v_codes=buf[f"v_codes{layer}"],
        k_off=buf[f"k_offset{layer}"], k_half=buf[f"k_half{layer}"],
        v_off=buf[f"v_offset{layer}"].unsqueeze(-1), v_half=buf[f"v_half{layer}"].unsqueeze(-1),
        k_lut=lut(codec.key_codebook), v_lut=lut(codec.value_codebook),
        k_grid=grid(codec.key_codebook), v_grid=grid(codec.value_codebook), k_bits=codec.bits,
        v_bits=codec.bits, staging_index=buf["staging_index"], k_stage=buf["staging_k"][layer],
        k_oidx=buf[f"k_oidx{layer}"], k_oval=buf[f"k_oval{layer}"],
        v_oidx=buf[f"v_oidx{layer}"], v_oval=buf[f"v_oval{layer}"],
        sink_slot=buf["sink_slot"] if sinks else None,
        k_sink=buf[f"sink_k{layer}"] if sinks else None,
        v_sink=buf[f"sink_v{layer}"] if sinks else None,
        positions=store.slot_positions if rope else None,
        cos=store.rotary.cos.float().contiguous() if rope else None,
        sin=store.rotary.sin.float().contiguous() if rope else None)
