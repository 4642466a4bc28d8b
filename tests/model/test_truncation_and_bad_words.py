"""vLLM's truncate_prompt_tokens and bad_words through LLM.generate, against transformers."""

from pathlib import Path

import pytest
import torch

from nanokv import LLM, SamplingParams
from nanokv.bad_words import tokenize_bad_words
from tiny_models import hf_greedy, load_hf

SHIPPED = str(Path(__file__).resolve().parents[2] / "models" / "nanokv-tiny")
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, block_size=16, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def shipped():
    return LLM(SHIPPED, block_size=16, max_model_len=256)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def assert_no_blocks_held(llm):
    bm = llm.engine.block_manager
    llm.engine.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.has_unfinished_requests()


# ---- truncate_prompt_tokens ----------------------------------------------------------------------
def test_truncation_keeps_the_last_k_tokens_as_hf_greedy_on_them(llm, tiny_llama):
    """Token ids and text alike: the output is HF's greedy output for the prompt's last k
    tokens; prompt_token_ids are those k (vLLM's), prompt the text as given."""
    hf = load_hf(tiny_llama)
    ids = [(7 * i + 3) % 300 + 2 for i in range(90)]
    for k in (1, 10, 40):
        out = llm.generate([ids], greedy(8, truncate_prompt_tokens=k))[0]
        assert out.prompt_token_ids == ids[-k:]
        assert out.token_ids == hf_greedy(hf, ids[-k:], 8)[0]
    text = "The grass is green. The sky is blue. The sun is yellow. Here we go. " * 3
    full = llm.engine.tokenizer.encode(text)
    out = llm.generate([text], greedy(6, truncate_prompt_tokens=12))[0]
    assert out.prompt == text and out.prompt_token_ids == full[-12:]
    assert out.token_ids == hf_greedy(hf, full[-12:], 6)[0]
    short = llm.generate([ids[:5]], greedy(4, truncate_prompt_tokens=40))[0]
    assert short.prompt_token_ids == ids[:5]  # shorter prompts are kept whole
    assert_no_blocks_held(llm)


def test_truncation_minus_one_keeps_max_model_len_minus_one(llm):
    """-1: a prompt longer than max_model_len keeps its last max_model_len - 1 tokens, which
    leave room for one output token (vLLM's)."""
    ids = [(5 * i + 1) % 300 + 2 for i in range(3 * MAX_MODEL_LEN)]
    out = llm.generate([ids], greedy(8, truncate_prompt_tokens=-1))[0]
    assert out.prompt_token_ids == ids[-(MAX_MODEL_LEN - 1):]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True,
                                             truncate_prompt_tokens=100))[0]
    assert len(out.token_ids) == MAX_MODEL_LEN - 100  # max_tokens None: what the kept prompt leaves
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("k,fragment", [
    (0, r"truncate_prompt_tokens must be None, -1 .* or an integer >= 1"),
    (-2, r"truncate_prompt_tokens must be None, -1"),
    (True, r"truncate_prompt_tokens must be None, -1"),
    (MAX_MODEL_LEN + 1, rf"truncate_prompt_tokens must be -1 .* or an integer in \[1, "
                        rf"max_model_len={MAX_MODEL_LEN}\], got {MAX_MODEL_LEN + 1}"),
    (MAX_MODEL_LEN, "max_model_len 128 allows at most 127"),  # kept whole, still too long
])
def test_bad_truncation_is_refused_without_allocating(llm, k, fragment):
    params = greedy(4)
    params.truncate_prompt_tokens = k  # changed after construction: checked by the engine
    with pytest.raises(ValueError, match=fragment):
        llm.generate([[3, 4, 5], [6] * 200], [greedy(4), params])
    assert_no_blocks_held(llm)


# ---- bad_words ----------------------------------------------------------------------------------
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


