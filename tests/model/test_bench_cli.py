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
    assert main(args + ["--temperature", "-1"]) == 2
    assert "temperature must be a finite number >= 0" in capsys.readouterr().err
