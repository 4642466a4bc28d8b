"""C decode kernels that read a quantized store's codes in place (int8, fp8 e4m3 / e5m2,
KVQuant, KIVI), on CPU.

Decodes: one pass over each request's cached slots with an online softmax, the step's own token
attended with its fresh K/V (`nanokv/layers/csrc/quant_decode_attention.c`); no dequantized copy
of the cache is made. A layer with a sliding window reads its window's slots only (the step's
addressing built once per window). Prefill chunks go through the PyTorch path
(`nanokv.quant.attention.quantized_paged_attention`): in a long-context decode-heavy run the
decode steps dominate (docs/results/kvquant/bench.md). Usable on CPU where the kernels build;
other stores and devices pass to the PyTorch backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from nanokv.attention.backend import AttentionBackend
from nanokv.attention.common import CommonAttentionMetadata
from nanokv.layers.attention import AttentionMetadata
from nanokv.layers.native_attention import DecodeRuns, NativeKernelUnavailable, build_decode_runs
from nanokv.layers.rotary import halves_repeat
from nanokv.layers.native_quant_attention import (
    ELEMENT_KINDS,
    INDEX_BYTES,
    ROPE_ROWS,
    ROPE_TILES,
    KVQuantLayer,
    KVQuantSide,
    kvquant_decode,
    kvquant_read,
    load_quant_kernels,
    pertoken_decode,
    rope_layout,
    rope_rows,
    rope_tiles,
)
from nanokv.attention.quantized import prefill_only_metadata, write_prefill_then_decode
from nanokv.attention.torch_paged import by_layer_window
from nanokv.cache.layout import window_start
from nanokv.quant.kvquant import centroid_table
from nanokv.quant.kivi_store import KIVIStore
from nanokv.quant.kvquant_store import KVQuantStore
from nanokv.quant.pertoken_store import FP8KVStore, Int8KVStore, PerTokenKVStore
from nanokv.utils import cdiv


def pertoken_format(store) -> str | None:
    """'int8', 'fp8_e4m3' or 'fp8_e5m2' for a per-token store whose codes decode as those
    stores' do (subclasses included, unless they change the decoding), else None."""
    if not isinstance(store, PerTokenKVStore):
        return None
    decoder = type(store)._dequantize
    if isinstance(store, Int8KVStore) and decoder is Int8KVStore._dequantize:
        return "int8"
    if isinstance(store, FP8KVStore) and decoder is FP8KVStore._dequantize \
            and store.fmt in ("e4m3", "e5m2"):
        return f"fp8_{store.fmt}"
    return None


# stores read by block table (per-block statistics, partial blocks staged)
BLOCK_TABLE_STORES = (KVQuantStore, KIVIStore)


@dataclass
class QuantDecodes:
    """The step's decodes addressed for one sliding window (None: the whole context): each
    request's cached slots from its window's first on (the new token comes fresh)."""

    runs: DecodeRuns | None = None  # per-token stores: runs of consecutive slots
    blk_ptr: torch.Tensor | None = None  # kvquant, kivi: [B + 1] int64 CSR over blk_ids
    blk_ids: torch.Tensor | None = None  # [nblk] int64 from the window's first block
    past: torch.Tensor | None = None  # [B] int64 cached slots from the first listed block
    skip: torch.Tensor | None = None  # [B] int64 slots of that block behind the window


@dataclass
class NativeQuantStep:
    write_plan: object
    num_decode_tokens: int
    # per sliding window the layers have (None: the whole context), the prefill chunks'
    # metadata (PyTorch path; None: no chunk) and the decodes' addressing
    prefill_meta: dict[int | None, AttentionMetadata] | None
    decodes: dict[int | None, QuantDecodes]


