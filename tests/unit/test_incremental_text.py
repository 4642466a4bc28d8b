"""The incremental output text (`nanokv.engine.detokenizer`) against the tokenizer's own
`decode` of the whole output: a byte-level BPE tokenizer (the shipped model's) and a
byte-fallback one (Llama-2 / Mistral style) built here, outputs from random text with
multi-byte characters and special tokens, fed a few tokens a step. The text only grows (what a
stream sent stays a prefix), ends equal to `decode`, and each step decodes a few tokens whatever
the output's length. A request's output decodes after its prompt's last tokens (vLLM's
priming): its text is decode(context + output) less decode(context), which keeps a
SentencePiece output's first space."""

import os
import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from nanokv.engine.detokenizer import TokenTexts, prompt_context, update_text
from nanokv.request import DecodeOffsets, Request, RequestStatus
from nanokv.sampling_params import SamplingParams

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "..", "models", "nanokv-tiny")
WORDS = ["the", " cat", " 中文", "é", " 🙂", "\n", " in", "Җc", " a😀b", ",", " 👩‍💻", "  "]


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece-style BPE: "▁" for spaces, <0xNN> tokens for bytes not in the vocabulary,
    a special end token."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "t", "h", "e", "c", "a", "i", "n", "▁t", "▁th", "▁the", "in", "▁in", "中",
                  "é", "▁c", "▁ca", "at", "▁cat", ","]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("i", "n"), ("▁", "in"), ("▁", "c"),
              ("▁c", "a"), ("▁ca", "t"), ("a", "t")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True,
                               unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("<|end|>", special=True, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def tokenizer(request):
    if request.param == "byte_level":
        return AutoTokenizer.from_pretrained(SHIPPED)
    return byte_fallback_tokenizer()


def random_output(tokenizer, rng: random.Random) -> list[int]:
    """Token ids of random text (valid UTF-8 throughout) with special tokens among them."""
    ids = []
    for _ in range(rng.randrange(1, 30)):
        if rng.random() < 0.1:
            ids += tokenizer.all_special_ids[:1] or []
        ids += tokenizer.encode("".join(rng.choices(WORDS, k=rng.randrange(1, 4))),
                                add_special_tokens=False)
    return ids


def feed(tokenizer, ids: list[int], rng: random.Random | None, prompt: list[int] | None = None,
         **params) -> tuple[str, list[str]]:
    """Append ids a random few a step (rng None: one, as decode steps do); returns the final
    text and the text after each step. With a prompt, the text continues it as the engine makes
    requests (`prompt_context`). `params`: more SamplingParams fields."""
    request = Request("r", prompt or [1], SamplingParams(max_tokens=len(ids), **params))
    if prompt is None:  # the output decodes alone (with a prompt, update_text chooses)
        request.decode_offsets = DecodeOffsets.after(())
    seen, at = [], 0
    while at < len(ids):
        at += rng.randrange(1, 5) if rng else 1
        request.output_token_ids = ids[:at]
        if at >= len(ids):
            request.status = RequestStatus.FINISHED_LENGTH
        update_text(request, tokenizer)
        seen.append(request.text)
    return request.text, seen


def test_the_text_grows_and_ends_equal_to_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(150):
        ids = random_output(tokenizer, rng)
        final, seen = feed(tokenizer, ids, rng)
        assert final == tokenizer.decode(ids, skip_special_tokens=True)
        assert all(final.startswith(text) for text in seen)
        assert all("\ufffd" not in text for text in seen[:-1])  # incomplete characters wait


def test_random_token_ids_only_append(tokenizer):
    """Any ids, invalid UTF-8 byte runs included: the text only grows. With byte-level BPE it
    ends equal to decode (lossy decoding replaces just the invalid bytes)."""
    rng = random.Random(1)
    vocab = len(tokenizer)
    for _ in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        final, seen = feed(tokenizer, ids, rng)
        assert all(final.startswith(text) for text in seen)
        if isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel):
            assert final == tokenizer.decode(ids, skip_special_tokens=True)


