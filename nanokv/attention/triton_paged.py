"""Triton kernels over the paged KV cache, read in place (`nanokv/kernels/triton/`), on CUDA.

Per layer: one kernel writes the step's K/V at their slots (quantizing for int8 / fp8 stores),
one decode kernel (flash-decoding: request x KV head x split, each over its own context length
only, then a merge of the splits) and one prefill kernel for all prefill chunks of the step
(variable lengths, cached prefix + causal own tokens, GQA; over int8 / fp8 codes in decode's
view: a chunk's token reads its earlier tokens from the cache, the chunk's own as just written,
and itself fresh, as `reference_quantized_attention`). Nothing is gathered into padded
copies and nothing dequantized to memory. Serves the float pool (float32 / bfloat16 / float16)
and the int8 / fp8 (e4m3, e5m2) stores with keys kept after RoPE. Layers with a sliding window
(`KVLayout.sliding_windows`) pass it to both kernels: each query over its last W slots.

CUDA graphs: `supports_cuda_graphs`; decode-only steps run from static metadata
(`graph_decode_metadata` / `fill_graph_decode`, the contract in `backend.py`) with launches
that depend only on the batch size and max_blocks.

Runs on CUDA (compute capability 8.0+); on CPU only under Triton's interpreter (TRITON_INTERPRET=1
set before triton is first imported: the tests), and "auto" never chooses it there. Tested in the
interpreter against the dense reference (tests/unit/test_triton_attention.py), and compiled for
sm_90 without a GPU (scripts/compile_triton_kernels.py: no register spills); it has not yet run
on a GPU, so nothing about its speed is measured.
"""

from __future__ import annotations

import os

import torch

from nanokv.attention.backend import AttentionBackend
from nanokv.attention.common import CommonAttentionMetadata
from nanokv.attention.native_quantized import pertoken_format
from nanokv.attention.triton_metadata import (
    TritonStep,
    build_step,
    fill_graph_step,
    graph_step,
)
from nanokv.cache.kv_pool import KVPool
from nanokv.kernels.triton import triton_unavailable
from nanokv.kernels.triton.paged_kv import FLOAT, FORMATS, PagedKV
from nanokv.quant.pertoken_store import FP8KVStore, Int8KVStore
from nanokv.utils import cdiv

POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the most decode splits the backends choose: all the kernels take
# (nanokv.kernels.triton.decode.MAX_SPLITS; not imported here: that imports Triton)
SPLIT_CAP = 64


def interpreter_on() -> bool:
    """TRITON_INTERPRET set: the kernels run on CPU tensors in Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def kv_format_of(kv_cache) -> int | None:
    """The kernels' KV_FORMAT for this cache, or None when they cannot read it."""
    if isinstance(kv_cache, KVPool):
        return FLOAT if kv_cache.layout.dtype in POOL_DTYPES else None
    fmt = pertoken_format(kv_cache)
    if fmt is None or kv_cache.pre_rope_keys:
        return None
    quantize = type(kv_cache)._quantize  # the kernels quantize as these stores do
    if quantize not in (Int8KVStore._quantize, FP8KVStore._quantize):
        return None
    return FORMATS[fmt]


