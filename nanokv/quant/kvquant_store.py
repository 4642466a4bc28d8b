"""KVQuant store: packed 2/3/4(/8)-bit codes with fp16 scales and zero-points, fixed-capacity
sparse outliers and full-precision sink slots, all kept block by block at the block's id.

Per layer l (bits b_l, P = packed bytes of D codes):

    k_codes{l}, v_codes{l}   uint8 [num_blocks, B, Hkv, P]
    keys per channel (default), statistics over the block's tokens, quantized when it fills:
      k_offset{l}, k_half{l}   fp16  [num_blocks, Hkv, D]
      k_oidx{l}, k_oval{l}     int16 (int32 if B * D > 32767) / fp16 [num_blocks, Hkv, capB]
    values (and keys with per_channel_keys=False), per token, quantized as they are written:
      v_offset{l}, v_half{l}   fp16  [num_blocks, B, Hkv]
      v_oidx{l}, v_oval{l}     uint8 (int16 if D >= 255) / fp16 [num_blocks, B, Hkv, capT]
    sink_k{l}, sink_v{l}     fp16  [num_blocks, N, Hkv, D]  (entry p = position p < N)
    staging_k                staging_dtype [L, S, B, Hkv, D] (default: layout.dtype)
    sink_slot int16 [num_blocks, N] (slot of position p, -1 none), staging_index int32 [nb]

capB = 2 * ceil(f / 2 * B * D) per block-head, capT = 2 * ceil(f / 2 * D) per token-head (the
top and bottom f / 2 of each token's values, at least one each side when f > 0: with D = 128 and
f = 1% that is 2 of 128 = 1.6%; the 1-byte index keeps its cost near the block's). An `oval`
entry is the outlier's delta, x minus its dense decoding (`nanokv.quant.kvquant`): a reader adds
it to what it decodes.

Why staging: per-channel key statistics need all B tokens of a block, so a key block is
quantized when its last slot is written. Until then its keys live in full precision in one of
S = `num_staging_blocks` staging blocks (one per running request suffices: a request has at most
one partial block; a block filling in a step frees its staging block before new ones are taken).
Cost: S * B * L * Hkv * D * elem bytes, fixed whatever the pool size (`memory().staging`): with
B = 128 and S = 64 that is the keys of 8192 tokens at full precision, so size S to the real
concurrency (max_num_seqs) and, on a float32 CPU engine, consider staging_dtype=torch.bfloat16
(halves it; staged keys are then rounded to bf16). Values need no staging. Reading a partial
block returns its staged keys (exact with the default staging dtype) and its quantized values.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from nanokv.cache.kv_cache import KVCacheOptions
from nanokv.cache.layout import KVLayout
from nanokv.quant.codec import LayerCodec
from nanokv.quant.kvquant import (
    KVQUANT_BITS,
    SPARSE_DTYPES,
    KVQuantConfig,
    QuantizedBlocks,
    outlier_capacity,
)
from nanokv.kernels.triton import triton_unavailable
from nanokv.quant import graph_write, native_write
from nanokv.quant.graph_write import GraphWritePlan, padded_entries
from nanokv.quant.packing import pack, packed_dim, unpack
from nanokv.quant.staging import BlockStaging
from nanokv.quant.store import BufferSpec, QuantizedKVStore, Rope, WritePlan, as_list
from nanokv.transfer import upload_parts

logger = logging.getLogger("nanokv")
_PARTS = ("codes", "offset", "half", "oidx", "oval")  # a layer's buffers of one kind
STAGING_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # partial blocks' keys


@dataclass
class KVQuantWritePlan(WritePlan):
    token_valid: torch.Tensor  # [T] bool, False for sink tokens
    stage_src: torch.Tensor  # [Ts] token index of each key kept in staging
    stage_dst: torch.Tensor  # [Ts] flat staging slot (row * B + slot)
    quant_blocks: torch.Tensor  # [nq] blocks whose keys fill up in this step
    quant_src: torch.Tensor  # [nq, B] < S*B: staging slot; else S*B + token index
    quant_valid: torch.Tensor  # [nq, B] bool, False for sink slots
    sink_src: torch.Tensor  # [Tk] token index of each sink token
    sink_dst: torch.Tensor  # [Tk] block * N + position
    host: HostWritePlan | None = None  # the same indexes as host lists (a graph plan's source)


@dataclass
class HostWritePlan(graph_write.HostWritePlan):
    """A step's write indexes on the host, as `plan_write` made them."""

    quant_valid: list[list[bool]]
    sink_src: list[int]
    sink_dst: list[int]


