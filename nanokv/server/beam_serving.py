"""The server's beam search: vLLM's `use_beam_search` on /v1/completions and
/v1/chat/completions, with n the beam width (`nanokv.beam_search` holds the search). Each step
opens one engine request per live beam of every prompt and runs them to their end; the answer
has the n best sequences of each prompt as its choices: whole, or (chat, stream=true, as vLLM's)
streamed once the search is done (`beam_search_events`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace

from starlette.requests import Request

from nanokv.beam_search import (MAX_BEAM_WIDTH, BeamSearch, BeamSearchParams, advance_all,
                                step_beams)
from nanokv.outputs import CompletionOutput, RequestOutput
from nanokv.server.protocol import APIError, _SamplingRequest
from nanokv.server.serving import ClientGone


def beam_params(body: _SamplingRequest, max_tokens: int) -> BeamSearchParams:
    """A prompt's search settings from the request (n the beam width); APIError 400 when n
    is more than a beam search takes."""
    if body.num_choices > MAX_BEAM_WIDTH:
        raise APIError(400, f"n is the beam width with use_beam_search and must be in [1, "
                            f"{MAX_BEAM_WIDTH}], got {body.num_choices}", param="n",
                       code="invalid_value")
    return BeamSearchParams(beam_width=body.num_choices, max_tokens=max_tokens,
                            ignore_eos=body.ignore_eos, length_penalty=body.length_penalty,
                            include_stop_str_in_output=body.include_stop_str_in_output,
                            skip_special_tokens=body.skip_special_tokens)


async def run_beam_search(server, body: _SamplingRequest,
                          prompts: list[tuple[list[int], str | None, int]], request_id: str,
                          labels: tuple[str, str], raw: Request,
                          priority: int) -> list[list[RequestOutput]]:
    """Each prompt's (token ids, text, max_tokens) searched together, a step at a time; returns
    per prompt its best sequences as finished outputs, best first (their request figures, such
    as the prompt's cached tokens, are its first step's). Raises ClientGone when the client
    leaves, APIError 504 past the request timeout, 500 when a step's request fails."""
    searches = [BeamSearch(ids, beam_params(body, max_tokens), server.engine.eos_token_ids)
                for ids, _, max_tokens in prompts]
    step_params = searches[0].params.step_params()
    firsts: list[RequestOutput | None] = [None] * len(searches)
    deadline = time.monotonic() + server.settings.request_timeout
    step = 0
    while beams := step_beams(searches):
        if time.monotonic() > deadline:
            raise APIError(504, f"the beam search did not finish within the server's request "
                                f"timeout of {server.settings.request_timeout:g} s; it was "
                                f"aborted", "server_error", code="timeout")
        try:
            requests = [server.engine.make_request(b.tokens, step_params,
                                                   request_id=f"{request_id}-{i}-beam{step}.{k}",
                                                   cache_salt=body.cache_salt, priority=priority,
                                                   lora_request=server.loras.get(body.model))
                        for k, (i, b) in enumerate(beams)]
        except ValueError as e:
            raise APIError(400, str(e), param="cache_salt" if "cache_salt" in str(e) else None,
                           code="invalid_value") from e
        finals, _ = await server.run_to_end(server.open_streams(requests, labels), raw)
        for (i, _), out in zip(beams, finals):
            if out.error or not out.outputs[0].logprobs:
                raise APIError(500, f"a beam search step failed: {out.error or 'no output'}",
                               "server_error", code="engine_error")
            firsts[i] = firsts[i] or out
        advance_all(searches, beams, [out.outputs[0].logprobs[0] for out in finals])
        step += 1
    answers = []
    for search, (ids, text, _), first in zip(searches, prompts, firsts):
        outs = []
        for j, beam in enumerate(search.best()):
            generated = beam.tokens[search.prompt_len:]
            shown = generated[:-1] if beam.finish_reason == "stop" else generated
            token_ids = generated if search.params.include_stop_str_in_output else shown
            answer = "" if server.tokenizer is None else await server.decode(
                shown, search.params.skip_special_tokens)
            outs.append(RequestOutput(
                request_id=request_id, prompt=text, prompt_token_ids=list(ids),
                outputs=[CompletionOutput(answer, token_ids, beam.finish_reason,
                                          beam.stop_reason, index=j)],
                finished=True, num_cached_tokens=first.num_cached_tokens,
                metrics=first.metrics))
        answers.append(outs)
    return answers


async def beam_search_events(server, body: _SamplingRequest,
                             prompts: list[tuple[list[int], str | None, int]], request_id: str,
                             labels: tuple[str, str], raw: Request, priority: int
                             ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`run_beam_search`'s choices as a stream's events (index, output), each whole with all
    its tokens new; none when the client left."""
    try:
        answers = await run_beam_search(server, body, prompts, request_id, labels, raw,
                                        priority)
    except ClientGone:
        return
    for i, out in enumerate(o for outs in answers for o in outs):
        yield i, replace(out, new_token_ids=list(out.token_ids))
