"""A request's tokens, status and block table. No torch here: the scheduler and the block manager
work on this alone."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanokv.outputs import RequestMetrics
from nanokv.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after losing its blocks (recompute)
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class DecodeOffsets:
    """Where a request's output text stands (`nanokv/engine/detokenizer.py`), over its prompt's
    last tokens (`context`) followed by its output tokens: tokens [prefix, read) are the context
    the next ones decode in, and their text (the prompt's part excluded) is in the text; of the
    tokens from `read` on, the first `shown` characters (those before an incomplete one)."""

    prefix: int = 0
    read: int = 0
    shown: int = 0
    # the prompt's last tokens (`prompt_context`); None until the request's first text, which
    # chooses them in the engine's thread (its tokenizer is not shared with other threads)
    context: tuple[int, ...] | None = None

    @classmethod
    def after(cls, context: tuple[int, ...]) -> DecodeOffsets:
        """Offsets for an output that continues the prompt tokens `context`."""
        return cls(prefix=0, read=len(context), context=tuple(context))


@dataclass
class PolicyBlockWait:
    """Free blocks a request's due KV-policy step found missing (a compaction's copy-on-write of
    shared blocks, a scoring pass's scratch blocks); it is tried again at the next step, and the
    scheduler keeps that many blocks free for it meanwhile, preempting newer requests if it must
    (`BlockManager.blocks_wanted`)."""

    private: range = range(0)  # block-table indexes to make private: those still shared count
    spare: int = 0  # the request's own blocks the copies may take instead (a discarded tail)
    scratch: int = 0  # blocks taken and given back (before the copies) within the step


class Request:
    """One generation request.

    Logical length vs cache length: `num_computed_tokens` counts tokens whose K/V went through the
    model (the position of the next token to compute). `num_evicted_tokens` counts those a KV
    policy dropped from the cache since. The cache therefore holds
    `num_cached_slots = num_computed_tokens - num_evicted_tokens` slots, and the next token is
    written at slot `num_cached_slots` but rotated with position `num_computed_tokens`.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, eos_token_ids: tuple[int, ...] = (),
                 cache_salt: str | None = None, arrival_time: float | None = None,
                 priority: int = 0, lora_request=None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids = tuple(eos_token_ids)
        # params.bad_words as token sequences (`nanokv/bad_words.py`), set by the engine
        self.bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
        # params.structured_outputs' matcher (`nanokv/structured/xgrammar_backend.py`
        # RequestGrammar), set by the engine; dropped when the request finishes
        self.grammar = None
        self.cache_salt = cache_salt
        self.priority = priority  # the priority scheduling policy's: lower is served first
        # the LoRA adapter it runs with (a `nanokv.lora.LoRARequest`; None: the base model)
        self.lora_request = lora_request
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # why the engine aborted it, when it failed

        self.num_computed_tokens = 0
        self.num_evicted_tokens = 0
        self.block_table: list[int] = []  # physical block ids, in logical order
        self.block_hashes: list[int] = []  # chained hashes of this request's full token blocks
        # the prefix cache's content id of each (None: not cached; `BlockManager`)
        self.block_content_ids: list[int | None] = []
        self.prefix_cacheable = True  # False once a policy changed the cached content
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling (-1: not yet)
        self.num_preemptions = 0
        self.peak_blocks = 0  # most blocks this request held at once
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())
        self.text = ""  # detokenized output, maintained by the engine
        self.decode_offsets = DecodeOffsets()  # how far the text has decoded the output
        # TokenLogprobs of each output token, when params.logprobs asks (engine-maintained)
        self.output_logprobs: list = []
        self.prompt_logits: list = []  # chunks of [n, vocab] rows when params ask for them
        # [None, TokenLogprobs of prompt token 1, ...] as far as computed (params.prompt_logprobs)
        self.prompt_logprobs: list = [None]
        # KV policy: the engine's, or a per-request override (a PolicyConfig); None = full cache
        self.kv_policy = None
        self.kv_budget: int | None = None  # the policy's token budget, fixed at compression
        # compress once this many tokens are computed (default: the whole prompt); a prefill
        # chunk never crosses it, so an evaluation can score text after a compressed context
        self.compress_after: int | None = None
        self.compressed = False
        self.policy_wait: PolicyBlockWait | None = None  # the policy's step waits for blocks
        # per-layer block tables once a policy left layers with different lengths (PyramidKV);
        # a `nanokv.cache.layer_slices.LayerSlices`, None while all layers share block_table
        self.layer_slices = None
        self.query_capture_from: int | None = None  # policies that read window attention
        # keep capturing queries after compression (a policy that re-selects with the attention
        # of the queries since its last selection: H2O)
        self.capture_decode_queries = False
        self.captured_queries: list[list] = []  # per step: per layer [w, Hq, D]
        # a block-wise policy's scores of the request's full blocks, by block id: each [L],
        # computed once (cleared when a compaction or a preemption changes the blocks' content)
        self.block_scores: dict[int, torch.Tensor] = {}
        # speculative decoding: its tokens for n-gram drafts (`nanokv.spec.NgramIndex`), made
        # when it first drafts
        self.ngram_index = None
        # draft-model speculation: the draft model's K/V of this request is written up to this
        # position (`nanokv.spec.draft_model`); None before its first step
        self.draft_kv_end: int | None = None
        # what the request held when it finished (the metrics and the eval harness read these)
        self.final_kv_blocks = 0
        self.final_kv_slots = 0

    @property
    def lora_int_id(self) -> int:
        """Its LoRA adapter's id, 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    # ---- token views -------------------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def compress_point(self) -> int | None:
        """Tokens computed before a KV policy compresses this request (`compress_after`, capped at
        the prompt, else the whole prompt); None without a policy or compress_after. A prefill
        chunk never crosses it, also when a recompute after preemption re-prefills outputs."""
        if self.compress_after is not None:
            return min(self.compress_after, self.num_prompt_tokens)
        return self.num_prompt_tokens if self.kv_policy is not None else None

    @property
    def num_cached_slots(self) -> int:
        return self.num_computed_tokens - self.num_evicted_tokens

    def token_ids_range(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
