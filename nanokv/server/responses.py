"""OpenAI response shapes: usage, logprobs in the completions and the chat formats, and the
server-sent events of streamed completions (one generator for both endpoints and any number
of choices)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from nanokv.engine.detokenizer import TokenTexts
from nanokv.layers.sampler import TokenLogprobs
from nanokv.outputs import RequestOutput
from nanokv.server.protocol import APIError
from nanokv.server.reasoning import ReasoningStream, ReasoningTokens
from nanokv.server.tool_stream import ToolCallStream

LOGPROB_FLOOR = -9999.0  # JSON has no -inf (vLLM's floor)


def usage(finals: list[RequestOutput | None], n: int = 1,
          completion_tokens: int | None = None, reasoning_tokens: int | None = None) -> dict:
    """The prompt (and its cached tokens) counts once per prompt, not once per choice.
    `reasoning_tokens` (chat under a reasoning parser): the completion's details."""
    per_prompt = [o for o in finals[::n] if o is not None]
    prompt = sum(len(o.prompt_token_ids) for o in per_prompt)
    if completion_tokens is None:
        completion_tokens = sum(len(o.token_ids) for o in finals if o is not None)
    out = {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
           "total_tokens": prompt + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens
                                                          for o in per_prompt)}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def _lp(x: float) -> float:
    return max(x, LOGPROB_FLOOR)


def _token_texts(lps: list[TokenLogprobs], texts: TokenTexts, final: bool):
    """Each entry's (token text, its alternatives' texts), in order; `final`: the last entry is
    the output's last token."""
    for k, lp in enumerate(lps):
        yield texts.next(lp.token_id, [t for t, _ in lp.top], final and k == len(lps) - 1)


def completion_logprobs(lps: list[TokenLogprobs], texts: TokenTexts, offset: int = 0,
                        final: bool = True, unscored: int | None = None) -> dict:
    """/v1/completions: tokens, token_logprobs, top_logprobs ({token: logprob}, the sampled
    token included) and text_offset (each token's offset in the whole completion: a streamed
    chunk passes the length of the tokens' text sent before it as `offset`). `texts`: the
    choice's `TokenTexts` (a token's text is what it adds to the completion's text, so the
    offsets index it); `final`: the entries end the output. `unscored`: an echoed prompt's
    first token, which comes first with null log-probabilities (OpenAI's, vLLM's)."""
    tokens, values, tops, offsets, at = [], [], [], [], offset
    if unscored is not None:
        text, _ = texts.next(unscored, (), final and not lps)
        tokens.append(text)
        values.append(None)
        tops.append(None)
        offsets.append(at)
        at += len(text)
    for lp, (text, alternatives) in zip(lps, _token_texts(lps, texts, final)):
        tokens.append(text)
        values.append(_lp(lp.logprob))
        top: dict[str, float] = {}
        for (_, v), alternative in zip(lp.top, alternatives):  # best first: tokens that read
            top.setdefault(alternative, _lp(v))  # alike keep the likelier value
        top.setdefault(text, _lp(lp.logprob))
        tops.append(top)
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def echo_logprobs(prompt_logprobs: list, output_logprobs: list[TokenLogprobs], k: int,
                  texts: TokenTexts, prompt_token_ids: list[int], final: bool = True) -> dict:
    """/v1/completions with echo: the prompt's tokens (its first with null values), then the
    output's; `k`: the request's logprobs (a prompt entry may hold more alternatives)."""
    prompt = [replace(lp, top=lp.top[:k]) for lp in prompt_logprobs[1:]]
    return completion_logprobs(prompt + output_logprobs, texts, final=final,
                               unscored=prompt_token_ids[0])


