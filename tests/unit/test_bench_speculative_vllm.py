"""benchmarks/bench_speculative_vllm.py without vLLM: its prompts are bench_speculative.py's,
and its flags are checked before vLLM is imported."""

import subprocess
import sys

from benchmark_scripts import BENCHMARKS, load_benchmark


def test_its_prompts_are_the_nanokv_benchmarks():
    peer = load_benchmark("bench_speculative_vllm")
    ours = load_benchmark("bench_speculative")
    args = (1000, 3, 48, 3, 0)
    assert peer.make_prompts_fn()(*args) == ours.make_prompts(*args)
    assert len(ours.make_prompts(*args)[0]) == 48 * 3 + 24


def test_bad_flags_are_refused_before_vllm_is_needed():
    script = str(BENCHMARKS / "bench_speculative_vllm.py")
    for flags, says in ((["--k", "-1"], "--k must be >= 0"),
                        (["--prompts", "0"], "--prompts must be >= 1"),
                        (["--prompt-lookup-min", "4"], "--prompt-lookup-min")):
        r = subprocess.run([sys.executable, script, "--model", "x", *flags],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and says in r.stderr, r.stderr
