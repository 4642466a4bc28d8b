"""The SSE body of a streamed completion (`nanokv.server.responses.stream_events`) from scripted
engine outputs: one chunk per step, so what each chunk carries is known."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("pydantic")

from nanokv.engine.detokenizer import TokenTexts  # noqa: E402
from nanokv.layers.sampler import TokenLogprobs  # noqa: E402
from nanokv.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from nanokv.server.protocol import CompletionRequest  # noqa: E402
from nanokv.server.responses import stream_events  # noqa: E402

TEXT = {5: "ab", 6: "cde", 7: " f", 8: "gh"}  # token id -> its text


class TextTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(TEXT[t] for t in ids)


def outputs(ids: list[int]):
    """One RequestOutput per step, a token each, the last one finished."""
    for k in range(1, len(ids) + 1):
        done = k == len(ids)
        text = "".join(TEXT[t] for t in ids[:k])
        yield RequestOutput(
            "r", None, [1, 2], [CompletionOutput(text, ids[:k], "length" if done else None)],
            done, 0, RequestMetrics(0.0), new_token_ids=[ids[k - 1]],
            new_logprobs=[TokenLogprobs(ids[k - 1], -0.5, 1, [(ids[k - 1], -0.5)])])


def chunks(ids: list[int], **body) -> list[dict]:
    async def events():
        for out in outputs(ids):
            yield 0, out

    async def collect():
        req = CompletionRequest(model="m", prompt="x", stream=True, **{"logprobs": 1, **body})
        return [e async for e in stream_events(events(), 1, {"id": "c"}, req, False,
                                               lambda prompt: TokenTexts(TextTokenizer()))]

    lines = asyncio.run(collect())
    return [json.loads(e[len("data: "):]) for e in lines if e.strip() != "data: [DONE]"]


def test_streamed_text_offsets_run_over_the_whole_completion():
    """Each chunk's text_offset counts from the completion's start (as the non-streamed
    response and vLLM), not from the chunk's."""
    ids = [5, 6, 7, 8]
    got = [c["choices"][0]["logprobs"] for c in chunks(ids) if c["choices"]]
    assert len(got) == 4  # one chunk per step here
    assert [o for lp in got for o in lp["text_offset"]] == [0, 2, 5, 7]
    assert [t for lp in got for t in lp["tokens"]] == ["ab", "cde", " f", "gh"]


@pytest.mark.parametrize("include,pieces", [(False, ["abc", "de", " fgh"]),
                                            (True, ["ab", "cde", " f", "gh"])])
def test_a_stop_string_holds_back_only_the_tail_it_would_cut(include, pieces):
    """A stop string (3 characters) that would be cut from the text holds back the last 2
    characters of each step's text; one kept in the output (include_stop_str_in_output) holds
    back nothing, as in vLLM: the text is cut only after it."""
    got = [c["choices"][0]["text"] for c in chunks([5, 6, 7, 8], stop=["xyz"], logprobs=None,
                                                   include_stop_str_in_output=include)
           if c["choices"]]
    assert got == pieces
