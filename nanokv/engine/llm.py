"""Offline batch API: `LLM(model, **options).generate(prompts, sampling_params)`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from tqdm.auto import tqdm

from nanokv.beam_search import (BeamSearch, BeamSearchOutput, BeamSearchParams, advance_all,
                                step_beams)
from nanokv.config import EngineConfig
from nanokv.engine.chat import ChatRenderer, chat_messages
from nanokv.engine.llm_engine import LLMEngine
from nanokv.lora.request import LoRARequest
from nanokv.outputs import RequestOutput
from nanokv.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **options) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **options))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The engine's tokenizer (vLLM's name); None with skip_tokenizer_init."""
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | dict | list[str | list[int] | dict],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 cache_salt: str | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = True,
                 priority: int | list[int] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt is text, token ids, or vLLM's prompt dicts ({"prompt": text} or
        {"prompt_token_ids": ids}, each with an optional "cache_salt": `nanokv.engine.prompts`).
        A single prompt is accepted as a batch of one. Every prompt is validated before any is
        queued, so a bad one leaves the engine untouched.
        Params with n > 1 run n requests of the prompt (sample j seeded with seed + j when a
        seed is given; admitted in one step, samples 1.. take the full blocks sample 0 computes
        in it from the prefix cache, as in vLLM) and return one output whose `outputs` are the
        n samples, as vLLM's.
        `use_tqdm` (as in vLLM): a progress bar over the requests (n per prompt) with running
        input and output tokens/s on stderr (each sample's prompt counts as input); False for
        none, or a callable taking tqdm's arguments that returns the bar to use (e.g.
        `functools.partial(tqdm, leave=False)`).
        `priority` (as in vLLM): one for all prompts or one per prompt, lower served first
        under scheduling_policy "priority" (ignored under "fcfs"); default 0.
        `lora_request` (as in vLLM; an engine with enable_lora): one LoRARequest for all
        prompts or one per prompt (None: the base model), each adapter read and checked before
        any request is queued.
        """
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts; "
                                 f"pass one, or one per prompt")
        else:
            params = [sampling_params]  # refused below
        priorities = (list(priority) if isinstance(priority, (list, tuple))
                      else [0 if priority is None else priority] * len(prompts))
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts; "
                             f"pass one, or one per prompt")
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts; "
                             f"pass one, or one per prompt")
        for sp in params:
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params must be a SamplingParams or a list of them "
                                 f"(one per prompt), got {type(sp).__name__}")
            sp.validate()  # n (fanned out here) and the rest may have changed since it was built
        requests, groups = [], []  # groups: (request id, its samples' indexes in requests)
        for p, sp, rank, lora in zip(prompts, params, priorities, loras):
            if sp.n == 1:
                request = self.engine.make_request(p, sp, cache_salt=cache_salt, priority=rank,
                                                   lora_request=lora)
                groups.append((request.request_id, [len(requests)]))
                requests.append(request)
                continue
            rid = self.engine.new_request_id()
            groups.append((rid, list(range(len(requests), len(requests) + sp.n))))
            requests += [self.engine.make_request(p, sp.sample(j), f"{rid}-{j}",
                                                  cache_salt=cache_salt, priority=rank,
                                                  lora_request=lora)
                         for j in range(sp.n)]
        outputs = self.generate_requests(requests, use_tqdm=use_tqdm)
        return [outputs[rows[0]] if len(rows) == 1 else _merge(rid, [outputs[i] for i in rows])
                for rid, rows in groups]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., tqdm] = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: each conversation (a list of {"role", "content"} messages; one
        conversation or a list of them) rendered with the chat template (the tokenizer's, else
        `nanokv.engine.chat`'s fallback; `chat_template` overrides it), tokenized without added
        special tokens (the template holds them), then generated as `generate` does. Message
        content is text or a list of {"type": "text", "text"} parts. `continue_final_message`
        renders the last message open, for the model to continue (not with
        add_generation_prompt). Every conversation is rendered before any request is queued.
        `lora_request`: as in `generate`."""
        if self.engine.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this engine was started with "
                             "skip_tokenizer_init=True")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be "
                             "True: set add_generation_prompt=False to continue the last message")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a conversation (a non-empty list of message "
                             "dicts) or a non-empty list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        renderer = ChatRenderer(self.engine.tokenizer, chat_template)
        prompts = []
        for i, conversation in enumerate(conversations):
            text = renderer.render(chat_messages(conversation, i), add_generation_prompt,
                                   chat_template_kwargs, continue_final_message)
            ids = list(self.engine.tokenizer.encode(text, add_special_tokens=False))
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def beam_search(self, prompts: str | list[int] | dict | list[str | list[int] | dict],
                    params: BeamSearchParams, use_tqdm: bool = False,
                    concurrency_limit: int | None = None,
                    cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search` (`nanokv.beam_search`): per prompt, the beam_width best
        sequences, best first, each with the prompt's tokens then its own (an ending EOS kept)
        and `text` their decoding (the prompt's text included, as vLLM's offline search
        returns it), `cum_logprob`, `finish_reason` ("stop" at an EOS of the model's, unless
        ignore_eos, else "length"). Each step runs one request per live beam of up to
        `concurrency_limit` prompts at once (None: all), which reads the blocks of its earlier
        steps from the prefix cache (with enable_prefix_caching=False each step recomputes
        whole beams). `use_tqdm`: a bar over the steps. `lora_request`: every beam runs under
        that LoRA adapter. Every prompt is validated first."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        params.validate()
        if concurrency_limit is not None and (isinstance(concurrency_limit, bool) or not
                                              isinstance(concurrency_limit, int)
                                              or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be a positive integer or None, got "
                             f"{concurrency_limit!r}")
        prompts = _prompt_list(prompts)
        engine, step = self.engine, params.step_params()
        limit = engine.config.max_model_len
        searches, salts = [], {}
        for p in prompts:  # each prompt parsed, tokenized and checked as a request would be
            first = engine.make_request(p, step, cache_salt=cache_salt, lora_request=lora_request)
            ids = first.prompt_token_ids
            if len(ids) + params.max_tokens > limit:
                raise ValueError(f"a prompt of {len(ids)} tokens and max_tokens "
                                 f"{params.max_tokens} exceed max_model_len {limit}")
            searches.append(BeamSearch(ids, params, engine.eos_token_ids))
            salts[searches[-1]] = first.cache_salt  # a prompt dict's own, else the call's
        batch = concurrency_limit or len(searches)
        for first in range(0, len(searches), batch):
            group = searches[first:first + batch]
            steps = range(params.max_tokens)
            for _ in (tqdm(steps, desc="Beam search", unit="token") if use_tqdm else steps):
                beams = step_beams(group)
                if not beams:
                    break
                requests = [engine.make_request(b.tokens, step, cache_salt=salts[group[i]],
                                                lora_request=lora_request)
                            for i, b in beams]
                outs = self.generate_requests(requests, use_tqdm=False)
                for o in outs:
                    if o.error or not o.outputs[0].logprobs:
                        raise RuntimeError(f"beam search step failed: "
                                           f"{o.error or o.finish_reason}")
                advance_all(group, beams, [o.outputs[0].logprobs[0] for o in outs])
        results = []
        for search in searches:
            best = search.best()
            for beam in best:
                beam.text = self._decode(beam.tokens, params.skip_special_tokens)
            results.append(BeamSearchOutput(best))
        return results

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        tokenizer = self.engine.tokenizer
        return "" if tokenizer is None else tokenizer.decode(
            token_ids, skip_special_tokens=skip_special_tokens)

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


def _prompt_list(prompts) -> list:
    """A batch of prompts: a single prompt (text, token ids, a prompt dict) as a batch of one;
    ValueError for anything else or an empty batch."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                            and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a prompt (text, token ids or a prompt dict) or a "
                         "non-empty list of them")
    return prompts


def _merge(request_id: str, samples: list[RequestOutput]) -> RequestOutput:
    """One RequestOutput of a prompt's n samples (as vLLM's): outputs[j] is sample j; the
    request's own figures (cached prompt tokens, metrics, KV held at the end) are sample 0's,
    which computed the prompt (the others shared its full blocks); an error is any sample's."""
    return replace(
        samples[0], request_id=request_id,
        outputs=[replace(s.outputs[0], index=j) for j, s in enumerate(samples)],
        new_token_ids=None, new_logprobs=None,
        error="; ".join(s.error for s in samples if s.error) or None)


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
