"""KIVI store (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"):
keys per channel, values per token, asymmetric min / scale integer codes, the newest tokens kept
in full precision. Keys are stored as given, after RoPE (KIVI quantizes post-RoPE keys).

Paged adaptation. KIVI groups G tokens along the token axis for each key channel, groups G
channels of each value token, and keeps a residual of the R newest tokens unquantized, quantizing
it when it reaches R. Here:
  - the key token group is the BLOCK: one min and one scale per (block, KV head, channel)
    (KIVI's G = 32 tokens: B = 16 is finer, B = 128 coarser and cheaper in statistics);
  - values are grouped along channels: one min and one scale per (slot, KV head, group of
    `group_size` channels), `group_size` dividing head_dim (default 32, as KIVI; through
    `from_settings` / `settings_from_options` gcd(32, head_dim), so head_dim 16 gets 16);
  - the residual is the request's partial (newest, not yet full) block, keys AND values, kept
    in full precision (layout.dtype, read back exactly) in one of S = `num_staging_blocks`
    staging blocks; the block is quantized, K and V together, when its last slot is written.
    So R is 0..B-1 tokens for both (KIVI slides a window over values; here they wait for the
    block, one quantization event per block). One staging block per running request suffices
    (a request has at most one partial block; a block filling in a step frees its staging
    block before new ones are taken), so S >= max_num_seqs.

Code of x in a group: c = round((x - m) / s) clamped to [0, 2^b - 1], x' = c * s + m, with
m = min and s = (max - m) / (2^b - 1) stored in fp16 and rounded OUTWARD (m down, s up) so the
grid covers the group: |x - x'| <= s / 2 for every element (groups past +-65504 saturate).
Codes are bit-packed along head_dim (`packing.pack`), bits in {2, 4}.

Buffers (P = packed_dim(D, b) = D * b / 8 bytes, g = D / group_size):

    k_codes, v_codes       uint8  [L, num_blocks, B, Hkv, P]
    k_min, k_scale         fp16   [L, num_blocks, Hkv, D]       per block and channel
    v_min, v_scale         fp16   [L, num_blocks, B, Hkv, g]    per slot and channel group
    staging_k, staging_v   layout.dtype [L, S, B, Hkv, D]
    staging_index          int32  [num_blocks]  (staging row of a block, -1 none)

Bytes per token (all layers): L * Hkv * (2 * P + 4 * D / B + 4 * g) + 4 / B (staging index)
+ 4 (slot position, when the store owns them), plus the fixed staging 2 * S * B * L * Hkv * D *
elem. With D = 128, b = 2, g = 4, B = 16 that is 112 bytes per KV head and layer against 512 in
fp16 (64 of codes, 32 of key statistics, 16 of value statistics).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from nanokv.cache.kv_pool import KVLayout
from nanokv.kernels.triton import triton_unavailable
from nanokv.quant.graph_write import COMMON_PARTS, GraphWritePlan, HostWritePlan, padded_entries
from nanokv.quant.packing import pack, packed_dim, unpack
from nanokv.quant.staging import BlockStaging
from nanokv.quant.store import BufferSpec, QuantizedKVStore, Rope, WritePlan, as_list
from nanokv.transfer import upload_parts

KIVI_BITS = (2, 4)
FP16_MAX = 65504.0


def _validate(layout: KVLayout, bits: int, group_size: int, num_staging_blocks: int) -> None:
    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)

    if not is_int(bits) or bits not in KIVI_BITS:
        raise ValueError(f"kivi (kv_quant_bits): bits must be one of {list(KIVI_BITS)}, "
                         f"got {bits!r}")
    dim = layout.head_dim
    if not is_int(group_size) or group_size < 1 or dim % group_size:
        allowed = [g for g in range(1, dim + 1) if dim % g == 0]
        raise ValueError(f"kivi group_size must divide head_dim {dim}: one of {allowed}, "
                         f"got {group_size!r}")
    if not is_int(num_staging_blocks) or num_staging_blocks < 1:
        raise ValueError(f"kivi num_staging_blocks must be an integer >= 1 (>= max_num_seqs: "
                         f"one per running request), got {num_staging_blocks!r}")


def _fp16_outward(x: torch.Tensor, up: bool) -> torch.Tensor:
    """float32 -> fp16 rounded toward +inf (up) or -inf, saturating at +-65504."""
    x = x.clamp(-FP16_MAX, FP16_MAX)
    h = x.to(torch.float16)
    wrong = h.float() < x if up else h.float() > x
    toward = torch.full_like(h, float("inf") if up else float("-inf"))
    return torch.where(wrong, torch.nextafter(h, toward), h)


def quantize_groups(x: torch.Tensor, dim: int, bits: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min / scale codes of the groups along `dim` of x -> (uint8 codes like x,
    fp16 min and scale with `dim` of size 1)."""
    x = x.float()
    levels = 2 ** bits - 1
    lo = _fp16_outward(x.amin(dim, keepdim=True), up=False)
    scale = _fp16_outward((x.amax(dim, keepdim=True) - lo.float()) / levels, up=True)
    step = torch.where(scale > 0, scale, 1).float()  # scale 0: a constant group, x == lo
    codes = torch.round((x - lo.float()) / step).clamp_(0, levels).to(torch.uint8)
    return codes, lo, scale


