"""benchmarks/bench_hf.py (the Hugging Face peer, also gpu_check's on CUDA): the same requests as
`nanokv bench` draws for the same arguments, every one's output counted, bad lengths refused."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_hf  # noqa: E402

from nanokv.workloads.workload import make_workload  # noqa: E402

MODEL = str(Path(__file__).resolve().parents[2] / "models" / "nanokv-tiny")


def test_counts_the_shared_workloads_outputs(capsys):
    bench_hf.main(["--model", MODEL, "--num-requests", "3", "--prompt-len", "8", "16",
                   "--output-len", "4", "8", "--device", "cpu"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(MODEL).vocab_size
    requests = make_workload(3, (8, 16), (4, 8), vocab, 0)
    assert result["engine"] == "hf" and result["num_requests"] == 3
    assert result["output_tokens"] == sum(r.output_len for r in requests)
    assert result["output_tok_s"] > 0


@pytest.mark.parametrize("argv,message", [
    (["--prompt-len", "5", "2"], "--prompt-len takes MIN MAX"),
    (["--output-len", "0", "2"], "--output-len takes MIN MAX"),
    (["--num-requests", "0"], "--num-requests must be at least 1"),
    (["--device", "gpu"], "--device takes cpu or cuda"),
    (["--device", "meta"], "--device takes cpu or cuda"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_hf.main(["--model", MODEL, *argv])
    assert message in capsys.readouterr().err
