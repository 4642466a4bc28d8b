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
       its row giving draft i + 1 (vLLM's k passes a step);

then `Scheduler.fill_drafts` puts them in the step, with the rows that depend on their tokens
(a structured request's drafts cut before the first its grammar refuses, bad words' bans).

`Request.draft_kv_end` is how far the draft model wrote a request's K/V (a rejected draft's slot
is written again by both models). The one slot it may lag behind, a request's last accepted
draft, is in no prefix-cache block before its next step writes it: blocks are registered when
a step allocates, in the step that writes it (`BlockManager.allocate_slots`); a finished request
allocates no more; a preempted one keeps registered only blocks whose K/V is all written
(`Scheduler._preempt`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from nanokv.attention.common import StepAttention
from nanokv.layers.sampler import constrain_logits
from nanokv.scheduler.output import RowConstraints, ScheduledRequest, SchedulerOutput


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, runner, layer_offset: int,
                 constraints: Callable[[str, list[int]], RowConstraints | None]) -> None:
        """model: the draft model, loaded; runner: the model's `ModelRunner` (its step inputs
        and attention backend over the shared pool); layer_offset: the pool layer of the draft
        model's first layer (the model's layer count); constraints(request id, drafts so far):
        what the row after those drafts may sample, None when they cannot be kept
        (`Scheduler.draft_constraints`). Sets the draft layers' pool indexes."""
        self.model = model
        self.runner = runner
        self.constraints = constraints
        for index, attention in enumerate(model.attention_layers()):
            attention.layer_index = layer_offset + index

    @torch.inference_mode()
    def propose(self, sched: SchedulerOutput,
                requests: Mapping[str, object]) -> dict[str, list[int]]:
        """Each drafting request's drafts (request id -> at most as many tokens as it has
        draft slots: fewer where its constraints refuse the drafts so far), writing the draft
        model's K/V of the step's known tokens and of its drafts but the last. Each draft is
        the draft model's greedy token among those its row may sample (the request's grammar,
        bans, allowed_token_ids and logit_bias, as the model's row will be constrained).
        `requests`: the scheduler's, by id. The caller puts the drafts in the step
        (`Scheduler.fill_drafts`)."""
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
            request.draft_kv_end = start + s.num_tokens - k  # a drafting one's: below
        drafting = [s for s in sched.scheduled if s.draft_token_ids]
        drafted: dict[str, list[int]] = {s.request_id: [] for s in drafting}
        rows = {s.request_id: self.constraints(s.request_id, []) for s in drafting}
        step = known  # pass 1 always: the draft model's K/V follows the model's
        for i in range(max([1, *(len(s.draft_token_ids) for s in drafting)])):
            if i:  # pass i + 1: draft i at its slot, for those whose drafts so far are kept
                going = [s for s in drafting if len(s.draft_token_ids) > i]
                rows = {s.request_id: self.constraints(s.request_id, drafted[s.request_id])
                        for s in going}
                drafting = [s for s in going if rows[s.request_id] is not None]
                if not drafting:
                    break
                step = [ScheduledRequest(s.request_id, [drafted[s.request_id][-1]],
                                         s.start_position + i, s.start_slot + i, s.block_table,
                                         sample=True, params=s.params, output_index=0)
                        for s in drafting]
            for request_id, token in self._forward(step, rows).items():
                drafted[request_id].append(token)
        for request_id, d in drafted.items():  # K/V written up to its last draft
            requests[request_id].draft_kv_end = requests[request_id].num_computed_tokens + len(d)
        return drafted

    def _forward(self, scheduled: list[ScheduledRequest],
                 rows: dict[str, RowConstraints]) -> dict[str, int]:
        """One forward pass of the draft model over `scheduled` (any order): request id -> the
        greedy token of its last row within `rows[request id]`, for the requests that sample."""
        scheduled = sorted(scheduled, key=lambda s: not s.is_decode)  # decodes first
        inputs = self.runner.inputs(SchedulerOutput(scheduled))
        backend = self.runner.backend
        step = StepAttention(backend, backend.build(inputs.common))
        hidden, _ = self.model(inputs.input_ids, inputs.positions, step)  # [T, hidden]
        sampling = [s for s in scheduled if s.sample]
        if not sampling:
            return {}
        index = torch.tensor(inputs.sample_rows, device=hidden.device)
        logits = self.model.compute_logits(hidden[index])  # [N, vocab]
        _, logits = constrain_logits(logits, [s.params for s in sampling],
                                     [rows[s.request_id].banned for s in sampling],
                                     [rows[s.request_id].bitmask for s in sampling])
        return {s.request_id: token
                for s, token in zip(sampling, logits.argmax(dim=-1).tolist())}
