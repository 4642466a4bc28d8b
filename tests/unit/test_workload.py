"""Tests for the synthetic benchmark workload (nanokv/workloads/workload.py)."""

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nanokv.workloads.workload import BenchRequest, BenchResult, make_workload, summarize

WORKLOAD_PY = Path(__file__).resolve().parents[2] / "nanokv" / "workloads" / "workload.py"


def test_deterministic_in_seed():
    a = make_workload(16, (64, 256), (32, 128), 151936, seed=0)
    b = make_workload(16, (64, 256), (32, 128), 151936, seed=0)
    c = make_workload(16, (64, 256), (32, 128), 151936, seed=1)
    assert a == b
    assert a != c


def test_lengths_and_ids_in_range():
    reqs = make_workload(200, (3, 9), (1, 4), vocab_size=50, seed=7)
    assert len(reqs) == 200
    assert all(isinstance(r, BenchRequest) for r in reqs)
    prompt_lens = {len(r.prompt_token_ids) for r in reqs}
    out_lens = {r.output_len for r in reqs}
    assert prompt_lens == set(range(3, 10))  # inclusive on both ends
    assert out_lens == {1, 2, 3, 4}
    ids = {t for r in reqs for t in r.prompt_token_ids}
    assert min(ids) >= 0 and max(ids) < 50


def test_token_ids_capped_at_10000():
    reqs = make_workload(50, (100, 100), (1, 1), vocab_size=151936, seed=3)
    ids = [t for r in reqs for t in r.prompt_token_ids]
    assert max(ids) < 10000
    assert all(isinstance(t, int) for t in ids)


def test_fixed_lengths():
    reqs = make_workload(4, (5, 5), (2, 2), vocab_size=1, seed=0)
    assert all(r.prompt_token_ids == [0] * 5 and r.output_len == 2 for r in reqs)
    assert reqs[0].prompt_len == 5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_requests": 0}, "num_requests"),
        ({"num_requests": 2.0}, "num_requests"),
        ({"num_requests": True}, "num_requests"),
        ({"prompt_len": (0, 5)}, "prompt_len min"),
        ({"prompt_len": (5, 4)}, "prompt_len max"),
        ({"prompt_len": (5,)}, "prompt_len must be a pair"),
        ({"prompt_len": (1.5, 4)}, "prompt_len must be a pair"),
        ({"output_len": (0, 1)}, "output_len min"),
        ({"output_len": (3, 2)}, "output_len max"),
        ({"output_len": None}, "output_len must be a pair"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"seed": "0"}, "seed"),
    ],
)
def test_validation(kwargs, match):
    args = {"num_requests": 2, "prompt_len": (1, 4), "output_len": (1, 4), "vocab_size": 100}
    args["seed"] = 0
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        make_workload(**args)


def test_request_is_frozen():
    r = make_workload(1, (2, 2), (1, 1), 10, 0)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.output_len = 5  # type: ignore[misc]


def test_summarize_counts_useful_tokens():
    reqs = [BenchRequest([1, 2, 3], 4), BenchRequest([5] * 7, 6)]
    res = summarize("x", reqs, elapsed_s=2.0, ttfts_s=[0.1, 0.3, 0.2], tpots_s=[], peak_kv_blocks=9,
                    peak_running=2, num_preemptions=1)
    assert res.num_requests == 2
    assert res.output_tokens == 10
    assert res.total_tokens == 20
    assert res.output_tok_s == pytest.approx(5.0)
    assert res.total_tok_s == pytest.approx(10.0)
    assert res.ttft_median_s == pytest.approx(0.2)
    assert res.tpot_median_s is None
    assert (res.peak_kv_blocks, res.peak_running, res.num_preemptions) == (9, 2, 1)
    with pytest.raises(ValueError):
        summarize("x", reqs, elapsed_s=0.0)


def test_result_json_round_trip():
    res = summarize("hf", [BenchRequest([1], 2)], elapsed_s=0.5)
    line = res.to_json()
    assert "\n" not in line
    data = json.loads(line)
    assert list(data) == [
        "engine",
        "num_requests",
        "output_tokens",
        "total_tokens",
        "elapsed_s",
        "output_tok_s",
        "total_tok_s",
        "ttft_median_s",
        "tpot_median_s",
        "peak_kv_blocks",
        "peak_running",
        "num_preemptions",
        "spec_acceptance_rate",
    ]
    assert BenchResult.from_json(line) == res
    # Unknown keys from other engines' output are ignored.
    assert BenchResult.from_json(json.dumps({**data, "extra": 1})) == res


def test_loadable_by_path_without_torch():
    """The peer scripts load workload.py by file path in another venv: it must not need torch."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('wl', {str(WORKLOAD_PY)!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['wl'] = m\n"
        "spec.loader.exec_module(m)\n"
        "assert 'torch' not in sys.modules, 'workload.py imported torch'\n"
        "print(len(m.make_workload(3, (2, 4), (1, 2), 100, 0)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "3"
    spec = importlib.util.spec_from_file_location("wl_same", WORKLOAD_PY)
    assert spec is not None