def dequantize_groups(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor
                      ) -> torch.Tensor:
    """codes * scale + min (min, scale broadcast against codes) -> float32."""
    return codes.float() * scale.float() + lo.float()


@dataclass
class KIVIWritePlan(WritePlan):
    stage_src: torch.Tensor  # [Ts] token index of each token kept in staging
    stage_dst: torch.Tensor  # [Ts] flat staging slot (row * B + slot), -1: padding
    quant_blocks: torch.Tensor  # [nq] blocks that fill up in this step, -1: padding
    quant_src: torch.Tensor  # [nq, B] < S*B: staging slot; else S*B + token index
    host: HostWritePlan | None = None  # the same indexes as host lists (a graph plan's source)


class KIVIStore(QuantizedKVStore):
    kv_cache_dtype = "kivi"
    graph_parts = COMMON_PARTS  # its decode steps' graph plan

    # the engine options it reads beyond kv_cache_dtype (nanokv.cache.registry)
    engine_options: ClassVar[frozenset[str]] = frozenset({"kv_quant_bits"})
    # a partial block is staged at full precision, quantized when its last slot is written:
    # speculative drafts stop before that slot, and a rejected one's staged slot is written
    # again
    supports_speculation = True
    quantizes_full_blocks = True

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu",
                 *, bits: int = 2, group_size: int = 32, num_staging_blocks: int,
                 slot_positions: torch.Tensor | None = None) -> None:
        _validate(layout, bits, group_size, num_staging_blocks)
        super().__init__(layout, num_blocks, device, False, slot_positions)
        self.bits, self.group_size = bits, group_size
        self.num_staging_blocks = num_staging_blocks
        self._allocate(self.buffer_specs())
        self.buffers["staging_index"].fill_(-1)
        self.staging = BlockStaging(num_blocks, self.block_size, num_staging_blocks, "kivi")
        # quantize-on-write as a Triton kernel on CUDA (`kernels/triton/kivi_write.py`; the
        # tests turn it on for a CPU store under Triton's interpreter); value groups of a power
        # of two channels (the default's gcd(32, head_dim) always is), else the PyTorch path
        self.triton_write = False
        if self.device.type == "cuda" and triton_unavailable() is None:
            from nanokv.kernels.triton import kivi_write

            self.triton_write = kivi_write.fits(group_size)

    @classmethod
    def from_settings(cls, layout: KVLayout, num_blocks: int, device: torch.device | str,
                      slot_positions: torch.Tensor | None = None, *, bits: int | None = None,
                      num_staging_blocks: int, group_size: int | None = None) -> KIVIStore:
        """The registry's entry point. bits None: 2; group_size None: gcd(32, head_dim) (32,
        or the largest power of two dividing a smaller head_dim, e.g. 16 for head_dim 16)."""
        return cls(layout, num_blocks, device, bits=2 if bits is None else bits,
                   group_size=math.gcd(32, layout.head_dim) if group_size is None else group_size,
                   num_staging_blocks=num_staging_blocks, slot_positions=slot_positions)

    @classmethod
    def settings_from_options(cls, options, layout: KVLayout) -> dict:
        """Engine options (kv_quant_bits, max_num_seqs) -> `from_settings` keywords, validated:
        one staging block per running request."""
        settings = {"bits": 2 if options.kv_quant_bits is None else options.kv_quant_bits,
                    "group_size": math.gcd(32, layout.head_dim),
                    "num_staging_blocks": options.max_num_seqs}
        _validate(layout, **settings)
        return settings

    @property
    def settings(self) -> dict:
        return {"bits": self.bits, "group_size": self.group_size,
                "num_staging_blocks": self.num_staging_blocks}

    # ---- layout ------------------------------------------------------------------------------
    @classmethod
    def specs_for(cls, layout: KVLayout, num_blocks: int, settings: dict) -> list[BufferSpec]:
        """Every tensor a store with these settings (`settings`' keys) allocates."""
        bits, group, rows = settings["bits"], settings["group_size"], \
            settings["num_staging_blocks"]
        lay, nb, f16 = layout, num_blocks, torch.float16
        layers, bsz, heads, dim = lay.num_layers, lay.block_size, lay.num_kv_heads, lay.head_dim
        codes = (layers, nb, bsz, heads, packed_dim(dim, bits))
        k_stats = (layers, nb, heads, dim)
        v_stats = (layers, nb, bsz, heads, dim // group)
        staging = (layers, rows, bsz, heads, dim)
        return [BufferSpec("k_codes", codes, torch.uint8, "codes"),
                BufferSpec("v_codes", codes, torch.uint8, "codes"),
                BufferSpec("k_min", k_stats, f16, "scales"),
                BufferSpec("k_scale", k_stats, f16, "scales"),
                BufferSpec("v_min", v_stats, f16, "scales"),
                BufferSpec("v_scale", v_stats, f16, "scales"),
                BufferSpec("staging_k", staging, lay.dtype, "staging"),
                BufferSpec("staging_v", staging, lay.dtype, "staging"),
                BufferSpec("staging_index", (nb,), torch.int32, "bookkeeping")]

    def buffer_specs(self) -> list[BufferSpec]:
        return self.specs_for(self.layout, self.num_blocks, self.settings)

    def _block_axis(self, name: str) -> int | None:
        if name.startswith("staging"):
            return 0 if name == "staging_index" else None
        return 1  # [L, num_blocks, ...]

    def extra_keys(self) -> tuple:
        return super().extra_keys() + (("kivi_bits", self.bits),
                                       ("kivi_group_size", self.group_size))

    @property
    def num_free_staging_blocks(self) -> int:
        return self.staging.num_free_rows

    # ---- writing -----------------------------------------------------------------------------
    def plan_write(self, slot_mapping: Sequence[int] | torch.Tensor,
                   positions: Sequence[int] | torch.Tensor) -> KIVIWritePlan:
        slots, pos = as_list(slot_mapping), as_list(positions)
        if len(slots) != len(pos):
            raise ValueError(f"{len(slots)} slots but {len(pos)} positions")
        step = self.staging.plan(slots)  # validates before anything changes
        # every index list in one host -> device copy
        parts = {"slots": slots, "positions": pos, "stage_src": step.stage_src,
                 "stage_dst": step.stage_dst, "quant_blocks": step.quant_blocks,
                 "quant_src": step.quant_src, "row_blocks": list(step.row_changes),
                 "rows": list(step.row_changes.values())}
        at = dict(zip(parts, upload_parts(list(parts.values()), self.device)))
        base = super().plan_write(at["slots"], at["positions"])  # the slots' positions
        if step.row_changes:
            self.buffers["staging_index"][at["row_blocks"]] = at["rows"].to(torch.int32)
        return KIVIWritePlan(base.slot_mapping, base.positions, stage_src=at["stage_src"],
                             stage_dst=at["stage_dst"], quant_blocks=at["quant_blocks"],
                             quant_src=at["quant_src"].view(-1, self.block_size),
                             host=HostWritePlan(slots, pos, step.stage_src, step.stage_dst,
                                                step.quant_blocks, step.quant_src))

    # ---- decode steps through CUDA graphs ------------------------------------------------------
    def fill_graph_write(self, graph: GraphWritePlan, plan: KIVIWritePlan | None,
                         batch: int) -> KIVIWritePlan:
        """The step's plan (one token a row, from `plan_write`; None: no rows) copied into the
        graph plan's static tensors, rows up to `batch` padded; returns the plan of `batch`
        rows, views of those tensors (the same views for every step of that batch)."""
        host, entries, quant_src = padded_entries(graph, plan, batch)
        m = graph.max_batch
        graph.fill(entries, quant_src, np.zeros(m, dtype=bool),
                   np.zeros((m, self.block_size), dtype=bool))
        views = graph.views(batch)
        return KIVIWritePlan(views.part["slot_mapping"], views.part["positions"],
                             stage_src=views.rows, stage_dst=views.part["stage_dst"],
                             quant_blocks=views.part["quant_blocks"], quant_src=views.quant_src)

    def write(self, layer: int, plan: KIVIWritePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        heads, dim = self.layout.num_kv_heads, self.layout.head_dim
        staged_slots = self.num_staging_blocks * self.block_size
        for name, x in (("k", k), ("v", v)):
            staging = self.buffers[f"staging_{name}"][layer].view(-1, heads, dim)  # [S*B, H, D]
            if self.triton_write:
                self._triton_write(name, layer, plan, x, staging)
                continue
            if plan.quant_blocks.numel():  # before the staging writes: rows may be reused
                src = plan.quant_src  # [nq, B]
                old = staging[src.clamp(max=staged_slots - 1)].float()  # [nq, B, Hkv, D]
                new = x[(src - staged_slots).clamp_min(0)].float()
                blocks = torch.where((src < staged_slots)[..., None, None], old, new)
                self._quantize_blocks(name, layer, plan.quant_blocks, blocks)
            if plan.stage_src.numel():
                staging.index_copy_(0, plan.stage_dst, x[plan.stage_src].to(staging.dtype))

    def _triton_write(self, name: str, layer: int, plan: KIVIWritePlan, x: torch.Tensor,
                      staging: torch.Tensor) -> None:
        """The filling blocks quantized, then the staged tokens written: two launches (each
        skips padded entries, -1)."""
        from nanokv.kernels.triton import kivi_write, kvquant_write

        buf = self.buffers
        if plan.quant_blocks.numel():  # before the staging writes: rows may be reused
            kivi_write.quantize_blocks(x, staging, plan.quant_src, plan.quant_blocks,
                                       buf[f"{name}_codes"][layer], buf[f"{name}_min"][layer],
                                       buf[f"{name}_scale"][layer], self.bits, name == "k",
                                       self.group_size)
        if plan.stage_src.numel():
            kvquant_write.scatter_rows(x, plan.stage_src, plan.stage_dst, staging)

    def _quantize_blocks(self, name: str, layer: int, blocks: torch.Tensor,
                         x: torch.Tensor) -> None:
        """x: [nq, B, Hkv, D] float32, the full blocks `blocks` [nq] -> codes and statistics."""
        buf = self.buffers
        if name == "k":  # per channel: the group is the block's B tokens
            codes, lo, scale = quantize_groups(x, 1, self.bits)  # stats [nq, 1, Hkv, D]
            lo, scale = lo.squeeze(1), scale.squeeze(1)
        else:  # per token: groups of group_size channels
            n, bsz, heads, dim = x.shape
            grouped = x.view(n, bsz, heads, dim // self.group_size, self.group_size)
            codes, lo, scale = quantize_groups(grouped, -1, self.bits)  # [nq, B, Hkv, g, 1]
            codes, lo, scale = codes.view_as(x), lo.squeeze(-1), scale.squeeze(-1)
        buf[f"{name}_codes"][layer].index_copy_(0, blocks, pack(codes, self.bits))
        buf[f"{name}_min"][layer].index_copy_(0, blocks, lo)
        buf[f"{name}_scale"][layer].index_copy_(0, blocks, scale)

    # ---- block lifetime ----------------------------------------------------------------------
    def release(self, block_ids: Sequence[int]) -> None:
        dropped = self.staging.release(block_ids)
        if dropped:
            self.buffers["staging_index"][torch.tensor(dropped, device=self.device)] = -1

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        pairs = list(pairs)
        if not pairs:
            return
        row_copies = self.staging.copy(pairs)  # raises, changing nothing, when rows run short
        super().copy_blocks(pairs)  # codes, statistics, positions (staging_index: below)
        for src, dst in row_copies:  # a partial source: the copy gets its own staged residual
            for name in ("staging_k", "staging_v"):
                self.buffers[name][:, dst] = self.buffers[name][:, src]
        touched = torch.tensor([d for _, d in pairs], device=self.device)
        self.buffers["staging_index"][touched] = torch.tensor(
            [int(self.staging.row[d]) for _, d in pairs], dtype=torch.int32, device=self.device)

    # ---- reading -----------------------------------------------------------------------------
    @property
    def stages_blocks(self) -> bool:
        return True  # keys and values wait for their block (the residual)

    def staged_rows(self, k, v, k_store, positions):
        dtype = self.layout.dtype  # the staging's (keys after RoPE)
        return k.to(dtype).to(k.dtype), v.to(dtype).to(v.dtype)

    def read_blocks(self, layer: int, block_ids: torch.Tensor, rope: Rope | None = None):
        buf, ids = self.buffers, block_ids.long().flatten()
        n, bsz, heads, dim = ids.numel(), self.block_size, self.layout.num_kv_heads, \
            self.layout.head_dim
        rows = buf["staging_index"][ids].long()  # [n], -1 = not staged
        staged = (rows >= 0)[:, None, None, None]
        out = []
        for name in ("k", "v"):
            codes = unpack(buf[f"{name}_codes"][layer][ids], self.bits, dim)  # [n, B, Hkv, D]
            lo, scale = buf[f"{name}_min"][layer][ids], buf[f"{name}_scale"][layer][ids]
            if name == "k":  # stats [n, Hkv, D]
                x = dequantize_groups(codes, lo.unsqueeze(1), scale.unsqueeze(1))
            else:  # stats [n, B, Hkv, g]
                grouped = codes.view(n, bsz, heads, dim // self.group_size, self.group_size)
                x = dequantize_groups(grouped, lo.unsqueeze(-1), scale.unsqueeze(-1))
                x = x.view(n, bsz, heads, dim)
            residual = buf[f"staging_{name}"][layer][rows.clamp_min(0)]  # [n, B, Hkv, D]
            out.append(torch.where(staged, residual, x.to(self.layout.dtype)))
        return self._rotate(out[0], ids, rope), out[1]
