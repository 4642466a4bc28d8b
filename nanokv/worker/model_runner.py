"""Turns a SchedulerOutput into one forward pass and sampled tokens.

Prepares the flattened batch (input ids, positions) and the step's common attention description
(slot mapping, block tables, context lengths) with array operations, uploaded once
(`step_inputs.py`), which the engine's attention backend shapes into its own metadata; runs the
model (a decode-only step through a CUDA graph where `cuda_graph.py` applies); computes logits
only for rows that sample; samples on the device (one transfer back). The queries KV policies
asked for come back from the model and are returned per request.

Under tensor parallelism every rank runs `execute` on the same SchedulerOutput (its share of the
heads); logits and captured queries are gathered on rank 0, which alone samples.
"""

from __future__ import annotations

import torch

from nanokv.attention.common import StepAttention
from nanokv.layers.batch_sampling import logprob_parts
from nanokv.layers.sampler import Sampler, unpack_token_logprobs
from nanokv.sampling_params import SamplingParams
from nanokv.scheduler.output import RunnerOutput, ScheduledRequest, SchedulerOutput
from nanokv.utils import cdiv
from nanokv.worker.cuda_graph import DecodeGraphs
from nanokv.worker.step_inputs import StepInputs, build_step_inputs

_SCORING_PARAMS = SamplingParams(temperature=0, max_tokens=1)
PROMPT_LOGPROB_ROWS = 512  # prompt positions scored at once: bounds the [rows, vocab] scratch


def _history(s: ScheduledRequest, j: int) -> tuple[list[int], list[int]] | None:
    """The penalties' (prompt, output) tokens of a request's j-th sampling row: its outputs,
    then its first j draft tokens (speculative: the outputs that row's token would follow)."""
    if s.history is None or j == 0:
        return s.history
    prompt, outputs = s.history
    return prompt, [*outputs, *s.draft_token_ids[:j]]


def _banned(s: ScheduledRequest, j: int) -> tuple[int, ...]:
    """The tokens a request's j-th sampling row may not give."""
    return s.banned_token_ids[j] if s.banned_token_ids else ()


