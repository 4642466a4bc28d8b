"""The reasoning parsers of `nanokv serve --reasoning-parser`: whole answers against hand-written
splits (vLLM's behaviour for these markers), and streams cut anywhere giving the same split
with no marker text in either part."""

from __future__ import annotations

import random

import pytest

from nanokv.server.reasoning import PARSERS, ReasoningStream, ReasoningTokens, get_parser
from nanokv.server.serving import ServerSettings

# (answer, qwen3's split, deepseek_r1's split)
CASES = [
    ("<think>abc</think>wxyz", ("abc", "wxyz"), ("abc", "wxyz")),
    ("abc</think>wxyz", ("abc", "wxyz"), ("abc", "wxyz")),  # <think> was in the prompt
    ("<think>abc</think>", ("abc", None), ("abc", None)),  # nothing after: content null
    ("<think>still thinking", ("still thinking", None), ("still thinking", None)),
    ("no markers at all", ("no markers at all", None), ("no markers at all", None)),
    ("</think>answer", (None, "answer"), (None, "answer")),
    ("", (None, None), (None, None)),
    ("pre<think>abc</think>x", ("preabc", "x"), ("preabc", "x")),
    ("<think>a<think>b</think>c", ("ab", "c"), ("a<think>b", "c")),
    ("<think>a</think>b</think>c<think>d", ("a", "bc<think>d"), ("a", "b</think>c<think>d")),
    ("<think>\nplan: 1 < 2\n</think>\n\nThe answer is <b>4</b>.",
     ("\nplan: 1 < 2\n", "\n\nThe answer is <b>4</b>."),
     ("\nplan: 1 < 2\n", "\n\nThe answer is <b>4</b>.")),
    ("<think>a</thin", ("a</thin", None), ("a</thin", None)),  # a marker's start, never ended
    ("<thinkabc</think>d", ("<thinkabc", "d"), ("<thinkabc", "d")),
]


@pytest.mark.parametrize("text,qwen3,deepseek_r1", CASES)
def test_whole_answers_split_as_vllm(text, qwen3, deepseek_r1):
    assert PARSERS["qwen3"].split(text) == qwen3
    assert PARSERS["deepseek_r1"].split(text) == deepseek_r1


def _stream(stream: ReasoningStream, pieces: list[str]) -> tuple[list[str], list[str]]:
    reasoning, content = [], []
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = stream.finish()
    return reasoning + [r], content + [c]


def _joined(parts: list[str]) -> str | None:
    return "".join(parts) or None


def _no_marker_pieces(parts: list[str], whole: str | None) -> None:
    """No delta holds a piece (2 characters or more) of a marker that its part of the whole
    split lacks: a marker's text never leaks into reasoning or content."""
    fragments = {m[i:j] for m in ("<think>", "</think>")
                 for i in range(len(m)) for j in range(i + 2, len(m) + 1)}
    for part in parts:
        leaked = [f for f in fragments if f in part and f not in (whole or "")]
        assert not leaked, f"{leaked} leaked into {part!r}"


def _check(parser, pieces: list[str], whole: tuple) -> None:
    reasoning, content = _stream(parser.stream(), pieces)
    assert (_joined(reasoning), _joined(content)) == whole, pieces
    _no_marker_pieces(reasoning, whole[0])
    _no_marker_pieces(content, whole[1])


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("text", [c[0] for c in CASES])
def test_streams_cut_at_every_boundary_give_the_whole_split(name, text):
    parser = PARSERS[name]
    whole = parser.split(text)
    for cut in range(len(text) + 1):  # two pieces, cut anywhere
        _check(parser, [text[:cut], text[cut:]], whole)
    _check(parser, list(text), whole)  # one character a piece
    rng = random.Random(len(text))
    for _ in range(20):  # random cuts, empty pieces included
        cuts = sorted(rng.choices(range(len(text) + 1), k=4))
        _check(parser, [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])], whole)


def test_a_marker_split_across_deltas_is_held_back_then_dropped():
    stream = PARSERS["qwen3"].stream()
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>plan</") == ("plan", "")
    assert stream.feed("thi") == ("", "")
    assert stream.feed("nk>ans") == ("", "ans")
    assert stream.feed("wer <") == ("", "wer ")  # qwen3 would drop a stray </think>
    assert stream.feed("b>") == ("", "<b>")
    assert stream.finish() == ("", "")
    stream = PARSERS["deepseek_r1"].stream()
    assert stream.feed("plan</think>x <") == ("plan", "x <")  # it keeps them: no wait


def test_a_held_back_tail_that_is_no_marker_comes_out_at_the_end():
    stream = PARSERS["deepseek_r1"].stream()
    assert stream.feed("think </th") == ("think ", "")
    assert stream.finish() == ("</th", "")
    stream = PARSERS["qwen3"].stream()
    assert stream.feed("a</think>b</thi") == ("a", "b")
    assert stream.finish() == ("", "</thi")


def test_enable_thinking_false_leaves_qwen3_answers_as_content():
    qwen3, r1 = PARSERS["qwen3"], PARSERS["deepseek_r1"]
    off = {"enable_thinking": False}
    assert qwen3.thinking(None) and qwen3.thinking({}) and qwen3.thinking({"x": 1})
    assert not qwen3.thinking(off) and r1.thinking(off)  # deepseek_r1 ignores the switch
    text = "<think>a</think>b"
    assert qwen3.split(text, thinking=False) == (None, text)
    reasoning, content = _stream(qwen3.stream(thinking=False), list(text))
    assert "".join(reasoning) == "" and "".join(content) == text


def test_unknown_parser_names_are_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match="unknown reasoning parser 'qwen'.*deepseek_r1, qwen3"):
        get_parser("qwen")
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ServerSettings("m", reasoning_parser="r1")
    assert ServerSettings("m", reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="needs --reasoning-parser"):
        ServerSettings("m", structured_outputs_enable_in_reasoning=True)
    assert ServerSettings("m", reasoning_parser="qwen3",
                          structured_outputs_enable_in_reasoning=True)


def count_reasoning_tokens(token_texts: list[str], thinking: bool = True) -> int:
    """`ReasoningTokens` of a whole answer's token texts."""
    counter = ReasoningTokens(thinking)
    for text in token_texts:
        counter.add(text)
    return counter.count


def test_reasoning_tokens_are_those_before_the_end_marker():
    assert count_reasoning_tokens(["a", "b", "</think>", "c"]) == 2  # single-token markers
    assert count_reasoning_tokens(["<think>", "a", "</think>", "c", "</think>"]) == 1
    assert count_reasoning_tokens(["a", "b", "c"]) == 3  # never ended: all reasoning
    assert count_reasoning_tokens(["a", "</th", "ink>", "b"]) == 1  # a marker over tokens
    assert count_reasoning_tokens(["a</th", "ink>b"]) == 1  # tokens over its edges
    assert count_reasoning_tokens(["<thi", "nk>", "x", "</think>"]) == 1
    assert count_reasoning_tokens(["a", "</think>"], thinking=False) == 0
    assert count_reasoning_tokens([]) == 0
    # counted as the tokens come: the count so far, final once the marker is read
    counter = ReasoningTokens()
    seen = []
    for piece in ["<think>", "a", "b", "</", "think>", "c"]:
        counter.add(piece)
        seen.append(counter.count)
    assert seen == [0, 1, 2, 3, 2, 2] and counter.done
