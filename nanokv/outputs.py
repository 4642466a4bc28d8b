"""What the engine hands back to callers: plain dataclasses."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    def tpot(self, num_output_tokens: int) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_time is None or self.last_token_time is None or num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (num_output_tokens - 1)


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    # nanokv.layers.sampler.TokenLogprobs of every token in token_ids, when the params ask for
    # logprobs (vLLM's CompletionOutput.logprobs); None otherwise
    logprobs: list | None = None
    index: int = 0  # which of the request's n samples

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' log-probabilities (vLLM's), None without logprobs."""
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    metrics: RequestMetrics
    new_token_ids: list[int] | None = None  # tokens added by the last step (streaming)
    # nanokv.layers.sampler.TokenLogprobs of new_token_ids, when the params ask for logprobs
    new_logprobs: list | None = None
    prompt_logits: object | None = None  # [num_prompt_tokens, vocab] with return_prompt_logits
    # with params.prompt_logprobs, once the prompt is computed (vLLM's): one entry per prompt
    # token, None for the first, then nanokv.layers.sampler.TokenLogprobs of token i given the
    # tokens before it (shared by the request's outputs: do not modify)
    prompt_logprobs: list | None = None
    kv_blocks_at_finish: int = 0  # KV blocks the request held when it finished
    kv_slots_at_finish: int = 0  # cached token slots then (< logical tokens after eviction)
    logical_tokens_at_finish: int = 0  # tokens whose K/V were computed (cached or evicted)
    error: str | None = None  # why the engine aborted it (finish_reason "abort"), if it failed

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