def _bitmask(s: ScheduledRequest, j: int):
    """The int32 bitmask words of the tokens a request's j-th sampling row may give (its
    grammar's), None when free."""
    return None if s.allowed_token_bitmask is None else s.allowed_token_bitmask[j]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache, attention_backend, device: torch.device,
                 seed: int, tp=None, enforce_eager: bool = True, max_num_seqs: int = 1,
                 max_model_len: int = 1) -> None:
        """kv_cache: the engine's `KVCache`; attention_backend: the `AttentionBackend` chosen at
        start-up (it reads and writes `kv_cache`); tp: this rank's
        `nanokv.distributed.parallel_state.TensorParallel` (None without tensor parallelism);
        enforce_eager False: decode steps through CUDA graphs where they apply (CUDA, a backend
        that supports them, no tensor parallelism), captured here for up to max_num_seqs
        requests of up to max_model_len tokens."""
        self.tp = tp
        self.model = model
        self.kv_cache = kv_cache
        self.backend = attention_backend
        self.device = device
        self.block_size = kv_cache.layout.block_size
        self.num_pool_blocks = kv_cache.num_blocks
        self.sampler = Sampler(seed)
        self.lora = None  # the engine's `LoRAManager` when LoRA is enabled (enable_lora)
        self.graphs: DecodeGraphs | None = None
        if (not enforce_eager and device.type == "cuda" and tp is None
                and attention_backend.supports_cuda_graphs
                and getattr(model, "cuda_graphs", True)):  # mixtures of experts: eager
            self.graphs = DecodeGraphs(model, attention_backend, device, max_num_seqs,
                                       cdiv(max_model_len, self.block_size))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        inputs = self.inputs(sched)
        lora_rows = self.lora is not None and self.lora.step.slices  # graphs hold no adapter
        if self.graphs is not None and not lora_rows and self.graphs.can_run(inputs):
            hidden, q_rows, capture = self.graphs.run(inputs), None, []  # [n, hidden]
        else:
            step = StepAttention(self.backend, self.backend.build(inputs.common),
                                 inputs.capture_rows)
            hidden, q_rows = self.model(inputs.input_ids, inputs.positions, step)  # [T, hidden]
            capture = inputs.capture
        sample_rows = inputs.sample_rows
        if self.tp is not None and q_rows is not None:  # every rank's heads, on rank 0
            q_rows = [self.tp.gather(q, dim=1) for q in q_rows]  # each [Tc, Hq, D]
            if not self.tp.is_first:
                q_rows, capture = None, []
        prompt_logits = self._prompt_logits(sched, hidden)
        prompt_logprobs = self._prompt_logprobs(sched, hidden)
        captured = self._split_captured(q_rows, capture)
        if not sample_rows:
            return RunnerOutput({}, prompt_logits, captured, prompt_logprobs=prompt_logprobs)
        if len(sample_rows) == hidden.shape[0]:  # every row samples (a decode step)
            logits = self.model.compute_logits(hidden)  # [N, vocab]
        else:
            rows = torch.tensor(sample_rows).to(self.device, non_blocking=True)
            logits = self.model.compute_logits(hidden[rows])  # [N, vocab]
        if logits is None:  # a tensor-parallel rank other than 0: rank 0 samples
            return RunnerOutput({}, prompt_logits, captured, prompt_logprobs=prompt_logprobs)
        sampled = [s for s in sched.scheduled if s.sample]
        rows = [(s, j) for s in sampled for j in range(1 + len(s.draft_token_ids))]
        out = self.sampler.sample(logits, [s.params for s, _ in rows],
                                  [s.output_index + j for s, j in rows],
                                  [_history(s, j) for s, j in rows],
                                  [_banned(s, j) for s, j in rows],
                                  [_bitmask(s, j) for s, j in rows])
        result = RunnerOutput({}, prompt_logits, captured, prompt_logprobs=prompt_logprobs)
        for (s, j), token, lp in zip(rows, out.token_ids, out.logprobs):
            if j == 0:
                result.sampled_token_ids[s.request_id] = token
                if lp is not None:
                    result.logprobs[s.request_id] = lp
                continue
            result.draft_samples.setdefault(s.request_id, []).append(token)
            if lp is not None:
                result.draft_logprobs.setdefault(s.request_id, []).append(lp)
        return result

    @torch.inference_mode()
    def score_forward(self, token_ids: list[int], start_position: int, start_slot: int,
                      block_table: list[int], lora_int_id: int = 0
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A KV policy's extra forward pass (KVzip's reconstruction): `token_ids` as one prefill
        chunk at positions start_position.. and slots start_slot.. of `block_table`, attending to
        slots [0, start_slot) of it. The caller gives a table whose blocks from slot start_slot on
        are scratch blocks (the request's own are only read); lora_int_id: the request's LoRA
        adapter, the pass runs under it. Returns per layer the chunk's
        post-RoPE queries [T, Hq, D] and its keys as written [T, Hkv, D]. Float pool only."""
        n = len(token_ids)
        for rotary in self.model.rotaries():
            if start_position + n > rotary.max_positions:  # the pass may run past max_model_len
                rotary.max_positions = start_position + n
                rotary.build_tables(self.device)
        s = ScheduledRequest("#scoring", list(token_ids), start_position, start_slot, block_table,
                             sample=False, params=_SCORING_PARAMS, output_index=0,
                             capture_from=start_position, lora_int_id=lora_int_id)
        inputs = self.inputs(SchedulerOutput([s]))
        step = StepAttention(self.backend, self.backend.build(inputs.common),
                             inputs.capture_rows)
        _, q_rows = self.model(inputs.input_ids, inputs.positions, step)  # per layer [T, Hq, D]
        slots = inputs.slots
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

    def _prompt_logprobs(self, sched: SchedulerOutput, hidden: torch.Tensor) -> dict:
        """Per request whose chunk scores prompt tokens (`prompt_logprob_targets`), their
        TokenLogprobs: the raw distribution of each row (PROMPT_LOGPROB_ROWS at a time), the
        next prompt token's log-probability and rank and the top `prompt_logprobs`, computed
        on the device and brought back in one transfer. Every tensor-parallel rank computes the
        logits (a gather to rank 0); the others return {}."""
        parts, wanted, start = [], [], 0
        for s in sched.scheduled:
            if s.prompt_logprob_targets:
                k = s.params.prompt_logprobs
                for first in range(0, len(s.prompt_logprob_targets), PROMPT_LOGPROB_ROWS):
                    targets = s.prompt_logprob_targets[first:first + PROMPT_LOGPROB_ROWS]
                    rows = hidden[start + first:start + first + len(targets)]
                    logits = self.model.compute_logits(rows)  # [m, vocab]
                    if logits is None:  # a tensor-parallel rank other than 0
                        continue
                    ids = torch.tensor(targets).to(self.device, non_blocking=True)
                    parts += logprob_parts(logits, ids, list(range(len(targets))), k)
                    wanted.append((s.request_id, targets, k))
            start += s.num_tokens
        if not parts:
            return {}
        host = torch.cat(parts).cpu()  # [sum over chunks of m * (2 + 2k)]
        out, at = {}, 0
        for request_id, targets, k in wanted:
            size = len(targets) * (2 + 2 * k)
            out.setdefault(request_id, []).extend(
                unpack_token_logprobs(host[at:at + size], targets, k))
            at += size
        return out

    def inputs(self, sched: SchedulerOutput) -> StepInputs:
        """The step's inputs on the device, the KV cache's step begun (`common.write_plan`)."""
        inputs = build_step_inputs(sched.scheduled, self.block_size, self.num_pool_blocks,
                                   self.kv_cache.layout.num_layers, self.device)
        if self.lora is not None:  # the step's adapters in slots, its rows by slot
            self.lora.set_step(sched.scheduled)
        if self.kv_cache.begin_step_on_device:
            plan = self.kv_cache.begin_step(inputs.slots, inputs.positions)
        else:  # host bookkeeping: lists, not device tensors read back
            plan = self.kv_cache.begin_step(inputs.common.slot_mapping,
                                            inputs.positions_host.tolist())
        inputs.common.write_plan = plan
        return inputs

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