def prompt_logprobs_json(prompt_logprobs: list | None, tokenizer) -> list | None:
    """vLLM's `prompt_logprobs` field: per prompt token null (the first) or
    {token id: {logprob, rank, decoded_token}}, the prompt token first with its rank, then the
    top alternatives ranked 1.. (a prompt token among them keeps one entry)."""
    if prompt_logprobs is None:
        return None

    def decoded(t: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([t])

    out: list[dict | None] = [None]
    for lp in prompt_logprobs[1:]:
        ranked = [(lp.token_id, lp.logprob, lp.rank)] + [
            (t, v, r) for r, (t, v) in enumerate(lp.top, start=1)]
        out.append({str(t): {"logprob": _lp(v), "rank": r, "decoded_token": decoded(t)}
                    for t, v, r in ranked})
    return out


def chat_logprobs(lps: list[TokenLogprobs], texts: TokenTexts, final: bool = True) -> dict:
    """/v1/chat/completions: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(text: str, value: float) -> dict:
        return {"token": text, "logprob": _lp(value), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(text, lp.logprob),
                         "top_logprobs": [entry(a, v) for (_, v), a in zip(lp.top, others)]}
                        for lp, (text, others) in zip(lps, _token_texts(lps, texts, final))],
            "refusal": None}


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class TextDelta:
    """The part of a request's cumulative text not yet sent, holding back what may still
    change: the tail a stop string could start in (unless the stop string stays in the output:
    the text is then only cut after it, in the step that completes it, as in vLLM), and an
    incomplete UTF-8 character."""

    def __init__(self, stop: list[str], include_stop: bool = False) -> None:
        self.holdback = 0 if include_stop else max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def next(self, text: str, finished: bool) -> str:
        end = len(text)
        if not finished:
            end -= self.holdback
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent:end], end
        return piece


class AnswerSplit:
    """One streamed chat answer's text split as it comes: its reasoning (a reasoning parser's
    stream, or None), then its content's tool calls (a `ToolCallStream`, or None)."""

    def __init__(self, reasoning: ReasoningStream | None, calls: ToolCallStream | None) -> None:
        self.reasoning, self.calls = reasoning, calls

    def feed(self, piece: str, finished: bool) -> tuple[str, str, list[dict]]:
        """The next text piece (`finished`: the answer's last) -> its (reasoning, content,
        tool_calls entries) now known."""
        thought, content = ("", piece) if self.reasoning is None else self.reasoning.feed(piece)
        if finished and self.reasoning is not None:
            more_thought, more_content = self.reasoning.finish()
            thought, content = thought + more_thought, content + more_content
        entries: list[dict] = []
        if self.calls is not None:
            content, entries = self.calls.feed(content)
            if finished:
                more_content, more_entries = self.calls.finish()
                content, entries = content + more_content, entries + more_entries
        return thought, content, entries

    def finish_reason(self, engine_reason: str) -> str:
        return engine_reason if self.calls is None else self.calls.finish_reason(engine_reason)


def count_reasoning(outputs: list[RequestOutput | None],
                    token_texts: Callable[[list[int]], TokenTexts], thinking: bool) -> int:
    """The finished answers' reasoning tokens, all together (`ReasoningTokenCount`)."""
    return sum(ReasoningTokenCount(token_texts(o.prompt_token_ids), thinking).add(
        o.token_ids, True) for o in outputs if o is not None)


class ReasoningTokenCount:
    """One answer's reasoning tokens as its token ids come: their texts (`TokenTexts`, as the
    answer's text reads them) counted by `ReasoningTokens`."""

    def __init__(self, texts: TokenTexts, thinking: bool) -> None:
        self.texts, self.counter = texts, ReasoningTokens(thinking)

    @property
    def count(self) -> int:
        return self.counter.count

    def add(self, token_ids: list[int], final: bool) -> int:
        """Count these next tokens (`final`: the answer's last among them); the count so far."""
        for j, token in enumerate(token_ids):
            if self.counter.done:
                break
            self.counter.add(self.texts.next(token, final=final and j == len(token_ids) - 1)[0])
        return self.counter.count


@dataclass
class ChatParts:
    """What a chat answer's stream splits out of its text (`stream_events`), each choice with
    its own: `reasoning` makes a reasoning split (deltas carry `reasoning` until the end
    marker, `content` after, as vLLM's); `tool_calls` makes a tool call extraction from the
    content (deltas carry each call as `tool_calls` once complete, the finish_reason is the
    tool choice's: `tool_stream`); `reasoning_tokens(prompt_token_ids)` makes a count of a
    choice's reasoning tokens for the usage's completion_tokens_details; `include_reasoning`
    false drops the reasoning and, as vLLM, the logprobs and token ids that would show it;
    `echo` (vLLM's chat echo, `ChatCompletionRequest.echo_text`) goes out after the role,
    `role` (the answer's) in the first chunk."""

    reasoning: Callable[[], ReasoningStream] | None = None
    tool_calls: Callable[[], ToolCallStream] | None = None
    reasoning_tokens: Callable[[list[int]], ReasoningTokenCount] | None = None
    include_reasoning: bool = True
    echo: str = ""  # vLLM's chat echo: each choice's content starts with it (its own chunk)
    role: str = "assistant"  # the answer's role (`ChatCompletionRequest.answer_role`)


