"""benchmarks/bench_compaction_memory.py: one compaction over a small store runs and reports
what it measured (the dense size from the shape, a growth below it, half the tokens kept)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_compaction_memory  # noqa: E402


@pytest.mark.parametrize("policy", ["knorm", "streaming"])
def test_reports_one_compaction(capsys, policy):
    bench_compaction_memory.main(["--tokens", "200", "--layers", "3", "--kv-heads", "2",
                                  "--head-dim", "32", "--policy", policy])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["tokens"] == 200 and row["policy"] == policy
    assert row["dense_kv_gib"] == round(2 * 3 * 200 * 2 * 32 * 4 / 2**30, 3)
    assert row["plan_s"] > 0 and row["apply_s"] > 0 and row["peak_rss_growth_gib"] >= 0


def test_refuses_a_request_under_four_blocks():
    with pytest.raises(SystemExit):
        bench_compaction_memory.main(["--tokens", "32"])