def _sequences(llm, word):
    tok = llm.engine.tokenizer
    return tokenize_bad_words([word], lambda t: tok.encode(t, add_special_tokens=False),
                              llm.engine.hf_config.vocab_size)


def _word_in(llm, tokens, width):
    """A word whose token sequences hold `width` consecutive output tokens (a single-token
    word for width 1, a multi-token one for 2)."""
    tok = llm.engine.tokenizer
    for i in range(1, len(tokens) - width):
        window = tuple(tokens[i:i + width])
        word = tok.decode(list(window)).strip()
        if word.isalpha() and window in _sequences(llm, word):
            return word
    raise AssertionError(f"no {width}-token word in the greedy output {tokens}")


def _first_completion(tokens, sequences):
    """The first output index whose token completes one of `sequences`."""
    for q in range(len(tokens)):
        if any(tuple(tokens[max(0, q + 1 - len(s)):q + 1]) == s for s in sequences):
            return q
    return None


@pytest.mark.parametrize("width", [1, 2])
def test_bad_words_are_never_produced_and_the_rest_is_hf_greedy(shipped, width):
    """Greedy output with a word it produced banned: unchanged up to where the word would be
    completed; there, HF's argmax with the completing tokens removed; the word's token
    sequences (bare and after a space) nowhere in the output."""
    free = shipped.generate([PROMPT], greedy(40))[0]
    word = _word_in(shipped, free.token_ids, width)
    sequences = _sequences(shipped, word)
    q = _first_completion(free.token_ids, sequences)
    out = shipped.generate([PROMPT], greedy(40, bad_words=[word]))[0]
    assert _first_completion(out.token_ids, sequences) is None
    assert out.token_ids[:q] == free.token_ids[:q] and len(out.token_ids) == 40
    hf = load_hf(SHIPPED)
    with torch.no_grad():
        logits = hf(torch.tensor([out.prompt_token_ids + out.token_ids[:q]])).logits[0, -1]
    banned = [s[-1] for s in sequences if tuple(out.token_ids[q - len(s) + 1:q]) == s[:-1]]
    assert free.token_ids[q] in banned
    logits[banned] = float("-inf")
    assert out.token_ids[q] == int(logits.argmax())
    assert_no_blocks_held(shipped)


def test_bad_words_match_the_output_only(shipped):
    """A prompt that ends with a bad word's first token: the word's completing token stays
    allowed as the first output token (vLLM matches the output only, not the prompt), and is
    banned once that first token is in the output."""
    free = shipped.generate([PROMPT], greedy(40))[0]
    word = _word_in(shipped, free.token_ids, 2)
    sequences = _sequences(shipped, word)
    q = _first_completion(free.token_ids, sequences)
    prompt = free.prompt_token_ids + free.token_ids[:q]  # ends with the word's first token
    out = shipped.generate([prompt], greedy(1, bad_words=[word]))[0]
    assert out.token_ids == free.token_ids[q:q + 1]
    out = shipped.generate([prompt[:-1]], greedy(2, bad_words=[word]))[0]
    assert out.token_ids[0] == prompt[-1] and out.token_ids[1] != free.token_ids[q]


def test_bad_words_need_a_tokenizer_and_valid_words(shipped, tiny_llama):
    for words, fragment in [([" "], "bad_words entries must tokenize to at least one token"),
                            ([f"w{i}" for i in range(200)], "at most 128"),
                            ([""], "bad_words must be None or a list of non-empty strings"),
                            ("word", "bad_words must be None or a list of non-empty strings")]:
        params = greedy(4)
        params.bad_words = words
        with pytest.raises(ValueError, match=fragment):
            shipped.generate([[3, 4, 5], [6, 7]], [greedy(4), params])
        assert_no_blocks_held(shipped)
    bare = LLM(tiny_llama, block_size=16, max_model_len=64, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="bad_words .* skip_tokenizer_init=True"):
        bare.generate([[3, 4, 5]], greedy(4, bad_words=["a"]))
    assert_no_blocks_held(bare)
