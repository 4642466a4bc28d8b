"""The plain-data seam between the scheduler and the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nanokv.sampling_params import SamplingParams
from nanokv.spec.stats import SpecDecodeStats


PENDING_DRAFT = -1  # a draft slot a draft model has not filled yet (never an input id)


@dataclass(frozen=True)
class RowConstraints:
    """What a request's sampling row after some drafts may give (a draft model's next draft
    is chosen within it): its grammar's bitmask (int32 words, None: free) and its banned token
    ids (min_tokens, bad words)."""

    bitmask: np.ndarray | None = None
    banned: tuple[int, ...] = ()


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request_id: str
    token_ids: list[int]  # tokens whose K/V this step computes
    start_position: int  # RoPE position of token_ids[0] (the request's logical length so far)
    start_slot: int  # cache slot of token_ids[0] (differs from the position after eviction)
    block_table: list[int]  # physical block ids covering slots [0, start_slot + len(token_ids))
    sample: bool  # True when this chunk ends at the request's last token: sample the next one
    params: SamplingParams
    output_index: int  # index of the output token to sample (seeds per-token generators)
    capture_from: int | None = None  # keep post-RoPE queries of positions >= this (KV policy)
    # per-layer block tables (flat layer-slice ids, see nanokv.cache.layer_slices) and each
    # layer's first slot, when the request's layers hold different lengths; else None
    layer_tables: list[list[int]] | None = None
    layer_start_slots: list[int] | None = None
    # (prompt token ids, output token ids) when the sampling params have penalties, else None
    history: tuple[list[int], list[int]] | None = None
    # per sampling row (the request's token, then each draft's: row j as if drafts[:j] were
    # outputs), the tokens the sampler may not pick: EOS (unless ignore_eos) and stop_token_ids
    # while the request has fewer than min_tokens outputs (vLLM's min_tokens), and the last
    # token of each bad word whose other tokens end the output (vLLM's bad_words); [] for none
    banned_token_ids: list[tuple[int, ...]] = field(default_factory=list)
    # structured outputs: per sampling row, the tokens the request's grammar allows, int32
    # bitmask words [rows, ceil(vocab / 32)] (bit t % 32 of word t // 32 for token t); None
    # when unconstrained
    allowed_token_bitmask: np.ndarray | None = None
    # params.prompt_logprobs: the prompt tokens that follow the chunk's first rows (row r scores
    # token start_position + r + 1); None when the chunk scores none
    prompt_logprob_targets: list[int] | None = None
    # speculative decoding: the draft tokens ending token_ids (after the request's last token);
    # every one of their rows samples too (the row after draft j: output_index + j + 1)
    draft_token_ids: list[int] = field(default_factory=list)
    # a short prefill chunk after a cached past (a prefix-cache hit's last partial block) whose
    # rows attend as decodes do (Scheduler._as_decode_rows)
    decode_rows: bool = False
    lora_int_id: int = 0  # the request's LoRA adapter (0: the base model)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One token after a cached past, (speculative decoding) one and its drafts, or a short
        chunk's tokens (`decode_rows`): each of their rows attends as a decode of its own
        (`step_inputs`: one decode entry a row)."""
        return (self.decode_rows or len(self.token_ids) == 1 + len(self.draft_token_ids)) \
            and self.start_slot > 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # decodes first, then prefill chunks
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RunnerOutput:
    sampled_token_ids: dict[str, int]  # request id -> next token, for requests with sample=True
    # request id -> [n, vocab] logits of the chunk's prompt positions (return_prompt_logits)
    prompt_logits: dict = field(default_factory=dict)
    # request id -> per layer [w, Hq, D] queries of positions >= capture_from (KV policies)
    captured_queries: dict = field(default_factory=dict)
    # request id -> nanokv.layers.sampler.TokenLogprobs of its sampled token (params.logprobs)
    logprobs: dict = field(default_factory=dict)
    # request id -> TokenLogprobs of its chunk's prompt_logprob_targets (params.prompt_logprobs)
    prompt_logprobs: dict = field(default_factory=dict)
    # speculative decoding: request id -> the tokens sampled at its draft tokens' rows (what
    # follows draft j if drafts 0..j are accepted), and their TokenLogprobs (params.logprobs)
    draft_samples: dict = field(default_factory=dict)
    draft_logprobs: dict = field(default_factory=dict)


@dataclass
class SchedulerStats:
    """A snapshot for the metrics exporter."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float  # fraction of blocks held by requests
    num_preemptions: int  # total since start
    num_scheduled_tokens: int  # tokens of every step's batch since start
    prefix_cache_queries: int
    prefix_cache_hits: int
    evicted_blocks: dict[str, int]
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding
    # LoRA (enable_lora): max_loras, and the adapters of the running and the waiting requests
    max_loras: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
