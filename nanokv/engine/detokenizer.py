"""Incremental output text and stop-string matching.

Each step decodes only a request's new tokens, in the context of the few before them (vLLM's
prefix / read offsets), so a step's text costs the same at output token 10 and 10,000; decoding
the whole output each step grew with its length (0.33 ms a request at 2,000 tokens). Text is only
appended, never rewritten (until a stop string cuts it: a stream holds back the last
len(stop) - 1 characters unless the stop string stays in the output,
`nanokv.server.responses.TextDelta`), so what a stream sent stays a
prefix of the final text: an incomplete character (U+FFFD) at the end waits for the tokens that
complete it (the complete characters before it are appended at once, so a stop string is found
in the step that completes it).

The output decodes after the prompt's last few tokens (`prompt_context`, as vLLM primes its
detokenizer), so its first token's text is what it adds to the prompt: a SentencePiece token's
leading space stays (" Paris" after "The capital of France is"), where decoding the output alone
drops it. The reference is therefore `decode(context + output)` less `decode(context)`, both
with the request's `skip_special_tokens` (vLLM's field: True by default, special tokens such as a
template's end token are left out; False keeps their text, in the context and in the output, so a
stop string may match it), which equals `decode(output)` for byte-level BPE vocabularies. The
one difference: a byte-fallback run holding an invalid UTF-8 sequence, whose earlier valid bytes
`decode` turns into U+FFFD with the invalid ones after the fact, while the text keeps what it
already had and the bytes after add one U+FFFD each (a step's "é", then 0xBD: "é\ufffd", where
decode gives three; vLLM's drops the invalid bytes). An output that ends inside a character (at
max_tokens) ends with U+FFFD, as `decode` gives it (vLLM's drops the incomplete bytes)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from nanokv.request import DecodeOffsets, Request, RequestStatus


CONTEXT_TOKENS = (4, 24)  # the prompt's last 4 to 23 tokens (vLLM's priming of its detokenizer)


def prompt_context(tokenizer, prompt_token_ids: list[int],
                   skip_special_tokens: bool = True) -> tuple[int, ...]:
    """The prompt's last tokens an output decodes after: the fewest (at least 4, or the whole
    prompt when shorter) whose text is not empty (skipped special tokens alone: the output's
    first token would be the text's first, and a SentencePiece decoder strips its space) and
    holds no incomplete character; none when no suffix up to 23 tokens is such (a prompt ending
    inside a character, or only special tokens: the output then decodes alone)."""
    if tokenizer is None:
        return ()
    low, high = CONTEXT_TOKENS
    for n in range(min(low, len(prompt_token_ids)), min(high, len(prompt_token_ids) + 1)):
        suffix = tuple(prompt_token_ids[-n:])
        text = tokenizer.decode(suffix, skip_special_tokens=skip_special_tokens)
        if text and "\ufffd" not in text:
            return suffix
    return ()


def decode_new_tokens(offsets: DecodeOffsets, ids: list[int], tokenizer, final: bool,
                      skip_special_tokens: bool = True) -> str:
    """The text the tokens from `offsets.read` on add after tokens [offsets.prefix,
    offsets.read), over `offsets.context` followed by ids, less what an earlier call returned of
    it (`offsets.shown`). While that text ends in an incomplete character (U+FFFD), only the
    characters before it are returned and the offsets stay, unless `final` (the output is
    complete: the rest, U+FFFD included). `skip_special_tokens`: as `tokenizer.decode`'s."""
    context = offsets.context or ()
    total = len(context) + len(ids)
    if offsets.read >= total:
        return ""
    # tokens prefix .. total - 1: the context's rest, then the output's (a few tokens)
    window = [*context[offsets.prefix:], *ids[max(offsets.prefix - len(context), 0):]]
    read = offsets.read - offsets.prefix
    before = tokenizer.decode(window[:read], skip_special_tokens=skip_special_tokens)
    text = tokenizer.decode(window, skip_special_tokens=skip_special_tokens)
    if not text.startswith(before):
        # a byte-fallback run turned invalid: decode renders the bytes already in the text as
        # U+FFFD too; the new tokens (a byte first) decode on their own instead
        before = ""
        text = tokenizer.decode(window[read:], skip_special_tokens=skip_special_tokens)
    new = text[len(before) + offsets.shown:]
    if not final and text.endswith("\ufffd"):  # a character whose last bytes are to come
        complete = new.rstrip("\ufffd")
        offsets.shown += len(complete)
        return complete
    if not final and len(text) <= len(before):
        return ""  # the new tokens have no text yet (skipped special tokens)
    offsets.prefix, offsets.read, offsets.shown = offsets.read, total, 0
    return new


class TokenTexts:
    """Each output token's own text, for log-probabilities: what it adds to the output text,
    decoded in the context of the tokens before it as `update_text` does. So a request's token
    strings add up to its text and each token's text_offset indexes it (a character over
    several tokens belongs to the token that completes it; complete characters before it, to
    their own token); a SentencePiece token keeps its leading space, the output's first too
    (it decodes after its prompt's last tokens, `prompt_context`, as the text). An alternative
    from a top list gets the text it would have added in the sampled token's place; special
    tokens have text or none as the request's `skip_special_tokens` says. Without a tokenizer:
    "token_id:<id>"."""

    def __init__(self, tokenizer, prompt_token_ids: list[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = prompt_context(tokenizer, list(prompt_token_ids), skip_special_tokens)
        # the prompt context, then the output's tokens, from the decode context's start on
        self.window: list[int] = list(context)
        self.offsets = DecodeOffsets(read=len(context), context=())  # the window holds it

    def next(self, token_id: int, alternatives: Iterable[int] = (),
             final: bool = False) -> tuple[str, list[str]]:
        """The next sampled token's text and its alternatives'; `final`: the output's last."""
        if self.tokenizer is None:
            return f"token_id:{token_id}", [f"token_id:{t}" for t in alternatives]
        others = [decode_new_tokens(replace(self.offsets), self.window + [t], self.tokenizer,
                                    final, self.skip_special_tokens) for t in alternatives]
        self.window.append(token_id)
        text = decode_new_tokens(self.offsets, self.window, self.tokenizer, final,
                                 self.skip_special_tokens)
        start = self.offsets.prefix  # tokens before the context are not read again
        del self.window[:start]
        self.offsets.prefix, self.offsets.read = 0, self.offsets.read - start
        return text, others


def update_text(request: Request, tokenizer, end: int | None = None) -> str | None:
    """Extend `request.text` with its new output tokens (those before output `end`, where given:
    a step's several tokens one at a time, the last of them with `end` None); return the stop
    string that matched, if any (the text is then cut before it, or after it with
    include_stop_str_in_output). A request the scheduler stopped on a token (EOS or
    stop_token_ids) leaves that token out of its text unless include_stop_str_in_output (its
    token ids keep it), whatever skip_special_tokens says (vLLM's). With detokenize=False the
    text stays empty."""
    if tokenizer is None or not request.params.detokenize:
        return None
    previous = len(request.text)
    skip_special_tokens = request.params.skip_special_tokens
    if request.decode_offsets.context is None:  # the request's first text: after its prompt
        request.decode_offsets = DecodeOffsets.after(
            prompt_context(tokenizer, request.prompt_token_ids, skip_special_tokens))
    num_outputs = request.num_output_tokens if end is None else end
    ids = request.output_token_ids if end is None else request.output_token_ids[:end]
    last = num_outputs == request.num_output_tokens  # the request's state is its own
    if (last and request.status == RequestStatus.FINISHED_STOPPED
            and not request.params.include_stop_str_in_output):
        ids = ids[:-1]  # the token that stopped it (EOS, a stop token id) is not text (vLLM's)
    request.text += decode_new_tokens(request.decode_offsets, ids, tokenizer,
                                      last and request.is_finished, skip_special_tokens)
    text = request.text
    stops = request.params.stop
    if not stops or num_outputs <= request.params.min_tokens:
        return None  # as EOS, a stop string may end in output token min_tokens + 1 at the earliest
    # the stop that ends first in this step's new text (ties: the first listed, as vLLM): each
    # is looked for where it would end past `previous` (one ending before was looked for then,
    # or fell in the first min_tokens tokens)
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stops:
        at = text.find(stop, max(0, previous - len(stop) + 1))
        if at >= 0 and (best is None or at + len(stop) < best[0]):
            best = (at + len(stop), at, stop)
    if best is None:
        return None
    _, at, stop = best
    request.text = text[:at + len(stop)] if request.params.include_stop_str_in_output else text[:at]
    return stop
