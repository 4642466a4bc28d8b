"""Stop strings in the incremental output text (`nanokv.engine.detokenizer.update_text`) with a
byte-level tokenizer: a character whose bytes come over several tokens decodes to U+FFFD until
its last byte; a stop string holding it is still found, wherever the step boundaries fall."""

import pytest

from nanokv.engine.detokenizer import update_text
from nanokv.request import Request
from nanokv.sampling_params import SamplingParams


class ByteTokenizer:
    """Token id i is the byte i."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def run(text: str, stop: list[str], tokens_per_step: int, include: bool = False):
    """Feed text's bytes a few tokens a step; returns (stop found, its step, request.text)."""
    request = Request("r", [1], SamplingParams(stop=stop, include_stop_str_in_output=include))
    data = list(text.encode())
    for step, start in enumerate(range(0, len(data), tokens_per_step)):
        request.output_token_ids.extend(data[start:start + tokens_per_step])
        found = update_text(request, ByteTokenizer())
        if found is not None:
            return found, step, request.text
    return None, None, request.text


@pytest.mark.parametrize("tokens_per_step", [1, 2, 3, 5])
@pytest.mark.parametrize("stop", ["Җ", "bҖ", "Җc", "😀", "a😀b"])
def test_a_stop_string_over_multibyte_characters_is_found(stop, tokens_per_step):
    text = "xx aaa bҖc 😀 a😀b yy"
    found, step, cut = run(text, [stop], tokens_per_step)
    assert found == stop
    assert cut == text[:text.index(stop)]
    # not before the step whose tokens complete the stop string's first occurrence
    end_byte = len(text[:text.index(stop) + len(stop)].encode())
    assert step == (end_byte - 1) // tokens_per_step
    found, _, kept = run(text, [stop], tokens_per_step, include=True)
    assert kept == text[:text.index(stop) + len(stop)]


def test_no_stop_string_no_cut():
    assert run("abc Җ def", ["Жx"], 1) == (None, None, "abc Җ def")