async def stream_events(events: AsyncIterator[tuple[int, RequestOutput]], num_choices: int,
                        head: dict, body, chat: bool,
                        token_texts: Callable[[list[int]], TokenTexts],
                        prompt_token_ids: list[int] | None = None,
                        parts: ChatParts | None = None) -> AsyncIterator[str]:
    """The SSE body of a streamed completion: text pieces per choice (with their token ids and
    logprobs when asked), the finish reason, the usage last (or in every chunk with
    continuous_usage_stats), then [DONE]. An error ends the stream with OpenAI's error body and
    [DONE]. With return_token_ids the prompt's ids come once, as in vLLM: a chat stream's first
    chunk carries `prompt_token_ids` (the chat's prompt, given), a completion's choice its
    prompt's in its first chunk. A completion with echo starts each choice's first chunk with
    the prompt's text (and its log-probabilities, asked for), as vLLM's; with max_tokens 0
    nothing of the output follows. `parts` (chat): the reasoning and tool calls split out of
    each choice's text (`ChatParts`)."""
    stop = body.stop_list()
    deltas = [TextDelta(stop, body.include_stop_str_in_output) for _ in range(num_choices)]
    # each choice's tokens' texts, made at its first output (which carries its prompt)
    texts: list[TokenTexts | None] = [None] * num_choices
    pending_ids: list[list[int]] = [[] for _ in range(num_choices)]
    pending_lps: list[list[TokenLogprobs]] = [[] for _ in range(num_choices)]
    text_offsets = [0] * num_choices  # tokens' text sent with logprobs so far (text_offset)
    finals: list[RequestOutput | None] = [None] * num_choices
    sent = [False] * num_choices  # a chunk of the choice went out
    n = body.num_choices
    generated = 0
    parts = parts or ChatParts()
    # a hidden reasoning (vLLM's rule): no logprobs nor token ids, which would show it
    hidden = not parts.include_reasoning and parts.reasoning is not None
    want_logprobs = body.num_logprobs is not None and not hidden
    echo = not chat and bool(body.echo)
    echo_only = echo and body.echo_only
    counts: list[ReasoningTokenCount | None] = [None] * num_choices  # made at a first output

    def reasoning_total() -> int | None:
        return sum(c.count for c in counts if c) if parts.reasoning_tokens else None

    def running_usage() -> dict | None:
        if not (body.include_usage and body.continuous_usage):
            return None
        return usage(latest, n, generated, reasoning_total())

    latest: list[RequestOutput | None] = [None] * num_choices  # each choice's last output
    splits = [AnswerSplit(parts.reasoning() if parts.reasoning else None,
                          parts.tool_calls() if parts.tool_calls else None)
              for _ in range(num_choices)]

    def chat_delta(i: int, piece: str, finished: bool) -> dict:
        thought, content, entries = splits[i].feed(piece, finished)
        return {k: v for k, v in (("reasoning", "" if hidden else thought),
                                  ("content", content), ("tool_calls", entries)) if v}

    try:
        if chat:
            for i in range(num_choices):
                chunk = {**head, "choices": [{"index": i, "delta": {"role": parts.role,
                                                                     "content": ""},
                                              "logprobs": None, "finish_reason": None}]}
                if body.return_token_ids and i == 0:
                    chunk["prompt_token_ids"] = prompt_token_ids
                yield sse(chunk)
            for i in range(num_choices if parts.echo else 0):
                yield sse({**head, "choices": [{"index": i, "delta": {"content": parts.echo},
                                                "logprobs": None, "finish_reason": None}]})
        async for i, out in events:
            latest[i] = out
            # an echo's token texts start with the prompt's: the offsets index the echoed text
            texts[i] = texts[i] or token_texts([] if echo else out.prompt_token_ids)
            new = out.new_token_ids or []
            generated += len(new)
            if parts.reasoning_tokens:
                counts[i] = counts[i] or parts.reasoning_tokens(out.prompt_token_ids)
                counts[i].add(new, out.finished)
            pending_ids[i] += new
            if not echo_only:
                pending_lps[i] += out.new_logprobs or []
            piece = "" if echo_only else deltas[i].next(out.text, out.finished)
            echoing = echo and not sent[i]
            if echoing:
                piece = (out.prompt or "") + piece
            delta = chat_delta(i, piece, out.finished) if chat else {}
            if not (delta if chat else piece) and not out.finished \
                    and not (body.return_token_ids and new and not hidden) and not echoing:
                continue
            if out.finished:
                finals[i] = out
            logprobs = None
            if want_logprobs and pending_lps[i] and chat:
                logprobs = chat_logprobs(pending_lps[i], texts[i], out.finished)
            elif want_logprobs and echoing:
                logprobs = echo_logprobs(out.prompt_logprobs or [None], pending_lps[i],
                                         body.num_logprobs, texts[i], out.prompt_token_ids,
                                         out.finished)
                text_offsets[i] += sum(len(t) for t in logprobs["tokens"])
            elif want_logprobs and pending_lps[i]:
                logprobs = completion_logprobs(pending_lps[i], texts[i], text_offsets[i],
                                               out.finished)
                text_offsets[i] += sum(len(t) for t in logprobs["tokens"])
            reason = out.finish_reason if out.finished else None
            if reason is not None:
                reason = splits[i].finish_reason(reason)
            if chat:
                choice = {"index": i, "delta": delta,
                          "logprobs": logprobs, "finish_reason": reason}
            else:
                choice = {"index": i, "text": piece, "logprobs": logprobs,
                          "finish_reason": reason}
            if out.finished or not chat:
                choice["stop_reason"] = out.outputs[0].stop_reason if out.finished else None
            if body.return_token_ids and not hidden:
                if not chat and not sent[i]:
                    choice["prompt_token_ids"] = out.prompt_token_ids
                choice["token_ids"] = pending_ids[i]
            sent[i] = True
            pending_ids[i], pending_lps[i] = [], []
            chunk = {**head, "choices": [choice]}
            u = running_usage()
            if u is not None or not chat:
                chunk["usage"] = u
            yield sse(chunk)
        if body.include_usage:
            yield sse({**head, "choices": [], "usage": usage(finals, n,
                                                              reasoning_tokens=reasoning_total())})
        yield sse("[DONE]")
    except APIError as e:
        yield sse(e.body())
        yield sse("[DONE]")
    finally:
        await events.aclose()
