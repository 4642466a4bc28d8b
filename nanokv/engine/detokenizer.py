"""Incremental output text and stop-string matching."""

from __future__ import annotations

from nanokv.request import Request, RequestStatus


def update_text(request: Request, tokenizer) -> str | None:
    """Refresh `request.text` from its output tokens; return the stop string that matched, if
    any (the text is then cut before it, or after it with include_stop_str_in_output). A
    request the scheduler stopped on a token (EOS or stop_token_ids) leaves that token out of
    its text unless include_stop_str_in_output (its token ids keep it)."""
    if tokenizer is None:
        return None
    # the text before this step's tokens, less its trailing U+FFFD: a character whose bytes
    # come over several tokens decodes to U+FFFD until its last byte, then replaces it
    previous = len(request.text.rstrip("\ufffd"))
    ids = request.output_token_ids
    if (request.status == RequestStatus.FINISHED_STOPPED
            and not request.params.include_stop_str_in_output):
        ids = ids[:-1]  # the token that stopped it (EOS, a stop token id) is not text (vLLM's)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    request.text = text
    stops = request.params.stop
    if not stops or request.num_output_tokens <= request.params.min_tokens:
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
