"""vLLM's bad_words: tokenization rules, the tokens that complete a word, the scheduler's bans."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from nanokv.bad_words import MAX_BAD_WORDS, completing_tokens, tokenize_bad_words
from nanokv.request import Request
from nanokv.sampling_params import SamplingParams
from nanokv.scheduler.scheduler import Scheduler

SHIPPED = str(Path(__file__).resolve().parents[2] / "models" / "nanokv-tiny")
VLLM_PYTHON = "/work/.vllm-venv/bin/python"
WORDS = ["is", "sur", " the", "x y", "  lazy dog", "The", "fox", "\u00e9t\u00e9", "0x3"]


def _encode():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SHIPPED)
    return lambda text: tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("seed", range(5))
def test_completing_tokens_are_those_that_would_end_the_output_with_a_bad_word(seed):
    """Oracle: token t is banned exactly when output + [t] ends with one of the sequences."""
    rng = random.Random(seed)
    for _ in range(200):
        sequences = [tuple(rng.randrange(5) for _ in range(rng.randint(1, 4)))
                     for _ in range(rng.randint(1, 4))]
        output = [rng.randrange(5) for _ in range(rng.randint(0, 6))]
        expected = {t for t in range(5) for s in sequences
                    if len(s) <= len(output) + 1 and (output + [t])[-len(s):] == list(s)}
        assert set(completing_tokens(sequences, output)) == expected


@pytest.mark.skipif(not os.path.exists(VLLM_PYTHON), reason="no vLLM installation to compare")
def test_tokenization_equals_vllms():
    """vLLM's own SamplingParams.update_from_tokenizer, run in its environment on the same
    tokenizer: the same token sequences, in the same order."""
    script = ("import json, sys\n"
              "from transformers import AutoTokenizer\n"
              "from vllm.sampling_params import SamplingParams\n"
              "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
              "tok.max_token_id = len(tok) - 1\n"
              "p = SamplingParams(bad_words=json.loads(sys.argv[2]))\n"
              "p.update_from_tokenizer(tok)\n"
              "print(json.dumps(p.bad_words_token_ids))\n")
    run = subprocess.run([VLLM_PYTHON, "-c", script, SHIPPED, json.dumps(WORDS)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    expected = [tuple(s) for s in json.loads(run.stdout.strip().splitlines()[-1])]
    assert list(tokenize_bad_words(WORDS, _encode(), 4096)) == expected


def test_tokenization_errors():
    encode = _encode()
    with pytest.raises(ValueError, match="bad_words entries must tokenize to at least one"):
        tokenize_bad_words(["   "], encode, 4096)
    with pytest.raises(ValueError, match=f"at most {MAX_BAD_WORDS} are allowed"):
        tokenize_bad_words([f"w{i}" for i in range(MAX_BAD_WORDS + 1)], encode, 4096)
    with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, 10\)"):
        tokenize_bad_words(["the"], encode, 10)


def test_sampling_params_keep_each_word_once():
    assert SamplingParams(bad_words=("a", "b", "a")).bad_words == ["a", "b"]
    assert SamplingParams(bad_words=None).bad_words is None


def test_scheduler_bans_completions_beside_min_tokens():
    params = SamplingParams(min_tokens=2, stop_token_ids=[9])
    request = Request("r", [1, 2, 3], params, eos_token_ids=(0,))
    request.bad_words_token_ids = ((4,), (5, 6), (7, 5, 8))
    assert Scheduler._banned(request, []) == [(0, 9, 4)]
    request.output_token_ids = [7, 5]
    assert Scheduler._banned(request, []) == [(4, 6, 8)]  # min_tokens reached: the words alone
    request.output_token_ids = [7, 6]
    assert Scheduler._banned(request, []) == [(4,)]
    # speculative drafts: row j as if drafts[:j] were outputs
    request.output_token_ids = [7]
    assert Scheduler._banned(request, [5, 1]) == [(0, 9, 4), (4, 6, 8), (4,)]
    plain = Request("p", [1, 2, 3], SamplingParams(), eos_token_ids=(0,))
    plain.output_token_ids = [5]
    assert Scheduler._banned(plain, []) == [] and Scheduler._banned(plain, [6, 5]) == []