def test_an_invalid_byte_run_keeps_the_bytes_already_shown():
    """Byte fallback: decode turns a run with an invalid byte into U+FFFD as a whole, including
    the valid "\\n" before it; the text keeps the "\\n" it showed (as vLLM's)."""
    tok = byte_fallback_tokenizer()
    word, newline, lead = tok.convert_tokens_to_ids(["in", "<0x0A>", "<0xE4>"])
    ids = [word, newline, lead, word]
    assert tok.decode(ids) == "in\ufffd\ufffdin"
    request = Request("r", [1], SamplingParams(max_tokens=4))
    texts = []
    for k in range(1, 5):
        request.output_token_ids = ids[:k]
        request.status = RequestStatus.FINISHED_LENGTH if k == 4 else RequestStatus.RUNNING
        update_text(request, tok)
        texts.append(request.text)
    assert texts == ["in", "in\n", "in\n", "in\n\ufffdin"]


@pytest.mark.parametrize("prompt", [None, "the cat"])
def test_invalid_bytes_after_valid_ones_add_one_replacement_each(prompt):
    """Byte fallback, a token a step: "é" (0xC3 0xA9) then a lone continuation byte (0xBD) and
    a space: decode of the whole gives three U+FFFD; the text keeps the "é" it showed and adds
    one, as a lossy UTF-8 decoding of the bytes does, whether the run starts in the output or
    after the prompt's bytes (0xD8 0xB1, "ر")."""
    tok = byte_fallback_tokenizer()
    c3, a9, bd, d8, b1 = tok.convert_tokens_to_ids(["<0xC3>", "<0xA9>", "<0xBD>", "<0xD8>",
                                                    "<0xB1>"])
    space = tok.convert_tokens_to_ids("▁")
    ids = [c3, a9, bd, space]
    assert tok.decode(ids) == "\ufffd\ufffd\ufffd "
    final, seen = feed(tok, ids, None,
                       None if prompt is None else tok.encode(prompt, add_special_tokens=False))
    assert final == b"\xc3\xa9\xbd ".decode(errors="replace") == "é\ufffd "
    assert all(final.startswith(text) for text in seen)
    # the prompt ends in valid bytes the output's invalid byte follows
    prompt_ids = tok.encode("the", add_special_tokens=False) + [d8, b1]
    final, _ = feed(tok, [bd, space], None, prompt_ids)
    assert final == "\ufffd "


class CountingTokenizer:
    """Records how many ids each decode call gets."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def decode(self, ids, skip_special_tokens=True):
        self.calls.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_step_decodes_a_few_tokens_at_any_output_length():
    tok = CountingTokenizer(AutoTokenizer.from_pretrained(SHIPPED))
    ids = tok.inner.encode(" the cat sat on the mat," * 400, add_special_tokens=False)
    assert len(ids) > 2000
    request = Request("r", [1], SamplingParams(max_tokens=len(ids)))
    for k in range(1, len(ids) + 1):
        request.output_token_ids = ids[:k]
        update_text(request, tok)
    assert request.text == tok.inner.decode(ids)
    assert max(tok.calls) <= 2  # the token before and the new one, not the whole output


def token_texts(tokenizer, ids: list[int], alternatives: int = 0) -> tuple[list[str], list]:
    texts = TokenTexts(tokenizer)
    got = [texts.next(t, ids[:alternatives], final=k == len(ids) - 1)
           for k, t in enumerate(ids)]
    return [text for text, _ in got], [others for _, others in got]


def test_token_texts_add_up_to_the_text(tokenizer):
    """Log-probabilities' token strings: each token's part of the output text, so they add up
    to it (and text_offset indexes it); a character over several tokens goes to the token that
    completes it."""
    rng = random.Random(2)
    for _ in range(100):
        ids = random_output(tokenizer, rng)
        tokens, _ = token_texts(tokenizer, ids)
        assert "".join(tokens) == tokenizer.decode(ids, skip_special_tokens=True)


def test_token_texts_of_split_characters_and_spaces():
    byte_level = AutoTokenizer.from_pretrained(SHIPPED)
    ids = byte_level.encode("中文 😀", add_special_tokens=False)
    tokens, _ = token_texts(byte_level, ids)
    assert "".join(tokens) == "中文 😀" and "\ufffd" not in "".join(tokens)
    assert all(t in ("", "中", "文", " ", "😀", " 😀", "中文") for t in tokens)
    sentencepiece = byte_fallback_tokenizer()
    ids = sentencepiece.encode("the cat in", add_special_tokens=False)
    assert sentencepiece.convert_ids_to_tokens(ids) == ["▁the", "▁cat", "▁in"]
    tokens, others = token_texts(sentencepiece, ids, alternatives=2)
    assert tokens == ["the", " cat", " in"]  # decode([id]) drops every leading space
    # an alternative: the text it would add in the sampled token's place
    assert others[1] == [" the", " cat"] and others[2] == [" the", " cat"]


# ---- the output decodes after its prompt (vLLM primes its detokenizer with the prompt's end) --

def test_a_sentencepiece_output_keeps_its_first_space_after_the_prompt():
    """"the cat" + "▁in▁the": the text is " in the" (what the output adds to the prompt, as
    vLLM's), where decoding the output alone gives "in the"."""
    tok = byte_fallback_tokenizer()
    prompt = tok.encode("the cat", add_special_tokens=False)
    ids = tok.encode("in the", add_special_tokens=False)
    assert tok.decode(ids) == "in the"
    final, seen = feed(tok, ids, random.Random(0), prompt)
    assert final == " in the" and all(final.startswith(t) for t in seen)
    texts = TokenTexts(tok, prompt)
    assert [texts.next(t, final=k == len(ids) - 1)[0] for k, t in enumerate(ids)] == \
        [" in", " the"]


def test_the_text_is_what_the_output_adds_to_its_prompt(tokenizer):
    """Random prompts and outputs (special tokens among them): the text ends equal to
    decode(context + output) less decode(context), only grows, and the token texts add up to
    it; for byte-level BPE that is decode(output) itself."""
    rng = random.Random(3)
    for _ in range(100):
        prompt, ids = random_output(tokenizer, rng), random_output(tokenizer, rng)
        context = list(prompt_context(tokenizer, prompt))
        assert not context or context == prompt[-len(context):]
        before = tokenizer.decode(context, skip_special_tokens=True)
        expected = tokenizer.decode(context + ids, skip_special_tokens=True)
        assert expected.startswith(before)
        final, seen = feed(tokenizer, ids, rng, prompt)
        assert final == expected[len(before):]
        assert all(final.startswith(text) for text in seen)
        texts = TokenTexts(tokenizer, prompt)
        assert "".join(texts.next(t, final=k == len(ids) - 1)[0]
                       for k, t in enumerate(ids)) == final
        if isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel):
            assert final == tokenizer.decode(ids, skip_special_tokens=True)


