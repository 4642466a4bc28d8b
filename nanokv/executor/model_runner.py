"""Turns a SchedulerOutput into one forward pass and sampled tokens.

Prepares the flattened batch (input ids, positions, slot mapping), the attention metadata (block
tables, context lengths), runs the model, computes logits only for rows that sample, samples.
"""

from __future__ import annotations

import logging

import torch

from nanokv.cache.kv_pool import KVPool
from nanokv.layers.attention import AttentionMetadata, PrefillSeq
from nanokv.layers.native_attention import (NativeKernelUnavailable, build_decode_runs,
                                            load_decode_kernel)
from nanokv.layers.sampler import Sampler
from nanokv.scheduler.output import RunnerOutput, SchedulerOutput

logger = logging.getLogger("nanokv")


def choose_decode_backend(backend: str, device: torch.device, kv_pool: KVPool,
                          kv_store=None) -> str:
    """Decode attention: "native" (the C kernel, CPU + float32 pool only) or "torch".

    auto takes the kernel where it applies and builds, and logs why not otherwise; native
    raises when it cannot be used; torch is the PyTorch reference path."""
    if backend == "torch":
        return "torch"
    why = None
    if device.type != "cpu":
        why = f"it runs on CPUs only (device {device.type})"
    elif kv_store is not None:
        why = "a quantized KV cache has its own attention"
    elif kv_pool.kv.dtype != torch.float32:
        why = f"it reads float32 caches only (the pool is {kv_pool.kv.dtype})"
    else:
        try:
            load_decode_kernel()
        except NativeKernelUnavailable as e:
            why = str(e)
    if why is None:
        return "native"
    if backend == "native":
        raise ValueError(f"attention_backend 'native' cannot be used: {why}; "
                         f"use 'auto' or 'torch'")
    if device.type == "cpu" and kv_store is None:
        logger.warning("decode attention: PyTorch path, the C kernel is not used: %s", why)
    return "torch"


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_pool: KVPool, device: torch.device,
                 seed: int, kv_store=None, rope=None, attention_backend: str = "auto") -> None:
        """kv_store: a `nanokv.quant.QuantizedKVStore` holding the K/V instead of the pool's
        float tensor (the pool then only keeps slot positions); rope: the model's RoPE as a
        store `Rope`, used to rotate keys the store keeps before RoPE; attention_backend: see
        `choose_decode_backend`."""
        self.model = model
        self.kv_pool = kv_pool
        self.kv_store = kv_store
        self.device = device
        self.block_size = kv_pool.layout.block_size
        self.sampler = Sampler(seed)
        self.native_decode = choose_decode_backend(attention_backend, device, kv_pool,
                                                   kv_store) == "native"
        flat = kv_pool.flat_layers() if kv_store is None else (None, None)
        for index, attn in enumerate(model.attention_layers()):
            if kv_store is None:
                attn.k_cache, attn.v_cache = kv_pool.layer(index)
                attn.k_flat, attn.v_flat = flat
                attn.layer_index = index
            else:
                attn.k_cache = attn.v_cache = None
                attn.kv_store, attn.layer_index, attn.rope = kv_store, index, rope

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        input_ids, positions, meta, sample_rows = self.prepare(sched)
        hidden = self.model(input_ids, positions, meta)  # [T, hidden]
        if self.kv_store is None:  # a quantized store records positions in plan_write
            self.kv_pool.slot_positions.view(-1)[meta.slot_mapping] = positions.to(torch.int32)
        prompt_logits = self._prompt_logits(sched, hidden)
        captured = meta.captured or {}
        if not sample_rows:
            return RunnerOutput({}, prompt_logits, captured)
        rows = torch.tensor(sample_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows])  # [N, vocab]
        sampled = [s for s in sched.scheduled if s.sample]
        out = self.sampler.sample(logits, [s.params for s in sampled],
                                  [s.output_index for s in sampled],
                                  [s.history for s in sampled])
        logprobs = {s.request_id: lp for s, lp in zip(sampled, out.logprobs) if lp is not None}
        return RunnerOutput({s.request_id: t for s, t in zip(sampled, out.token_ids)},
                            prompt_logits, captured, logprobs)

    def _prompt_logits(self, sched: SchedulerOutput, hidden: torch.Tensor) -> dict:
        """Logits of every prompt position for requests that asked (evaluation only)."""
        out, start = {}, 0
        for s in sched.scheduled:
            if s.params.return_prompt_logits and s.output_index == 0:
                out[s.request_id] = self.model.compute_logits(
                    hidden[start:start + s.num_tokens]).cpu()  # [n, vocab]
            start += s.num_tokens
        return out

    def prepare(self, sched: SchedulerOutput):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        capture: list[tuple[str, int, int]] = []
        for s in sched.scheduled:
            start = len(input_ids)
            n = s.num_tokens
            input_ids += s.token_ids
            positions += range(s.start_position, s.start_position + n)
            table = s.block_table
            if s.layer_tables is not None:  # per-layer tables: layer 0's slot, as a pool slot
                pool_slots = self.kv_pool.num_blocks * bs
                first = s.layer_start_slots[0]
                t0 = s.layer_tables[0]
                slots += [(t0[j // bs] * bs + j % bs) % pool_slots for j in range(first, first + n)]
            else:
                slots += [table[j // bs] * bs + j % bs
                          for j in range(s.start_slot, s.start_slot + n)]
            context = s.start_slot + n
            if s.is_decode:
                decode_tables.append(table[:-(-context // bs)])
                decode_lens.append(context)
            else:
                blocks = torch.tensor(table[:-(-context // bs)], dtype=torch.long,
                                      device=self.device)
                prefills.append(PrefillSeq(start, n, context, blocks))
            if s.sample:
                sample_rows.append(start + n - 1)
            if s.capture_from is not None and s.start_position + n > s.capture_from:
                first = max(0, s.capture_from - s.start_position)
                capture.append((s.request_id, start + first, start + n))
        num_decode = len(decode_tables)
        if any(not s.is_decode for s in sched.scheduled[:num_decode]):
            raise RuntimeError("decodes must come first in the batch")
        decode_block_tables = decode_mask = None
        if num_decode and not self.native_decode:  # the kernel reads `decode_runs` instead
            decode_block_tables = self._padded(decode_tables)  # [B, max_blocks]
            lens = torch.tensor(decode_lens, device=self.device)
            span = torch.arange(decode_block_tables.shape[1] * bs, device=self.device)
            decode_mask = (span[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, S]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decode_tokens=num_decode, decode_block_tables=decode_block_tables,
            decode_mask=decode_mask, prefills=prefills,
            # CPU: each request over its own blocks in place; CUDA: one padded, masked batch
            decode_context_lens=decode_lens if num_decode and self.device.type == "cpu" else None,
            decode_block_lists=decode_tables if num_decode else None,
            query_capture=capture or None, captured={} if capture else None)
        if any(s.layer_tables is not None for s in sched.scheduled):
            if self.kv_store is not None:
                raise RuntimeError("per-layer block tables need the float KV pool")
            meta.per_layer = [self._layer_meta(sched, layer, num_decode)
                              for layer in range(self.kv_pool.layout.num_layers)]
        elif num_decode and self.native_decode:
            meta.decode_runs = build_decode_runs(decode_tables, decode_lens, bs)
        if self.kv_store is not None:  # host bookkeeping once per step; records slot positions
            meta.kv_plan = self.kv_store.plan_write(slots, positions)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos, meta, sample_rows

    def _padded(self, tables: list[list[int]]) -> torch.Tensor:
        """Block tables of different lengths as one [B, max_blocks] int64 tensor (0-padded)."""
        width = max(len(t) for t in tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long,
                            device=self.device)

    def _layer_meta(self, sched: SchedulerOutput, layer: int,
                    num_decode: int) -> AttentionMetadata:
        """One layer's metadata in flat layer-slice ids (`KVPool.flat_layers`): a request with
        per-layer tables uses its own; the others their shared table, offset to this layer."""
        bs = self.block_size
        offset = layer * self.kv_pool.num_blocks
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        for s in sched.scheduled:
            start, n = len(slots), s.num_tokens
            if s.layer_tables is not None:
                table, first = s.layer_tables[layer], s.layer_start_slots[layer]
            else:
                table, first = [b + offset for b in s.block_table], s.start_slot
            context = first + n
            table = table[:-(-context // bs)]
            slots += [table[j // bs] * bs + j % bs for j in range(first, context)]
            if s.is_decode:
                decode_tables.append(table)
                decode_lens.append(context)
            else:
                blocks = torch.tensor(table, dtype=torch.long, device=self.device)
                prefills.append(PrefillSeq(start, n, context, blocks))
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decode_tokens=num_decode,
            decode_block_tables=self._padded(decode_tables)
            if num_decode and not self.native_decode else None,
            decode_mask=None, prefills=prefills,
            decode_context_lens=decode_lens if num_decode else None,
            decode_block_lists=decode_tables if num_decode else None,
            decode_runs=build_decode_runs(decode_tables, decode_lens, bs)
            if num_decode and self.native_decode else None)