class TritonPagedBackend(AttentionBackend):
    name = "triton"
    description = "Triton paged attention (decode, prefill and KV write kernels, in place)"
    supports_cuda_graphs = True
    supports_soft_cap = True
    auto_devices = ("cuda",)
    num_warps = 4
    num_stages = None  # decode's pipelining depth (None: Triton's default)

    def __init__(self, kv_cache, device: torch.device, soft_cap: float | None = None) -> None:
        super().__init__(kv_cache, device, soft_cap)
        # import here: the kernels read TRITON_INTERPRET when they are defined
        from nanokv.kernels.triton import decode, kv_write, prefill

        self._decode, self._write, self._prefill = decode, kv_write, prefill
        self.kv_format = kv_format_of(kv_cache)
        if soft_cap is not None and self.kv_format != FLOAT:
            raise ValueError(f"attention backend 'triton' applies an attention logit soft-cap "
                             f"over the float pool only (the cache is "
                             f"{kv_cache.kv_cache_dtype})")
        self.block_size = kv_cache.layout.block_size
        self.num_kv_heads = kv_cache.layout.num_kv_heads
        # keys per tile, and rows of a prefill tile (query tokens x the GQA group's heads)
        self.tile_n, self.block_rows = self.tiles_for(kv_cache.layout.dtype)
        # decode's keys per tile, and programs to aim for (request x KV head x split) in waves
        # of the GPU's multiprocessors
        self.decode_tile_n, waves = self.decode_launch(kv_cache.layout.dtype, self.kv_format)
        self.target_programs = (waves * torch.cuda.get_device_properties(device)
                                .multi_processor_count if device.type == "cuda" else 1)
        self._layers: dict[int, PagedKV] = {}

    @staticmethod
    def tiles_for(dtype: torch.dtype) -> tuple[int, int]:
        """(tile_n, block_rows) for a model in `dtype`: 64 x 64 for 16-bit floats; 32 x 32 for
        float32, whose exact (non tensor-core) dot needs more registers (what
        scripts/compile_triton_kernels.py reports for sm_90: no spills at these sizes)."""
        return (32, 32) if dtype == torch.float32 else (64, 64)

    @classmethod
    def decode_launch(cls, dtype: torch.dtype, kv_format: int | None) -> tuple[int, int]:
        """(keys per decode tile, waves of programs to aim for). The float pool: the prefill's
        key tile, two waves. 1-byte codes of a 16-bit model: tiles of 128 keys (the bytes of a
        float tile of 64) and 16 waves, many short splits: the int8 / fp8 kernels need more
        registers than the float one (fewer programs fit a multiprocessor), so their loads'
        latency is hidden by more programs in flight. On an H200 at 16 requests x 32k tokens
        (docs/results/gpu/README.md) this took int8 from 0.94 to 0.49 ms, the bf16 pool's
        0.52 ms; the float pool gained nothing from either."""
        tile_n = cls.tiles_for(dtype)[0]
        if kv_format in (None, FLOAT) or dtype == torch.float32:
            return tile_n, 2
        return 128, 16

    @classmethod
    def why_not(cls, kv_cache, device: torch.device) -> tuple[str, bool] | None:
        if device.type != "cuda" and not (device.type == "cpu" and interpreter_on()):
            return (f"it runs on CUDA GPUs (device {device.type}; on CPU only under "
                    f"TRITON_INTERPRET=1)"), True
        if kv_format_of(kv_cache) is None:
            dtype = getattr(kv_cache, "kv_cache_dtype", "?")
            return (f"its kernels read the float pool (float32, bfloat16, float16) and the int8 "
                    f"and fp8 stores with keys after RoPE (the cache is {dtype})"), True
        why = triton_unavailable()
        if why is not None:
            return why, False
        if device.type == "cuda" and torch.cuda.is_available():
            capability = torch.cuda.get_device_capability(device)
            if capability < (8, 0):  # bfloat16 dots, the tiles' shared memory
                return (f"it needs a GPU of compute capability 8.0 or newer (this one has "
                        f"{capability[0]}.{capability[1]})"), False
        return None

    # ---- metadata ------------------------------------------------------------------------------
    def decode_splits(self, rows: int, max_context: int) -> int:
        """Splits of each decode's context: enough programs to fill the GPU, no more splits than
        key tiles of the longest context, at most SPLIT_CAP. Depends only on its arguments."""
        wanted = cdiv(self.target_programs, max(1, rows * self.num_kv_heads))
        return max(1, min(wanted, cdiv(max_context, self.decode_tile_n), SPLIT_CAP))

    def build(self, common: CommonAttentionMetadata) -> TritonStep:
        if common.per_layer is not None:  # each layer its own slices of the flat pool
            if self.kv_format != FLOAT:
                raise RuntimeError("per-layer block tables need the float KV pool")
            layers = [build_step(c, self.device, None, self.decode_splits, flat_layers=True)
                      for c in common.per_layer]
            return TritonStep(layers[0].slot_mapping, 0, layers[0].block_tables,
                              layers[0].context_lens, 1, per_layer=layers)
        plan = common.write_plan
        slots = plan if isinstance(plan, torch.Tensor) else getattr(plan, "slot_mapping", None)
        return build_step(common, self.device, slots, self.decode_splits)

    def graph_decode_metadata(self, max_batch: int, max_blocks: int) -> TritonStep:
        return graph_step(max_batch, max_blocks, self.device)

    def fill_graph_decode(self, meta: TritonStep, common: CommonAttentionMetadata,
                          batch: int) -> None:
        max_blocks = meta.block_tables.shape[1]
        fill_graph_step(meta, common, batch,
                        self.decode_splits(batch, max_blocks * self.block_size))

    # ---- one layer -----------------------------------------------------------------------------
    def paged_kv(self, layer: int, flat_layers: bool = False) -> PagedKV:
        """The layer's cache as the kernels read it (or all layers as flat slices)."""
        key = -1 if flat_layers else layer
        if key not in self._layers:
            cache = self.kv_cache
            if flat_layers:
                self._layers[key] = PagedKV(*cache.flat_layers())
            elif self.kv_format == FLOAT:
                self._layers[key] = PagedKV(*cache.layer(layer))
            else:
                buf = cache.buffers
                self._layers[key] = PagedKV(buf["k_codes"][layer], buf["v_codes"][layer],
                                            buf["k_scales"][layer], buf["v_scales"][layer],
                                            self.kv_format)
        return self._layers[key]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_pre: torch.Tensor, step: TritonStep, scale: float) -> torch.Tensor:
        if step.per_layer is not None:
            step = step.per_layer[layer]
        kv = self.paged_kv(layer, step.flat_layers)
        window = self.kv_cache.layout.window(layer)
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        rows = q.shape[0]
        self._write.write_kv(k, v, step.slot_mapping[:rows], kv)
        out = torch.empty_like(q)
        nd = step.num_rows
        if nd:
            self._decode.decode_attention(
                q[:nd], k[:nd], v[:nd], kv, step.block_tables[:nd], step.context_lens[:nd],
                out[:nd], scale, step.num_splits, self.decode_tile_n, self.num_warps,
                self.num_stages, window, self.soft_cap)
        chunks = step.prefill
        if chunks is not None:
            self._prefill.prefill_attention(
                q, k, v, kv, chunks.query_start, chunks.query_len, chunks.context_lens,
                chunks.block_tables, chunks.max_query_len, out, scale, self.block_rows,
                self.tile_n, self.num_warps, window=window, soft_cap=self.soft_cap)
        return out