class KVQuantStore(QuantizedKVStore):
    kv_cache_dtype = "kvquant"
    # a partial block is staged at full precision, quantized when its last slot is written:
    # speculative drafts stop before that slot, and a rejected one's staged slot is written
    # again
    supports_speculation = True
    quantizes_full_blocks = True
    graph_parts = graph_write.COMMON_PARTS + ("sink_dst",)  # its decode steps' graph plan

    def __init__(self, layout: KVLayout, num_blocks: int, config: KVQuantConfig,
                 num_staging_blocks: int, device: torch.device | str = "cpu",
                 slot_positions: torch.Tensor | None = None,
                 staging_dtype: torch.dtype | None = None) -> None:
        staged = config.per_channel_keys
        if (not isinstance(num_staging_blocks, int) or isinstance(num_staging_blocks, bool)
                or num_staging_blocks < (1 if staged else 0)):
            raise ValueError(f"num_staging_blocks must be an integer >= 1 (0 allowed without "
                             f"per-channel keys), got {num_staging_blocks!r}")
        if staging_dtype is not None and staging_dtype not in STAGING_DTYPES:
            raise ValueError(f"staging_dtype must be one of {list(STAGING_DTYPES)} (or None: "
                             f"the layout's dtype), got {staging_dtype!r}")
        config.validate_for(layout.num_layers, layout.num_kv_heads, layout.head_dim,
                            layout.block_size)
        super().__init__(layout, num_blocks, device, config.pre_rope_keys, slot_positions)
        self.config = config
        self.staged = staged  # keys wait for their block to fill
        self.num_staging_blocks = num_staging_blocks if staged else 0
        self.staging_dtype = staging_dtype or layout.dtype
        self.num_sinks = config.num_sink_tokens
        self._warned_sinks: set[tuple[str, int]] = set()  # (policy, n_sink) warned about
        self.codecs = [LayerCodec.from_config(config, layer, self.device)
                       for layer in range(layout.num_layers)]
        self._allocate(self.buffer_specs())
        self.buffers["staging_index"].fill_(-1)
        self.buffers["sink_slot"].fill_(-1)
        for layer, codec in enumerate(self.codecs):  # the codebook buffers: the codecs' own
            for kind in ("key", "value"):
                book = getattr(codec, f"{kind}_codebook")
                if book is not None:
                    self.buffers[f"{kind}_codebook{layer}"] = book
        # host bookkeeping (no device sync on the hot path)
        self.staging = BlockStaging(num_blocks, self.block_size, self.num_staging_blocks,
                                    "kvquant", staged=staged)
        self._sink = np.full((num_blocks, self.num_sinks), -1, dtype=np.int64)  # slot of pos p
        # quantize-on-write in C on CPU (`native_write`); False: the PyTorch path
        self.native_write = self.device.type == "cpu" and native_write.native_write_available()
        # ... and as Triton kernels on CUDA (`kernels/triton/kvquant_write.py`; the tests turn it
        # on for a CPU store under Triton's interpreter)
        self.triton_write = self.device.type == "cuda" and triton_unavailable() is None
        self._write_tables: dict[tuple[int, str], tuple] = {}  # the kernels' codebook tables

    # ---- the KV cache kind -----------------------------------------------------------------
    # unpacked codes, codebook lookups and sinks make its decode read heavier than int8's
    # (measured peaks in docs/results/engine)
    decode_scratch_factor = 3.0
    engine_options = frozenset({"kv_quant_bits", "kv_quant_config"})

    @classmethod
    def settings_from_options(cls, options: KVCacheOptions, layout: KVLayout) -> dict:
        """The KVQuant config (default 4-bit, or the calibration file's; reads and checks the
        file) and one staging block per running request (a request has at most one partial
        block)."""
        from nanokv.quant.calibration_file import load_calibration

        bits = options.kv_quant_bits
        if bits is not None and (isinstance(bits, bool) or bits not in KVQUANT_BITS):
            raise ValueError(f"kv_quant_bits must be one of {list(KVQUANT_BITS)}, got {bits!r}")
        if options.kv_quant_config is None:
            config = KVQuantConfig(bits=bits or 4)
        else:
            calib = load_calibration(options.kv_quant_config)
            calib.check_model(layout.num_layers, layout.num_kv_heads, layout.head_dim)
            if bits is None and calib.kv_cache_dtype != "kvquant":
                raise ValueError(f"the calibration {options.kv_quant_config} chose kv_cache_dtype "
                                 f"{calib.kv_cache_dtype!r}: run with --kv-cache-dtype "
                                 f"{calib.kv_cache_dtype}, or pass kv_quant_bits for a kvquant "
                                 f"config from its codebooks")
            config = calib.kvquant_config(bits=bits)
            calib_block = calib.settings.get("block_size")
            if calib_block != layout.block_size:
                logger.warning("the calibration %s was made with block_size %s, the engine uses "
                               "%s: per-channel key statistics (and outlier shares) differ from "
                               "what was calibrated", options.kv_quant_config, calib_block,
                               layout.block_size)
        config.validate_for(layout.num_layers, layout.num_kv_heads, layout.head_dim,
                            layout.block_size)
        return {"config": config, "num_staging_blocks": options.max_num_seqs}

    @classmethod
    def shard_settings(cls, settings: dict, rank: int, size: int) -> dict:
        """Everything KVQuant computes is per KV head (statistics, outliers, sinks) but the
        calibrated key thresholds, [L, 2, Hkv, D]: a rank takes its heads' rows. Codebooks and
        per-layer bits are per layer, the same on every rank."""
        config = settings["config"]
        t = config.key_outlier_thresholds
        if t is None:
            return settings
        heads = t.shape[2] // size
        mine = t[:, :, rank * heads:(rank + 1) * heads].contiguous()  # [L, 2, Hkv / N, D]
        return {**settings, "config": replace(config, key_outlier_thresholds=mine)}

    @classmethod
    def from_settings(cls, layout: KVLayout, num_blocks: int, device: torch.device | str,
                      config: KVQuantConfig | None = None, num_staging_blocks: int | None = None,
                      staging_dtype: torch.dtype | None = None) -> KVQuantStore:
        if num_staging_blocks is None:
            raise ValueError("kvquant needs num_staging_blocks (>= max_num_seqs)")
        return cls(layout, num_blocks, config or KVQuantConfig(), num_staging_blocks, device,
                   staging_dtype=staging_dtype)

    @property
    def settings(self) -> dict:
        return {"config": self.config, "num_staging_blocks": self.num_staging_blocks,
                "staging_dtype": self.staging_dtype}

    @staticmethod
    def _index_dtype(layout: KVLayout, per_token: bool) -> torch.dtype:
        if per_token:  # channel index < D; unused = 255 (uint8) or -1
            return torch.uint8 if layout.head_dim < 255 else torch.int16
        return torch.int16 if layout.block_size * layout.head_dim <= 32767 else torch.int32

    def _per_token(self, name: str) -> bool:
        return name == "v" or not self.staged

    @classmethod
    def specs_for(cls, layout: KVLayout, num_blocks: int, settings: dict) -> list[BufferSpec]:
        cfg = settings.get("config") or KVQuantConfig()
        staged = cfg.per_channel_keys
        num_staging = (settings.get("num_staging_blocks") or 0) if staged else 0
        staging_dtype = settings.get("staging_dtype") or layout.dtype
        lay, nb = layout, num_blocks
        bsz, heads, dim, n_sink = lay.block_size, lay.num_kv_heads, lay.head_dim, \
            cfg.num_sink_tokens
        sparse = SPARSE_DTYPES[cfg.sparse_dtype]
        specs = []
        for layer in range(lay.num_layers):
            bits = cfg.bits_of(layer)
            codes = (nb, bsz, heads, packed_dim(dim, bits))
            for name in ("k", "v"):
                per_token = name == "v" or not staged
                if per_token:
                    stats = (nb, bsz, heads)
                    sparse_shape = (nb, bsz, heads, outlier_capacity(1, dim, cfg.outlier_fraction))
                else:
                    stats = (nb, heads, dim)
                    sparse_shape = (nb, heads, outlier_capacity(bsz, dim, cfg.outlier_fraction))
                specs += [BufferSpec(f"{name}_codes{layer}", codes, torch.uint8, "codes"),
                          BufferSpec(f"{name}_offset{layer}", stats, torch.float16, "scales"),
                          BufferSpec(f"{name}_half{layer}", stats, torch.float16, "scales"),
                          BufferSpec(f"{name}_oidx{layer}", sparse_shape,
                                     cls._index_dtype(lay, per_token), "outliers"),
                          BufferSpec(f"{name}_oval{layer}", sparse_shape, sparse, "outliers")]
            for kind in ("key", "value"):
                if cfg.codebook(layer, kind) is not None:
                    specs.append(BufferSpec(f"{kind}_codebook{layer}", (2 ** bits,),
                                            torch.float32, "scales"))
            specs += [BufferSpec(f"sink_k{layer}", (nb, n_sink, heads, dim), sparse, "sinks"),
                      BufferSpec(f"sink_v{layer}", (nb, n_sink, heads, dim), sparse, "sinks")]
        staging = (lay.num_layers, num_staging, bsz, heads, dim)
        specs += [BufferSpec("sink_slot", (nb, n_sink), torch.int16, "sinks"),
                  BufferSpec("staging_k", staging, staging_dtype, "staging"),
                  BufferSpec("staging_index", (nb,), torch.int32, "bookkeeping")]
        return specs

    def extra_keys(self) -> tuple:
        return super().extra_keys() + (("kvquant", self.config.fingerprint()),)

    # ---- writing -----------------------------------------------------------------------------
    def plan_write(self, slot_mapping: Sequence[int] | torch.Tensor,
                   positions: Sequence[int] | torch.Tensor) -> KVQuantWritePlan:
        slots, pos = as_list(slot_mapping), as_list(positions)
        if len(slots) != len(pos):
            raise ValueError(f"{len(slots)} slots but {len(pos)} positions")
        bsz, n_sink = self.block_size, self.num_sinks
        step = self.staging.plan(slots)  # validates before anything changes
        sink_src, sink_dst, fresh = [], [], []
        for b, toks, fill in step.completing + step.partial:
            if fill == 0:  # a fresh block: forget its old sinks
                self._sink[b] = -1
                fresh.append(b)
            for t in toks:
                if pos[t] < n_sink:
                    self._sink[b, pos[t]] = slots[t] % bsz
                    sink_src.append(t)
                    sink_dst.append(b * n_sink + pos[t])
        quant_valid = []  # sink slots are left out of a filling block's key statistics
        if self.staged:
            for b, _, _ in step.completing:
                sinks = set(self._sink[b].tolist())
                quant_valid.append([j not in sinks for j in range(bsz)])
        quant_blocks = step.quant_blocks if self.staged else []
        host = HostWritePlan(slots, pos, step.stage_src, step.stage_dst, quant_blocks,
                             step.quant_src, quant_valid, sink_src, sink_dst)
        # every index list in one host -> device copy that does not wait for queued work
        parts = {"slots": slots, "positions": pos, "stage_src": step.stage_src,
                 "stage_dst": step.stage_dst, "quant_blocks": quant_blocks,
                 "quant_src": step.quant_src, "quant_valid": quant_valid,
                 "sink_src": sink_src, "sink_dst": sink_dst,
                 "sink_slot": [slots[t] % bsz for t in sink_src],
                 "fresh": fresh if n_sink else [], "row_blocks": list(step.row_changes),
                 "rows": list(step.row_changes.values())}
        at = dict(zip(parts, upload_parts(list(parts.values()), self.device)))
        base = super().plan_write(at["slots"], at["positions"])  # the slots' positions
        buf = self.buffers
        if at["fresh"].numel():
            buf["sink_slot"][at["fresh"]] = -1
        if sink_dst:
            buf["sink_slot"].view(-1)[at["sink_dst"]] = at["sink_slot"].to(torch.int16)
        if step.row_changes:
            buf["staging_index"][at["row_blocks"]] = at["rows"].to(torch.int32)
        return KVQuantWritePlan(
            base.slot_mapping, base.positions, token_valid=base.positions >= n_sink,
            stage_src=at["stage_src"], stage_dst=at["stage_dst"],
            quant_blocks=at["quant_blocks"], quant_src=at["quant_src"].view(-1, bsz),
            quant_valid=at["quant_valid"].bool().view(-1, bsz), sink_src=at["sink_src"],
            sink_dst=at["sink_dst"], host=host)

    # ---- decode steps through CUDA graphs ------------------------------------------------------
    def fill_graph_write(self, graph: GraphWritePlan, plan: KVQuantWritePlan | None,
                         batch: int) -> KVQuantWritePlan:
        """The step's plan (one token a row, from `plan_write`; None: no rows) copied into the
        graph plan's static tensors, rows from its tokens up to `batch` padded. Returns the plan
        of `batch` rows, views of those tensors: the same views for every step of that batch."""
        host, entries, quant_src = padded_entries(graph, plan, batch)
        m = graph.max_batch
        valid, quant_valid = np.zeros(m, dtype=bool), np.zeros((m, self.block_size), dtype=bool)
        if host is not None and host.slots:
            n, nq = len(host.slots), len(host.quant_blocks)
            valid[:n] = np.asarray(host.positions) >= self.num_sinks
            entries["sink_dst"][host.sink_src] = host.sink_dst
            quant_valid[:nq] = np.asarray(host.quant_valid, dtype=bool).reshape(nq, self.block_size)
        graph.fill(entries, quant_src, valid, quant_valid)
        views = graph.views(batch)
        return KVQuantWritePlan(
            views.part["slot_mapping"], views.part["positions"], token_valid=views.token_valid,
            stage_src=views.rows, stage_dst=views.part["stage_dst"],
            quant_blocks=views.part["quant_blocks"], quant_src=views.quant_src,
            quant_valid=views.quant_valid, sink_src=views.rows, sink_dst=views.part["sink_dst"])

    def write(self, layer: int, plan: KVQuantWritePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        buf, codec = self.buffers, self.codecs[layer]
        heads, dim = self.layout.num_kv_heads, self.layout.head_dim
        for name, kind, x in (("k", "key", k), ("v", "value", v)):
            if self._per_token(name):  # each token is its own group of one slot
                parts = {f: buf[f"{name}_{f}{layer}"] for f in _PARTS}
                if self.triton_write:
                    from nanokv.kernels.triton import kvquant_write

                    kvquant_write.quantize_tokens(x, plan.token_valid, plan.slot_mapping, parts,
                                                  codec.bits, self._triton_tables(layer, kind))
                elif self.native_write and native_write.fits(x, parts, codec.bits):
                    book = codec.value_codebook if kind == "value" else codec.key_codebook
                    native_write.quantize_tokens(x, plan.token_valid, plan.slot_mapping, parts,
                                                 codec.bits, book)
                else:
                    q = codec.quantize(kind, x.unsqueeze(1), plan.token_valid.unsqueeze(1))
                    self._put(name, layer, plan.slot_mapping, q, per_token=True)
            else:
                self._write_blocks(name, kind, layer, plan, x)
            if plan.sink_src.numel():
                sink = buf[f"sink_{name}{layer}"].view(-1, heads, dim)
                if self.triton_write:
                    from nanokv.kernels.triton import kvquant_write

                    kvquant_write.scatter_rows(x, plan.sink_src, plan.sink_dst, sink)
                else:
                    sink.index_copy_(0, plan.sink_dst, x[plan.sink_src].to(sink.dtype))

    def _write_blocks(self, name: str, kind: str, layer: int, plan: KVQuantWritePlan,
                      x: torch.Tensor) -> None:
        heads, dim = self.layout.num_kv_heads, self.layout.head_dim
        staging = self.buffers[f"staging_{name}"][layer].view(-1, heads, dim)  # [S * B, Hkv, D]
        staged_slots = self.num_staging_blocks * self.block_size
        if plan.quant_blocks.numel() and self.triton_write:  # the kernel gathers the slots
            from nanokv.kernels.triton import kvquant_write

            codec = self.codecs[layer]
            kvquant_write.quantize_blocks(
                x, staging, plan.quant_src, plan.quant_valid, plan.quant_blocks,
                {f: self.buffers[f"{name}_{f}{layer}"] for f in _PARTS}, codec.bits,
                self._triton_tables(layer, kind), codec.key_thresholds)
        elif plan.quant_blocks.numel():  # before the staging writes: rows may be reused
            src = plan.quant_src  # [nq, B]
            old = staging[src.clamp(max=staged_slots - 1)].to(x.dtype)  # [nq, B, Hkv, D]
            new = x[(src - staged_slots).clamp_min(0)]
            blocks = torch.where((src < staged_slots)[..., None, None], old, new)
            codec = self.codecs[layer]
            parts = {f: self.buffers[f"{name}_{f}{layer}"] for f in _PARTS}
            if self.native_write and native_write.fits(blocks, parts, codec.bits):
                native_write.quantize_blocks(blocks, plan.quant_valid, plan.quant_blocks, parts,
                                             codec.bits, codec.key_codebook,
                                             codec.key_thresholds)
            else:
                q = codec.quantize(kind, blocks, plan.quant_valid)
                self._put(name, layer, plan.quant_blocks, q, per_token=False)
        if plan.stage_src.numel() and self.triton_write:
            from nanokv.kernels.triton import kvquant_write

            kvquant_write.scatter_rows(x, plan.stage_src, plan.stage_dst, staging)
        elif plan.stage_src.numel():
            staging.index_copy_(0, plan.stage_dst, x[plan.stage_src].to(staging.dtype))

    def _triton_tables(self, layer: int, kind: str) -> tuple:
        """The write kernels' (midpoints, centroids, non-uniform) of a layer's codebook, made
        once."""
        if (layer, kind) not in self._write_tables:
            from nanokv.kernels.triton import kvquant_write

            codec = self.codecs[layer]
            book = codec.key_codebook if kind == "key" else codec.value_codebook
            self._write_tables[(layer, kind)] = kvquant_write.codebook_tables(book,
                                                                              self.device)
        return self._write_tables[(layer, kind)]

    def _put(self, name: str, layer: int, index: torch.Tensor, q: QuantizedBlocks,
             per_token: bool) -> None:
        """Store quantized blocks at block ids, or single-slot groups at flat slots."""
        buf, bits = self.buffers, self.codecs[layer].bits
        parts = {"codes": pack(q.codes, bits), "offset": q.offset, "half": q.half_range,
                 "oidx": q.outlier_index, "oval": q.outlier_delta}
        for field, value in parts.items():
            dst = buf[f"{name}_{field}{layer}"]
            if dst.numel() == 0:
                continue
            if per_token:  # [T, 1, ...] groups -> flat slots of [nb * B, ...]
                dst = dst.view(-1, *dst.shape[2:])
                value = value.reshape(value.shape[0], *dst.shape[1:])
            dst.index_copy_(0, index, value.to(dst.dtype))

    def check_policy(self, policy) -> None:
        super().check_policy(policy)
        n_sink = getattr(policy, "n_sink", 0)
        if policy.decode_mode == "reselect" and n_sink > self.num_sinks \
                and (policy.name, n_sink) not in self._warned_sinks:
            self._warned_sinks.add((policy.name, n_sink))
            logger.warning(
                "kv_policy %r re-selects while decoding and keeps its first %d tokens, but "
                "KVQuant keeps only the first %d at full precision: the others are rounded again "
                "at every re-selection and their error grows. Set num_sink_tokens >= %d in the "
                "KVQuant settings (kv_quant_config)%s.", policy.name, n_sink, self.num_sinks,
                n_sink, " or slide='block'" if policy.name == "streaming" else "")

    def release(self, block_ids: Sequence[int]) -> None:
        dropped = self.staging.release(block_ids)
        if dropped:
            self.buffers["staging_index"][torch.tensor(dropped, device=self.device)] = -1

    def _block_axis(self, name: str) -> int | None:
        # staging rows (copied by their own bookkeeping) and the codebooks are not per block
        return None if name.startswith(("staging", "key_codebook", "value_codebook")) else 0

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        pairs = list(pairs)
        if not pairs:
            return
        row_copies = self.staging.copy(pairs)  # raises, changing nothing, when rows run short
        super().copy_blocks(pairs)
        for s, d in pairs:
            self._sink[d] = self._sink[s]
        stage = self.buffers["staging_k"]
        for src, dst in row_copies:  # a partial source: the copy gets its own staged keys
            stage[:, dst] = stage[:, src]
        touched = torch.tensor([d for _, d in pairs], device=self.device)
        self.buffers["staging_index"][touched] = torch.tensor(
            [int(self.staging.row[d]) for _, d in pairs], dtype=torch.int32, device=self.device)

    @property
    def num_free_staging_blocks(self) -> int:
        return self.staging.num_free_rows

    @property
    def stages_blocks(self) -> bool:
        return self.staged  # per-channel keys; values are per token

    def staged_rows(self, k, v, k_store, positions):
        if not self.staged:
            return None, None
        if self.staging_dtype == k.dtype:
            return k, None
        x = k_store.to(self.staging_dtype).to(k.dtype)  # [T, Hkv, D] as staging holds it
        return (self.rotary.rotate(positions, x) if self.pre_rope_keys else x), None

    # ---- reading -----------------------------------------------------------------------------
    def read_blocks(self, layer: int, block_ids: torch.Tensor, rope: Rope | None = None):
        buf, codec = self.buffers, self.codecs[layer]
        ids = block_ids.long().flatten()
        n, bsz, heads, dim = ids.numel(), self.block_size, self.layout.num_kv_heads, \
            self.layout.head_dim
        out = []
        for name, kind in (("k", "key"), ("v", "value")):
            codes = unpack(buf[f"{name}_codes{layer}"][ids], codec.bits, dim)  # [n, B, Hkv, D]
            off, half = buf[f"{name}_offset{layer}"][ids], buf[f"{name}_half{layer}"][ids]
            oidx, oval = buf[f"{name}_oidx{layer}"][ids], buf[f"{name}_oval{layer}"][ids]
            if self._per_token(name):  # as n * B groups of one slot
                q = QuantizedBlocks(codes.reshape(n * bsz, 1, heads, dim),
                                    off.reshape(n * bsz, 1, heads), half.reshape(n * bsz, 1, heads),
                                    oidx.flatten(0, 1), oval.flatten(0, 1))
            else:
                q = QuantizedBlocks(codes, off, half, oidx, oval)
            x = codec.dequantize(kind, q).view(n, bsz, heads, dim)  # float32
            if self.num_sinks:
                x = _put_sinks(x, buf["sink_slot"][ids], buf[f"sink_{name}{layer}"][ids])
            x = x.to(self.layout.dtype)
            if not self._per_token(name):
                rows = buf["staging_index"][ids].long()  # [n], -1 = not staged
                staged = buf[f"staging_{name}"][layer][rows.clamp_min(0)].to(x.dtype)
                x = torch.where((rows >= 0)[:, None, None, None], staged, x)
            out.append(x)
        return self._rotate(out[0], ids, rope), out[1]


def _put_sinks(x: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """x: [n, B, H, D]; slots: [n, N] (-1 none); values: [n, N, H, D] -> x with sinks put back."""
    n, bsz, heads, dim = x.shape
    padded = torch.cat([x, x.new_zeros(n, 1, heads, dim)], dim=1)  # + a dump slot
    idx = torch.where(slots < 0, bsz, slots.long())[:, :, None, None].expand(-1, -1, heads, dim)
    padded.scatter_(1, idx, values.to(x.dtype))
    return padded[:, :bsz]
