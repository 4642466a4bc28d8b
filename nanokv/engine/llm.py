"""Offline batch API: `LLM(model, **options).generate(prompts, sampling_params)`."""

from __future__ import annotations

import logging

from nanokv.config import EngineConfig
from nanokv.engine.llm_engine import LLMEngine
from nanokv.outputs import RequestOutput
from nanokv.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **options) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **options))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A single prompt (a string or one list of token ids) is accepted as a batch of one. Every
        prompt is validated before any is queued, so a bad one leaves the engine untouched.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings or token-id lists")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts; "
                                 f"pass one, or one per prompt")
        requests = [self.engine.make_request(p, sp, cache_salt=cache_salt)
                    for p, sp in zip(prompts, params)]
        return self.generate_requests(requests)

    def generate_requests(self, requests: list) -> list[RequestOutput]:
        """Run prepared requests (`engine.make_request`) to completion, in order."""
        engine = self.engine
        for request in requests:
            engine.add_prepared(request)
        finals: dict[str, RequestOutput] = {}
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finals[out.request_id] = out
        except BaseException:
            for request in requests:
                engine.abort(request.request_id)
            raise
        return [finals[r.request_id] for r in requests]


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
