"""Draft-model speculative decoding (vLLM's `{"model": path, "num_speculative_tokens": k}`): a
smaller checkpoint of the same vocabulary proposes each decoding request's k drafts, greedily,
and the model verifies them in one forward pass as it verifies n-gram drafts (so the outputs
are the ones decoding alone gives, whatever the draft model says: it only decides how many are
accepted).

The draft model's layers live in the model's KV pool, after the model's layers (the pool is
planned and allocated for both): one block table and one slot mapping serve both, the prefix
cache and preemption included. Each step, after the scheduler has allocated the slots of every
request's token and k drafts (`PENDING_DRAFT` placeholders) and before the model's forward
pass, the proposer runs the draft model

    1. over every token the step computes but the drafts (prefill chunks, decode tokens),
       after the tokens the model computed without it: a request's last draft when all were
       accepted (the draft model gave it, never took it in); the drafting requests' last rows
       give their first drafts;
    2. k - 1 single-token passes over the drafting requests, pass i over draft i at its slot,
       its row giving draft i + 1 (vLLM's k passes a step).

`Request.draft_kv_end` is how far the draft model wrote a request's K/V (a rejected draft's slot
is written again by both models). The one slot it may lag behind, a request's last accepted
draft, is in no prefix-cache block before its next step writes it: blocks are registered when
a step allocates, in the step that writes it (`BlockManager.allocate_slots`); a finished request
allocates no more; a preempted one unregisters the block (`Scheduler._preempt`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from nanokv.attention.common import StepAttention
from nanokv.scheduler.output import ScheduledRequest, SchedulerOutput

PENDING_DRAFT = -1  # a draft slot the draft model has not filled yet (never an input id)


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, runner, layer_offset: int) -> None:
        """model: the draft model, loaded; runner: the model's `ModelRunner` (its step inputs
        and attention backend over the shared pool); layer_offset: the pool layer of the draft
        model's first layer (the model's layer count). Sets the draft layers' pool indexes."""
        self.model = model
        self.runner = runner
        for index, attention in enumerate(model.attention_layers()):
            attention.layer_index = layer_offset + index

    @torch.inference_mode()
    def propose(self, sched: SchedulerOutput, requests: Mapping[str, object]) -> None:
        """Fill the step's drafts in place (each drafting request's `token_ids` tail and
        `draft_token_ids`), writing the draft model's K/V of the step's known tokens and its
        drafts but the last. `requests`: the scheduler's, by id."""
        known = []  # pass 1: the step's tokens but the drafts, after what the draft model lacks
        for s in sched.scheduled:
            request = requests[s.request_id]
            k = len(s.draft_token_ids)
            start, end = s.start_position, request.draft_kv_end
            begin = start if end is None else min(start, end)
            tokens = request.token_ids_range(begin, start) + s.token_ids[:s.num_tokens - k]
            # a lagging slot and the step's token (a decode) attend as decode rows
            known.append(ScheduledRequest(s.request_id, tokens, begin,
                                          s.start_slot - (start - begin), s.block_table,
                                          sample=k > 0, params=s.params, output_index=0,
                                          decode_rows=begin < start))
            # a drafting request's drafts but the last are written below
            request.draft_kv_end = start + s.num_tokens - (1 if k else 0)
        drafting = [s for s in sched.scheduled if s.draft_token_ids]
        proposed = self._forward(known)
        drafted = {s.request_id: [proposed[s.request_id]] for s in drafting}
        for i in range(1, max((len(s.draft_token_ids) for s in drafting), default=0)):
            step = [ScheduledRequest(s.request_id, [drafted[s.request_id][i - 1]],
                                     s.start_position + i, s.start_slot + i, s.block_table,
                                     sample=True, params=s.params, output_index=0)
                    for s in drafting if len(s.draft_token_ids) > i]
            for request_id, token in self._forward(step).items():
                drafted[request_id].append(token)
        for s in drafting:
            s.draft_token_ids = drafted[s.request_id]
            s.token_ids[-len(s.draft_token_ids):] = s.draft_token_ids

    def _forward(self, scheduled: list[ScheduledRequest]) -> dict[str, int]:
        """One forward pass of the draft model over `scheduled` (any order): request id -> the
        greedy token of its last row, for the requests that sample."""
        scheduled = sorted(scheduled, key=lambda s: not s.is_decode)  # decodes first
        inputs = self.runner.inputs(SchedulerOutput(scheduled))
        backend = self.runner.backend
        step = StepAttention(backend, backend.build(inputs.common))
        hidden, _ = self.model(inputs.input_ids, inputs.positions, step)  # [T, hidden]
        sampling = [s.request_id for s in scheduled if s.sample]
        if not sampling:
            return {}
        rows = torch.tensor(inputs.sample_rows, device=hidden.device)
        logits = self.model.compute_logits(hidden[rows])  # [N, vocab]
        return dict(zip(sampling, logits.argmax(dim=-1).tolist()))