class NativeQuantizedBackend(AttentionBackend):
    name = "native"
    description = "C decode kernels over the quantized codes, PyTorch prefill"

    def __init__(self, kv_cache, device: torch.device, soft_cap: float | None = None) -> None:
        super().__init__(kv_cache, device, soft_cap)
        self.block_size = kv_cache.block_size
        # (layer, query heads) -> (C struct, tensors kept alive); reading takes query heads = KV
        # heads (the read path has no queries)
        self._layers: dict[tuple[int, int], tuple] = {}
        # (the RoPE tables' halves repeat, their tiles or None, their half rows or None): every
        # layer's, worked out once; of the compact tables, the one this CPU's kernel reads
        self._rope_layout: tuple[bool, torch.Tensor | None, torch.Tensor | None] | None = None
        if isinstance(kv_cache, BLOCK_TABLE_STORES):  # policy views read through the C reader
            kv_cache.use_block_reader(self.read_blocks)

    @classmethod
    def why_not(cls, kv_cache, device: torch.device) -> tuple[str, bool] | None:
        if device.type != "cpu":
            return f"it runs on CPUs only (device {device.type})", True
        dtype = getattr(kv_cache, "kv_cache_dtype", None)
        if not isinstance(kv_cache, BLOCK_TABLE_STORES) and pertoken_format(kv_cache) is None:
            return (f"its kernels read int8, fp8, kvquant and kivi stores (the cache is "
                    f"{dtype or 'the float pool'})"), True
        if isinstance(kv_cache, BLOCK_TABLE_STORES) \
                and kv_cache.buffers["staging_k"].dtype not in ELEMENT_KINDS:
            return (f"{dtype} staging dtype {kv_cache.buffers['staging_k'].dtype} is not "
                    f"readable"), False
        try:
            load_quant_kernels()
        except NativeKernelUnavailable as e:
            return str(e), False
        return None

    # ---- metadata ------------------------------------------------------------------------------
    def build(self, common: CommonAttentionMetadata) -> NativeQuantStep:
        windows = self.kv_cache.layout.sliding_windows
        base = prefill_only_metadata(common, self.device)
        prefill = None if base is None else by_layer_window(base, windows)
        decodes = {w: self._decodes(common, w) for w in set(windows) or {None}} \
            if common.num_decodes else {}
        return NativeQuantStep(common.write_plan, common.num_decode_tokens, prefill, decodes)

    def _decodes(self, common: CommonAttentionMetadata, window: int | None) -> QuantDecodes:
        past = [c - 1 for c in common.decode_context_lens]  # the new token comes fresh
        cached = None if window is None else window - 1  # the window's cached slots
        bs = self.block_size
        if not isinstance(self.kv_cache, BLOCK_TABLE_STORES):
            return QuantDecodes(runs=build_decode_runs(common.decode_block_tables, past, bs,
                                                       cached))
        ptr, ids, listed, skip = [0], [], [], []
        for blocks, n in zip(common.decode_block_tables, past):
            first = window_start(n, cached)  # the first cached slot the window sees
            ids += blocks[first // bs:cdiv(n, bs)]
            ptr.append(len(ids))
            listed.append(n - first // bs * bs)
            skip.append(first % bs)
        as_tensor = partial(torch.tensor, dtype=torch.int64)
        return QuantDecodes(blk_ptr=as_tensor(ptr), blk_ids=as_tensor(ids),
                            past=as_tensor(listed),
                            skip=None if window is None else as_tensor(skip))

    # ---- one layer -----------------------------------------------------------------------------
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_pre: torch.Tensor, step: NativeQuantStep, scale: float) -> torch.Tensor:
        store = self.kv_cache
        read_past = self._read_past if isinstance(store, BLOCK_TABLE_STORES) else None
        window = store.layout.window(layer)
        prefill = None if step.prefill_meta is None else step.prefill_meta[window]
        return write_prefill_then_decode(
            store, layer, q, k, v, k_pre, step.write_plan, prefill, step.num_decode_tokens,
            scale, lambda qd, kd, vd: self.decode(layer, qd, kd, vd, step.decodes[window], scale),
            read_past)

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               at: QuantDecodes, scale: float) -> torch.Tensor:
        """q: [B, Hq, D], k (after RoPE), v: [B, Hkv, D] of the decode tokens -> [B, Hq, D]."""
        if isinstance(self.kv_cache, BLOCK_TABLE_STORES):
            struct = self._block_layer(layer, q.shape[1])
            return kvquant_decode(struct, q, k, v, at.blk_ptr, at.blk_ids, at.past, scale,
                                  at.skip)
        buf = self.kv_cache.buffers
        return pertoken_decode(q, k, v, pertoken_format(self.kv_cache), buf["k_codes"][layer],
                               buf["v_codes"][layer], buf["k_scales"][layer],
                               buf["v_scales"][layer], at.runs, scale, self._rope())

    def _read_past(self, layer: int, block_table: torch.Tensor, num_slots: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill chunk's cached prefix decoded in C (keys after RoPE, values):
        [num_slots, Hkv, D] each, as the PyTorch path's `read_blocks` gives it."""
        ids = block_table[:cdiv(num_slots, self.block_size)].to(torch.int64).contiguous()
        # the read has no queries: the descriptor of query heads = KV heads
        return kvquant_read(self._block_layer(layer, self.kv_cache.layout.num_kv_heads), ids,
                            num_slots)

    def read_blocks(self, layer: int, block_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks block_ids [n] decoded in C: (k, v) each [n, B, Hkv, D] in the layout's
        dtype, keys after RoPE: the store's `read_blocks(layer, ids, store.rope)` (the block
        reader of its policy views)."""
        lay = self.kv_cache.layout
        n = block_ids.numel()
        k, v = self._read_past(layer, block_ids, n * self.block_size)  # [n * B, Hkv, D] each
        shape = (n, self.block_size, lay.num_kv_heads, lay.head_dim)
        return k.view(shape).to(lay.dtype), v.view(shape).to(lay.dtype)

    def _rope(self):
        """(slot positions, cos, sin) when the store keeps keys before RoPE, else None (as the
        PyTorch path, which rotates only with `store.rope`)."""
        store = self.kv_cache
        if store.rope is None:
            return None
        rotary = store.rotary
        cos, sin = rotary.cos.float().contiguous(), rotary.sin.float().contiguous()
        if not store.slot_positions.is_contiguous():
            raise RuntimeError("slot positions must be contiguous for the native kernel")
        return store.slot_positions, cos, sin

    def _block_layer(self, layer: int, num_q_heads: int) -> KVQuantLayer:
        """The layer's C descriptor for num_q_heads query heads, built once (the store's
        buffers never move)."""
        key = (layer, num_q_heads)
        if key not in self._layers:
            keep: list[torch.Tensor] = []

            def ptr(t: torch.Tensor) -> int:  # the kernel reads the store's live buffers
                if not t.is_contiguous():
                    raise RuntimeError(f"{self.kv_cache.kv_cache_dtype} buffers must be "
                                       f"contiguous for the native kernel")
                keep.append(t)
                return t.data_ptr()

            build = self._kivi_layer if isinstance(self.kv_cache, KIVIStore) \
                else self._kvquant_layer
            self._layers[key] = (build(layer, num_q_heads, ptr), keep)
        return self._layers[key][0]

    def _kivi_layer(self, layer: int, num_q_heads: int, ptr) -> KVQuantLayer:
        """KIVI as the kernel's layout: per-channel keys (min as offset, scale as half, a code's
        own value as its table entry), per-token values in groups of channels, no outliers or
        sinks, keys and values of a partial block staged."""
        store: KIVIStore = self.kv_cache
        buf, lay = store.buffers, store.layout
        levels = torch.arange(2 ** store.bits, dtype=torch.float32)  # code -> its value

        def side(name: str, per_channel: bool, groups: int) -> KVQuantSide:
            codes = buf[f"{name}_codes"][layer]
            return KVQuantSide(
                codes=ptr(codes), offset=ptr(buf[f"{name}_min"][layer]),
                half=ptr(buf[f"{name}_scale"][layer]), oidx=None, oval=None, lut=ptr(levels),
                sink=None, per_channel=int(per_channel), bits=store.bits,
                packed=codes.shape[-1], cap=0, idx_bytes=1, groups=groups)

        staging = buf["staging_k"][layer]
        return KVQuantLayer(
            k=side("k", True, 1), v=side("v", False, lay.head_dim // store.group_size),
            sink_slot=None, staging=ptr(staging), staging_v=ptr(buf["staging_v"][layer]),
            staging_index=ptr(buf["staging_index"]), slot_positions=None, cos=None, sin=None,
            num_sinks=0, sparse_kind=ELEMENT_KINDS[torch.float32],
            staging_kind=ELEMENT_KINDS[staging.dtype], rot_dim=0, block_size=store.block_size,
            num_q_heads=num_q_heads, num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim)

    def _kvquant_layer(self, layer: int, num_q_heads: int, ptr) -> KVQuantLayer:
        store: KVQuantStore = self.kv_cache
        buf, codec, lay = store.buffers, store.codecs[layer], store.layout

        def side(name: str, kind: str, per_channel: bool) -> KVQuantSide:
            book = codec.key_codebook if kind == "key" else codec.value_codebook
            lut = centroid_table(codec.bits, book)  # [2^bits] float32
            oidx = buf[f"{name}_oidx{layer}"]
            return KVQuantSide(
                codes=ptr(buf[f"{name}_codes{layer}"]), offset=ptr(buf[f"{name}_offset{layer}"]),
                half=ptr(buf[f"{name}_half{layer}"]), oidx=ptr(oidx),
                oval=ptr(buf[f"{name}_oval{layer}"]), lut=ptr(lut),
                sink=ptr(buf[f"sink_{name}{layer}"]), per_channel=int(per_channel),
                bits=codec.bits, packed=buf[f"{name}_codes{layer}"].shape[-1],
                cap=oidx.shape[-1], idx_bytes=INDEX_BYTES[oidx.dtype], groups=1)

        rope = self._rope()
        pos, cos, sin = rope if rope is not None else (None, None, None)
        if cos is not None and self._rope_layout is None:  # the store's one rotary table
            halves = halves_repeat(cos) and halves_repeat(sin)  # the kernel reads one half
            layout = rope_layout() if halves else 0
            self._rope_layout = (halves, rope_tiles(cos, sin) if layout == ROPE_TILES else None,
                                 rope_rows(cos, sin) if layout == ROPE_ROWS else None)
        halves, tiles, rows = self._rope_layout if cos is not None else (False, None, None)
        return KVQuantLayer(
            k=side("k", "key", store.staged), v=side("v", "value", False),
            sink_slot=ptr(buf["sink_slot"]), staging=ptr(buf["staging_k"][layer]),
            staging_v=None, staging_index=ptr(buf["staging_index"]),
            slot_positions=None if pos is None else ptr(pos),
            cos=None if cos is None else ptr(cos), sin=None if sin is None else ptr(sin),
            num_sinks=store.num_sinks,
            sparse_kind=ELEMENT_KINDS[buf[f"k_oval{layer}"].dtype],
            staging_kind=ELEMENT_KINDS[buf["staging_k"].dtype],
            rot_dim=0 if cos is None else cos.shape[-1], block_size=store.block_size,
            num_q_heads=num_q_heads, num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim,
            rope_halves_equal=int(halves), rope_tiles=None if tiles is None else ptr(tiles),
            rope_rows=None if rows is None else ptr(rows))

