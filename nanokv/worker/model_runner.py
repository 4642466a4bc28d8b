"""Turns a SchedulerOutput into one forward pass and sampled tokens.

Prepares the flattened batch (input ids, positions) and the step's common attention description
(slot mapping, block tables, context lengths), which the engine's attention backend shapes into
its own metadata; runs the model; computes logits only for rows that sample; samples. The queries
KV policies asked for come back from the model and are returned per request.

Under tensor parallelism every rank runs `execute` on the same SchedulerOutput (its share of the
heads); logits and captured queries are gathered on rank 0, which alone samples.
"""

from __future__ import annotations

import torch

from nanokv.attention.common import CommonAttentionMetadata, PrefillChunk, StepAttention
from nanokv.layers.sampler import Sampler
from nanokv.sampling_params import SamplingParams
from nanokv.scheduler.output import RunnerOutput, ScheduledRequest, SchedulerOutput
from nanokv.utils import cdiv

_SCORING_PARAMS = SamplingParams(temperature=0, max_tokens=1)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache, attention_backend, device: torch.device,
                 seed: int, tp=None) -> None:
        """kv_cache: the engine's `KVCache`; attention_backend: the `AttentionBackend` chosen at
        start-up (it reads and writes `kv_cache`); tp: this rank's
        `nanokv.distributed.parallel_state.TensorParallel` (None without tensor parallelism)."""
        self.tp = tp
        self.model = model
        self.kv_cache = kv_cache
        self.backend = attention_backend
        self.device = device
        self.block_size = kv_cache.layout.block_size
        self.num_pool_blocks = kv_cache.num_blocks
        self.sampler = Sampler(seed)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        input_ids, positions, step, sample_rows, capture = self.prepare(sched)
        hidden, q_rows = self.model(input_ids, positions, step)  # [T, hidden]
        if self.tp is not None and q_rows is not None:  # every rank's heads, on rank 0
            q_rows = [self.tp.gather(q, dim=1) for q in q_rows]  # each [Tc, Hq, D]
            if not self.tp.is_first:
                q_rows, capture = None, []
        prompt_logits = self._prompt_logits(sched, hidden)
        captured = self._split_captured(q_rows, capture)
        if not sample_rows:
            return RunnerOutput({}, prompt_logits, captured)
        rows = torch.tensor(sample_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows])  # [N, vocab]
        if logits is None:  # a tensor-parallel rank other than 0: rank 0 samples
            return RunnerOutput({}, prompt_logits, captured)
        sampled = [s for s in sched.scheduled if s.sample]
        out = self.sampler.sample(logits, [s.params for s in sampled],
                                  [s.output_index for s in sampled],
                                  [s.history for s in sampled])
        logprobs = {s.request_id: lp for s, lp in zip(sampled, out.logprobs) if lp is not None}
        return RunnerOutput({s.request_id: t for s, t in zip(sampled, out.token_ids)},
                            prompt_logits, captured, logprobs)

    @torch.inference_mode()
    def score_forward(self, token_ids: list[int], start_position: int, start_slot: int,
                      block_table: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A KV policy's extra forward pass (KVzip's reconstruction): `token_ids` as one prefill
        chunk at positions start_position.. and slots start_slot.. of `block_table`, attending to
        slots [0, start_slot) of it. The caller gives a table whose blocks from slot start_slot on
        are scratch blocks (the request's own are only read). Returns per layer the chunk's
        post-RoPE queries [T, Hq, D] and its keys as written [T, Hkv, D]. Float pool only."""
        n = len(token_ids)
        rotary = self.model.rotary
        if start_position + n > rotary.max_positions:  # the pass may run past max_model_len
            rotary.max_positions = start_position + n
            rotary.build_tables(self.device)
        s = ScheduledRequest("#scoring", list(token_ids), start_position, start_slot, block_table,
                             sample=False, params=_SCORING_PARAMS, output_index=0,
                             capture_from=start_position)
        input_ids, positions, step, _, _ = self.prepare(SchedulerOutput([s]))
        _, q_rows = self.model(input_ids, positions, step)  # per layer [T, Hq, D]
        bs = self.block_size
        slots = torch.tensor([block_table[j // bs] * bs + j % bs
                              for j in range(start_slot, start_slot + n)], device=self.device)
        keys = []
        for layer in range(self.kv_cache.layout.num_layers):
            k_cache, _ = self.kv_cache.layer(layer)  # [num_blocks, B, Hkv, D]
            keys.append(k_cache.view(-1, *k_cache.shape[2:])[slots])  # [T, Hkv, D]
        return q_rows, keys

    def _prompt_logits(self, sched: SchedulerOutput, hidden: torch.Tensor) -> dict:
        """Logits of every prompt position for requests that asked (evaluation only)."""
        out, start = {}, 0
        for s in sched.scheduled:
            if s.params.return_prompt_logits and s.output_index == 0:
                logits = self.model.compute_logits(hidden[start:start + s.num_tokens])
                if logits is not None:  # None: a tensor-parallel rank other than 0
                    out[s.request_id] = logits.cpu()  # [n, vocab]
            start += s.num_tokens
        return out

    def prepare(self, sched: SchedulerOutput):
        """Input ids [T], positions [T], the step's StepAttention, the rows that sample, and the
        query capture [(request id, first row, end row)]."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        capture: list[tuple[str, int, int]] = []
        for s in sched.scheduled:
            start, n = len(input_ids), s.num_tokens
            input_ids += s.token_ids
            positions += range(s.start_position, s.start_position + n)
            if s.sample:
                sample_rows.append(start + n - 1)
            if s.capture_from is not None and s.start_position + n > s.capture_from:
                first = max(0, s.capture_from - s.start_position)
                capture.append((s.request_id, start + first, start + n))
        num_decode = sum(1 for s in sched.scheduled if s.is_decode)
        if any(not s.is_decode for s in sched.scheduled[:num_decode]):
            raise RuntimeError("decodes must come first in the batch")
        if any(s.layer_tables is not None for s in sched.scheduled):
            per_layer = [self._common(sched.scheduled, num_decode, layer)
                         for layer in range(self.kv_cache.layout.num_layers)]
            # each layer addresses its own slices; the slot positions are kept at layer 0's
            # slot, as a pool slot
            pool_slots = self.num_pool_blocks * bs
            common = CommonAttentionMetadata(
                [slot % pool_slots for slot in per_layer[0].slot_mapping], num_decode, [], [], [],
                per_layer=per_layer)
        else:
            common = self._common(sched.scheduled, num_decode, layer=None)
        common.write_plan = self.kv_cache.begin_step(common.slot_mapping, positions)
        capture_rows = None
        if capture:
            capture_rows = torch.cat([torch.arange(a, b) for _, a, b in capture]).to(self.device)
        step = StepAttention(self.backend, self.backend.build(common), capture_rows)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos, step, sample_rows, capture

    def _common(self, scheduled: list[ScheduledRequest], num_decode: int,
                layer: int | None) -> CommonAttentionMetadata:
        """The step's addressing: shared by all layers (layer None), or layer `layer`'s in flat
        layer-slice ids (a request with per-layer tables uses its own; the others their shared
        table, offset to this layer)."""
        bs = self.block_size
        offset = 0 if layer is None else layer * self.num_pool_blocks
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for s in scheduled:
            start, n = len(slots), s.num_tokens
            if layer is not None and s.layer_tables is not None:
                table, first = s.layer_tables[layer], s.layer_start_slots[layer]
            else:
                table, first = s.block_table, s.start_slot
                if offset:
                    table = [b + offset for b in table]
            context = first + n
            table = table[:cdiv(context, bs)]
            slots += [table[j // bs] * bs + j % bs for j in range(first, context)]
            if s.is_decode:
                decode_tables.append(table)
                decode_lens.append(context)
            else:
                prefills.append(PrefillChunk(start, n, context, table))
        return CommonAttentionMetadata(slots, num_decode, decode_tables, decode_lens, prefills)

    @staticmethod
    def _split_captured(q_rows: list[torch.Tensor] | None,
                        capture: list[tuple[str, int, int]]) -> dict:
        """Per request, per layer its captured queries [w, Hq, D] (the model returned them
        concatenated in capture order)."""
        out, offset = {}, 0
        for request_id, first, end in capture:
            w = end - first
            out[request_id] = [q[offset:offset + w] for q in q_rows]
            offset += w
        return out
