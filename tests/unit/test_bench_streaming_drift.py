"""benchmarks/bench_streaming_drift.py: both slide modes run over a quantized store and report an
error per slide, in the sinks' block and in the others; over int8 (per-token codes, re-written
exactly) both stay at one rounding."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_streaming_drift  # noqa: E402


@pytest.mark.parametrize("kind", [["int8"], ["kvquant", "--bits", "4"]])
def test_reports_both_slides(capsys, kind):
    bench_streaming_drift.main(["--kv-cache-dtype", *kind, "--prompt", "70", "--budget", "48",
                                "--slides", "4"])
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["slide"] for r in rows] == ["token", "block"]
    for row in rows:
        for errors in (row["sinks_block_error"], row["other_blocks_error"]):
            assert len(errors) == 4 and all(0 < e < 1 for e in errors)
            if kind == ["int8"]:
                assert max(errors) < 0.02


def test_full_precision_sinks_do_not_drift(capsys):
    """KVQuant keeping StreamingLLM's sinks at full precision (num_sink_tokens >= n_sink): the
    token slide re-writes the sinks' block at every slide, yet the sinks keep their one fp16
    rounding (the sink rows' dtype); with one full-precision sink the other three are rounded
    again at every slide."""
    for sinks in ("4", "1"):
        bench_streaming_drift.main(["--kv-cache-dtype", "kvquant", "--bits", "4", "--prompt",
                                    "70", "--budget", "48", "--slides", "6", "--kvquant-sinks",
                                    sinks])
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    full, one = rows[0], rows[2]  # the token slides
    assert full["slide"] == one["slide"] == "token"
    assert len(set(full["sinks_error"])) == 1 and full["sinks_error"][0] < 1e-3
    assert min(one["sinks_error"]) > 0.01


def test_refuses_a_prompt_within_the_budget():
    with pytest.raises(SystemExit):
        bench_streaming_drift.main(["--prompt", "40", "--budget", "40"])
    with pytest.raises(SystemExit):
        bench_streaming_drift.main(["--kv-cache-dtype", "int8", "--kvquant-sinks", "4"])
