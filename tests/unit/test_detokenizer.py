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


def run(text: str, stop: list[str], tokens_per_step: int, include: bool = False,
        min_tokens: int = 0):
    """Feed text's bytes a few tokens a step; returns (stop found, its step, request.text)."""
    request = Request("r", [1], SamplingParams(stop=stop, include_stop_str_in_output=include,
                                               min_tokens=min_tokens, max_tokens=100))
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


@pytest.mark.parametrize("stop", ["X", "Xc", "bX"])
def test_min_tokens_and_stop_strings(stop):
    """As EOS and vLLM: a stop string must end in output token min_tokens + 1 or later (one
    token a step, as decoding makes them); one that ended within the first min_tokens tokens
    is not found later either. Oracle: the first occurrence ending past min_tokens bytes."""
    text = "abXcdbXcef"
    for min_tokens in range(len(text) + 1):
        ends = [i + len(stop) for i in range(len(text)) if text.startswith(stop, i)]
        ok = [e for e in ends if e > min_tokens]
        expected = (stop, text[:ok[0] - len(stop)]) if ok else (None, text)
        found, _, cut = run(text, [stop], 1, min_tokens=min_tokens)
        assert (found, cut) == expected, min_tokens


@pytest.mark.parametrize("tokens_per_step", [1, 4, 20])
def test_the_stop_that_ends_first_wins(tokens_per_step):
    """Several stop strings completed in one step: the one that ends first in the text (what a
    character stream meets first), ties by list order, as vLLM."""
    text = "ly are the following lines"
    found, _, cut = run(text, ["following", "low"], tokens_per_step)
    assert (found, cut) == ("low", "ly are the fol")
    found, _, cut = run(text, ["wing", "ing"], tokens_per_step)
    assert (found, cut) == ("wing", "ly are the follo")
    found, _, cut = run(text, ["ing", "wing"], tokens_per_step)
    assert (found, cut) == ("ing", "ly are the follow")

