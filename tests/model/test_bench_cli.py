"""`nanokv bench` end to end on a tiny model: every requested output token is produced, greedy or
sampled, and bad options fail before the model loads."""

import json

import pytest

from nanokv.workloads.run import run_bench
from nanokv.workloads.workload import make_workload
from nanokv.cli import main
from tiny_models import VOCAB


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_bench_produces_every_requested_token(tiny_llama, temperature):
    result = run_bench(tiny_llama, {"block_size": 16, "max_model_len": 128}, 5, (8, 40), (3, 9),
                       seed=4, verbose=False, temperature=temperature)
    workload = make_workload(5, (8, 40), (3, 9), VOCAB, 4)
    assert result.output_tokens == sum(r.output_len for r in workload)
    assert result.num_requests == 5 and result.peak_kv_blocks >= 5


def test_bench_cli_json_and_bad_temperature(tiny_llama, capsys):
    args = ["bench", "--model", tiny_llama, "--num-requests", "3", "--prompt-len", "8", "16",
            "--output-len", "2", "4", "--block-size", "16", "--max-model-len", "64", "--json"]
    assert main(args + ["--temperature", "0.5"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["engine"] == "nanokv" and line["output_tokens"] > 0
    assert line["peak_running"] >= 1 and line["num_preemptions"] == 0
    assert line["spec_acceptance_rate"] is None
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    assert main(args + ["--speculative-config", spec, "--output-len", "16", "24"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 <= line["spec_acceptance_rate"] <= 1
    assert main(args + ["--temperature", "-1"]) == 2
    assert "temperature must be a finite number >= 0" in capsys.readouterr().err


def test_bench_reports_peak_running_and_preemptions(tiny_llama):
    # 3 requests of 40 prompt + 24 output tokens, 16-token blocks: a prompt takes 3 blocks, a
    # whole request 4 (63 slots; the last sampled token is never computed)
    def bench(**options):
        return run_bench(tiny_llama, {"block_size": 16, "max_model_len": 64, **options}, 3,
                         (40, 40), (24, 24), seed=0, verbose=False, progress=False)

    roomy = bench(num_kv_blocks=12)  # room for all three at full length
    assert (roomy.peak_running, roomy.num_preemptions) == (3, 0)
    capped = bench(num_kv_blocks=12, max_num_seqs=2)
    assert (capped.peak_running, capped.num_preemptions) == (2, 0)
    # 6 blocks hold two prompts; the first to outgrow its 3rd block evicts the newest request
    tight = bench(num_kv_blocks=6)
    assert tight.peak_running == 2 and tight.num_preemptions >= 1
    assert tight.output_tokens == roomy.output_tokens
