"""The engine's Scheduler with a lighter hand-over to the (absent) model runner."""

from __future__ import annotations

from nanokv.request import Request
from nanokv.scheduler.scheduler import Scheduler


class ReplayScheduled:
    """The part of a ScheduledRequest the simulator and the step model read (the real one also
    copies token ids and block tables for the model runner, which no one reads here)."""

    __slots__ = ("request_id", "num_tokens", "start_slot", "sample", "is_decode")
    draft_token_ids = ()  # the simulator models no speculative decoding
    lora_int_id = 0  # nor LoRA adapters

    def __init__(self, request_id: str, num_tokens: int, start_slot: int, sample: bool,
                 decode_rows: bool = False):
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.start_slot = start_slot
        self.sample = sample
        self.is_decode = (num_tokens == 1 or decode_rows) and start_slot > 0


class SimScheduler(Scheduler):
    """The engine's Scheduler; only the step's hand-over to the runner is lighter."""

    def _scheduled(self, request: Request, num_new: int,
                   drafts: list[int] | None = None, bitmasks=None) -> ReplayScheduled:
        start = request.num_computed_tokens
        return ReplayScheduled(request.request_id, num_new, request.num_cached_slots,
                               start + num_new == request.num_tokens,
                               self._as_decode_rows(request, num_new))
