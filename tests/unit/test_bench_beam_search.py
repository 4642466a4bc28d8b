"""benchmarks/bench_beam_search.py and its vLLM peer script (which loads this one's prompts and
flags) without vLLM: the prompts, the comparison of their sequences, the peer's JSON line found
among its logs, and flags refused before any engine (or vLLM) is needed."""

import subprocess
import sys

import pytest

from benchmark_scripts import BENCHMARKS, load_benchmark


def test_the_prompts_are_seeded_token_ids_past_the_specials():
    make = load_benchmark("bench_beam_search").make_prompts
    prompts = make(500, 3, 40)
    assert prompts == make(500, 3, 40) and prompts != make(500, 3, 40, seed=1)
    assert len(prompts) == 3 and all(len(p) == 40 and 10 <= min(p) and max(p) < 500
                                     for p in prompts)


def test_compare_counts_prompts_with_the_same_sequences_in_order():
    compare = load_benchmark("bench_beam_search").compare
    a = [[{"tokens": [1, 2], "cum_logprob": -1.0}, {"tokens": [1, 3], "cum_logprob": -2.0}],
         [{"tokens": [5], "cum_logprob": -0.5}]]
    b = [[{"tokens": [1, 2], "cum_logprob": -1.25}, {"tokens": [1, 3], "cum_logprob": -2.0}],
         [{"tokens": [6], "cum_logprob": -0.5}]]
    assert compare(a, b) == {"prompts_same": 1, "prompts": 2, "max_cum_logprob_diff": 0.25}
    swapped = [list(reversed(a[0])), a[1]]
    assert compare(swapped, a)["prompts_same"] == 1  # the order counts


def test_the_peer_line_is_found_among_logs(tmp_path):
    read = load_benchmark("bench_beam_search").vllm_result
    out = tmp_path / "v.txt"
    out.write_text('INFO starting\n{"engine": "vllm", "median_s": 1.5}\nINFO done\n')
    assert read(str(out)) == {"engine": "vllm", "median_s": 1.5}
    out.write_text("INFO nothing\n")
    with pytest.raises(ValueError, match="no line starting"):
        read(str(out))


@pytest.mark.parametrize("script,flags,says", [
    ("bench_beam_search_vllm.py", ["--beam-width", "11"], "--beam-width must be in [1, 10]"),
    ("bench_beam_search_vllm.py", ["--prompts", "0"], "--prompts must be >= 1"),
    ("bench_beam_search.py", ["--max-tokens", "0"], "--max-tokens must be >= 1"),
    ("bench_beam_search.py", ["--hf"], "--hf needs --ignore-eos"),
    ("bench_decode_rows.py", ["--rows", "1"], "--rows >= 2"),
])
def test_bad_flags_are_refused_first(script, flags, says):
    r = subprocess.run([sys.executable, str(BENCHMARKS / script), "--model", "x", *flags],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and says in r.stderr, r.stderr