def test_the_prompt_context_is_the_fewest_tokens_of_whole_characters():
    byte_level = AutoTokenizer.from_pretrained(SHIPPED)
    prompt = byte_level.encode("a b c d e f g h", add_special_tokens=False)
    assert prompt_context(byte_level, prompt) == tuple(prompt[-4:])
    assert prompt_context(byte_level, prompt[:2]) == tuple(prompt[:2])  # shorter: all of it
    assert prompt_context(None, prompt) == ()
    # a prompt ending inside a character (a lone byte of a multi-byte one): no context, the
    # output decodes alone
    lone_byte = [i for i in range(len(byte_level)) if byte_level.decode([i]) == "\ufffd"][:1]
    assert lone_byte and prompt_context(byte_level, prompt + lone_byte) == ()
    # one that starts inside a character takes the suffix after it
    tok = byte_fallback_tokenizer()
    cont = tok.convert_tokens_to_ids(["<0xB8>"])  # a continuation byte alone
    words = tok.encode("the cat in the cat", add_special_tokens=False)
    assert prompt_context(tok, cont + words) == tuple(words[-4:])
    # one ending in special tokens reaches back to text: its first token's space is stripped,
    # not the output's
    ends = [tok.eos_token_id] * 5
    assert prompt_context(tok, words + ends) == tuple(words[-1:] + ends)
    final, _ = feed(tok, tok.encode("in", add_special_tokens=False), random.Random(0),
                    words + ends)
    assert final == " in"
    assert prompt_context(tok, ends) == ()  # special tokens only: the output starts the text


def test_the_engine_decodes_each_output_after_its_prompt():
    from nanokv import LLM, SamplingParams as Params

    llm = LLM(SHIPPED)
    tok = llm.engine.tokenizer
    request = llm.engine.make_request("The capital of France is", Params(max_tokens=4))
    prompt = request.prompt_token_ids
    # chosen at the request's first text, in the engine's thread (the server makes requests in
    # another thread, and the engine's tokenizer is not shared across threads)
    assert request.decode_offsets.context is None
    llm.engine.add_prepared(request)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert request.decode_offsets.context == prompt_context(tok, prompt) == tuple(prompt[-4:])
    out = llm.generate(["The capital of France is"], Params(temperature=0, max_tokens=8))[0]
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)  # byte-level BPE


