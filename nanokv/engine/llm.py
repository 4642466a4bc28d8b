"""Offline batch API: `LLM(model, **options).generate(prompts, sampling_params)`."""

from __future__ import annotations

import time
from collections.abc import Callable

from tqdm.auto import tqdm

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
                 cache_salt: str | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A single prompt (a string or one list of token ids) is accepted as a batch of one. Every
        prompt is validated before any is queued, so a bad one leaves the engine untouched.
        `use_tqdm` (as in vLLM): a progress bar over the prompts with running input and output
        tokens/s on stderr; False for none, or a callable taking tqdm's arguments that returns
        the bar to use (e.g. `functools.partial(tqdm, leave=False)`).
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
        return self.generate_requests(requests, use_tqdm=use_tqdm)

    def generate_requests(self, requests: list,
                          use_tqdm: bool | Callable[..., tqdm] = True) -> list[RequestOutput]:
        """Run prepared requests (`engine.make_request`) to completion, in order."""
        engine = self.engine
        bar = _progress_bar(use_tqdm, len(requests))  # before any request is queued: it may raise
        finals: dict[str, RequestOutput] = {}
        added: list = []
        try:
            for request in requests:
                engine.add_prepared(request)
                added.append(request)
            while engine.has_unfinished_requests():
                outs = engine.step()
                for out in outs:
                    if out.finished:
                        finals[out.request_id] = out
                if bar is not None:
                    bar.record(outs)
        except BaseException:
            for request in added:  # only this call's: nothing else of the engine's is touched
                engine.abort(request.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finals[r.request_id] for r in requests]


class _ThroughputBar:
    """A tqdm bar over finished requests whose postfix is the running input and output tokens/s:
    a request's prompt counts once its first token is out (its prefill is done)."""

    def __init__(self, bar: tqdm) -> None:
        self.bar = bar
        self.start = time.perf_counter()
        self.prefilled: set[str] = set()
        self.input_tokens = 0
        self.output_tokens = 0

    def record(self, outs: list[RequestOutput]) -> None:
        finished = 0
        for out in outs:
            if out.new_token_ids:
                self.output_tokens += len(out.new_token_ids)
                if out.request_id not in self.prefilled:
                    self.prefilled.add(out.request_id)
                    self.input_tokens += len(out.prompt_token_ids)
            finished += out.finished
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"est. speed input: {self.input_tokens / elapsed:.2f} toks/s, "
                                 f"output: {self.output_tokens / elapsed:.2f} toks/s",
                                 refresh=False)
        if finished:
            self.bar.update(finished)

    def close(self) -> None:
        self.bar.close()


def _progress_bar(use_tqdm: bool | Callable[..., tqdm], total: int) -> _ThroughputBar | None:
    if not use_tqdm:
        return None
    make = use_tqdm if callable(use_tqdm) else tqdm
    return _ThroughputBar(make(total=total, desc="Processed prompts", dynamic_ncols=True))
