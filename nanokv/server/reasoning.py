"""Reasoning parsers (vLLM's `--reasoning-parser`): a chat answer's text split into the
model's `reasoning` (between `<think>` and `</think>`) and its `content` (after `</think>`),
whole or incrementally for streams. vLLM's parsers work on token ids; these work on the text,
which is the same for markers that decode to themselves.

Both parsers read the answer as reasoning until the end marker, so an answer without
`</think>` is all reasoning (its content null), and text before `<think>` is reasoning too
(the chat templates of these models put `<think>` in the prompt, so the answer may not start
with it). They differ in stray markers: qwen3 drops every further `<think>` in the reasoning
and every further `</think>` in the content; deepseek_r1 drops only the first `<think>` and
keeps the rest as text. With `chat_template_kwargs: {"enable_thinking": false}` (Qwen3's
template then closes the reasoning in the prompt) qwen3 leaves the whole answer as content."""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    drops_stray_markers: bool  # qwen3's; deepseek_r1 keeps them as text
    obeys_enable_thinking: bool  # chat_template_kwargs.enable_thinking false: all content

    def thinking(self, chat_template_kwargs: dict | None) -> bool:
        """Whether the request's answer starts in the reasoning."""
        return not (self.obeys_enable_thinking
                    and (chat_template_kwargs or {}).get("enable_thinking", True) is False)

    def stream(self, thinking: bool = True) -> ReasoningStream:
        return ReasoningStream(self, thinking)

    def split(self, text: str, thinking: bool = True) -> tuple[str | None, str | None]:
        """The whole answer's (reasoning, content), None for an empty part (vLLM's)."""
        stream = self.stream(thinking)
        reasoning, content = stream.feed(text)
        rest_reasoning, rest_content = stream.finish()
        return reasoning + rest_reasoning or None, content + rest_content or None


PARSERS = {p.name: p for p in (
    ReasoningParser("deepseek_r1", drops_stray_markers=False, obeys_enable_thinking=False),
    ReasoningParser("qwen3", drops_stray_markers=True, obeys_enable_thinking=True),
)}


def get_parser(name: str) -> ReasoningParser:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(sorted(PARSERS))}") from None


class ReasoningStream:
    """One answer split as it arrives: `feed` each new piece of text, then `finish`; each
    returns the (reasoning, content) text now known ("" for none). Text that may be the
    beginning of a marker waits for the next piece, so no marker text reaches either part."""

    def __init__(self, parser: ReasoningParser, thinking: bool = True) -> None:
        self.parser = parser
        self.in_reasoning = thinking
        self.thinking = thinking
        self.started = False  # a <think> was dropped
        self.pending = ""  # held back: it may begin a marker

    def _markers(self) -> tuple[str, ...]:
        if not self.thinking:
            return ()
        stray = self.parser.drops_stray_markers
        if self.in_reasoning:
            return (END, START) if stray or not self.started else (END,)
        return (END,) if stray else ()

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        parts: dict[bool, list[str]] = {True: [], False: []}  # by in_reasoning
        while True:
            markers = self._markers()
            hits = [(i, m) for m in markers if (i := self.pending.find(m)) >= 0]
            if not hits:
                break
            at, marker = min(hits)
            parts[self.in_reasoning].append(self.pending[:at])
            self.pending = self.pending[at + len(marker):]
            if marker == START:
                self.started = True
            else:
                self.in_reasoning = False  # a </think> in the content is just dropped
        keep = max((k for m in markers for k in range(1, len(m))
                    if self.pending.endswith(m[:k])), default=0)
        parts[self.in_reasoning].append(self.pending[:len(self.pending) - keep])
        self.pending = self.pending[len(self.pending) - keep:]
        return "".join(parts[True]), "".join(parts[False])

    def finish(self) -> tuple[str, str]:
        """The held-back text: no marker after all."""
        rest, self.pending = self.pending, ""
        return (rest, "") if self.in_reasoning else ("", rest)


class ReasoningTokens:
    """An answer's reasoning tokens (the usage's `completion_tokens_details.reasoning_tokens`),
    counted as its tokens come (`add`, each token's text as `TokenTexts` gives it): those with
    text before the answer's first end marker (all of them while it has none), the tokens
    wholly inside a start marker not counted; none for an answer that does not start in the
    reasoning. Read from the text, as the split is: where the markers are tokens of their own
    (Qwen3's, DeepSeek-R1's), the tokens between them."""

    def __init__(self, thinking: bool = True) -> None:
        self.done = not thinking  # the end marker came (or there is no reasoning)
        self.count = 0
        self.text = ""
        self.spans: list[tuple[int, int]] = []  # each token's [start, end) in text

    def add(self, token_text: str) -> None:
        if self.done:
            return
        a = len(self.text)
        self.text += token_text
        self.spans.append((a, len(self.text)))
        self.count += 1
        end = self.text.find(END, max(0, a - len(END) + 1))
        if end >= 0:  # the tokens with text before it, the start markers' aside
            self.done = True
            self.count = sum(1 for s, _ in self.spans if s < end)
            self.count -= self._in_starts(self.text[:end])
            return
        self.count -= self._in_starts(self.text, since=a)

    def _in_starts(self, text: str, since: int = 0) -> int:
        """Tokens wholly inside the start markers of `text` (all of them; or those found from
        `since` on, as `add` meets them)."""
        inside, at = 0, text.find(START, max(0, since - len(START) + 1))
        while at >= 0:
            inside += sum(1 for s, e in self.spans if at <= s and e <= at + len(START) and s < e)
            at = text.find(START, at + len(START))
        return inside