# ---- skip_special_tokens=False: special tokens keep their text (vLLM's field) -----------------

def test_special_tokens_kept_in_the_text_and_the_token_texts(tokenizer):
    """The text is decode(context + output) less decode(context), both keeping special tokens
    (for byte-level BPE decode(output, skip_special_tokens=False) itself); it only grows, and
    the token texts add up to it."""
    rng = random.Random(4)
    special = tokenizer.all_special_tokens[0]
    kept = 0
    for _ in range(100):
        prompt, ids = random_output(tokenizer, rng), random_output(tokenizer, rng)
        context = list(prompt_context(tokenizer, prompt, skip_special_tokens=False))
        before = tokenizer.decode(context, skip_special_tokens=False)
        expected = tokenizer.decode(context + ids, skip_special_tokens=False)
        assert expected.startswith(before)
        final, seen = feed(tokenizer, ids, rng, prompt, skip_special_tokens=False)
        assert final == expected[len(before):]
        assert all(final.startswith(text) for text in seen)
        texts = TokenTexts(tokenizer, prompt, skip_special_tokens=False)
        assert "".join(texts.next(t, final=k == len(ids) - 1)[0]
                       for k, t in enumerate(ids)) == final
        if isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel):
            assert final == tokenizer.decode(ids, skip_special_tokens=False)
        kept += special in final
    assert kept > 10  # the outputs did hold special tokens


def test_a_prompt_of_special_tokens_is_context_when_they_are_kept():
    """A prompt ending in special tokens: kept, their text is context enough (the output's first
    space stays); skipped, the context reaches back to the text before them."""
    tok = byte_fallback_tokenizer()
    words = tok.encode("the cat in the cat", add_special_tokens=False)
    ends = [tok.eos_token_id] * 5
    assert prompt_context(tok, words + ends, skip_special_tokens=False) == tuple(ends[-4:])
    assert prompt_context(tok, words + ends) == tuple(words[-1:] + ends)
    output = tok.encode("in", add_special_tokens=False)
    assert feed(tok, output, None, words + ends, skip_special_tokens=False)[0] == \
        tok.decode(ends[-4:] + output, skip_special_tokens=False)[len("</s>" * 4):] == " in"


@pytest.mark.parametrize("tokens_per_step", [1, 3])
def test_a_stop_string_may_be_a_kept_special_token(tokens_per_step):
    """stop=["<|end|>"]: found when special tokens are kept (the text cut before it), never
    when they are skipped (the token has no text)."""
    tok = byte_fallback_tokenizer()
    end = tok.convert_tokens_to_ids("<|end|>")
    ids = tok.encode("the cat", add_special_tokens=False) + [end] + \
        tok.encode("in", add_special_tokens=False)
    prompt = tok.encode("in", add_special_tokens=False)
    for skip, found, text in [(False, "<|end|>", " the cat"), (True, None, " the cat in")]:
        request = Request("r", prompt, SamplingParams(max_tokens=len(ids), stop=["<|end|>"],
                                                      skip_special_tokens=skip))
        stop = None
        for at in range(tokens_per_step, len(ids) + tokens_per_step, tokens_per_step):
            request.output_token_ids = ids[:at]
            if at >= len(ids):
                request.status = RequestStatus.FINISHED_LENGTH
            stop = update_text(request, tok)
            if stop:
                break
        assert (stop, request.text) == (found, text)


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_token_stays_out_of_a_kept_text_unless_included(include):
    """As vLLM: a request stopped by EOS (or a stop token id) leaves that token out of its text
    whatever skip_special_tokens says; include_stop_str_in_output keeps it, with its text when
    special tokens are kept."""
    tok = byte_fallback_tokenizer()
    ids = tok.encode("the cat", add_special_tokens=False) + [tok.eos_token_id]
    for skip in (False, True):
        request = Request("r", [1], SamplingParams(max_tokens=8, skip_special_tokens=skip,
                                                   include_stop_str_in_output=include))
        request.decode_offsets = DecodeOffsets.after(())  # the output decodes alone
        request.output_token_ids = ids
        request.status = RequestStatus.FINISHED_STOPPED
        update_text(request, tok)
        kept = include and not skip
        assert request.text == tok.decode(ids if kept else ids[:-1], skip_special_tokens=skip)
        assert request.text.endswith("</s>") == kept
