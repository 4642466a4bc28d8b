"""benchmarks/bench_triton_attention.py --sweep-contexts, dry-run in Triton's interpreter: every
cache's decode kernel equal to the dense float32 reference the sweep reads back from the cache
(the check the sweep reports on a GPU), its rows and table written, and the launch variants
(splits, warps, key tiles) giving the default launch's output."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from nanokv.attention import triton_paged  # noqa: E402

if not triton_paged.interpreter_on():
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it)",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_triton_attention  # noqa: E402


def test_sweep_rows_match_the_dense_reference(tmp_path):
    bench_triton_attention.main([
        "--device", "cpu", "--sweep-contexts", "5", "40", "--sweep-requests", "1", "2",
        "--q-heads", "4", "--kv-heads", "2", "--head-dim", "32", "--repeats", "1",
        "--kv-dtypes", "auto", "int8", "kvquant", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "triton_decode_sweep.json").read_text())["rows"]
    assert [(r["kv_cache_dtype"], r["requests"], r["context"]) for r in rows] == [
        (kind, n, c) for n in (1, 2) for c in (5, 40) for kind in ("auto", "int8", "kvquant")]
    for r in rows:
        assert r["max_abs_err"] < 1e-4, r
        assert r["triton_ms"] > 0 and r["cache_bytes_per_token"] > 0
    assert rows[0]["vs_first"] == 1.0
    assert "| kvquant | 2 | 40 |" in (tmp_path / "triton_decode_sweep.md").read_text()



def test_launch_variants_give_the_default_output(tmp_path):
    bench_triton_attention.main([
        "--device", "cpu", "--sweep-contexts", "20", "--sweep-requests", "1", "--q-heads", "2",
        "--kv-heads", "1", "--head-dim", "32", "--repeats", "1", "--kv-dtypes", "int8",
        "kvquant", "--sweep-variants", "--out", str(tmp_path)])
    variants = json.loads((tmp_path / "triton_launch_variants.json").read_text())["rows"]
    launches = {r["launch"] for r in variants if r["kv_cache_dtype"] == "kvquant"}
    assert {"default", "num_splits=16", "num_splits=64", "num_stages=1", "num_warps=2", "unroll=2",
            "unroll=4 num_warps=8"} <= launches
    int8 = {r["launch"] for r in variants if r["kv_cache_dtype"] == "int8"}
    assert {"default", "num_splits=64", "num_stages=2", "tile_n=256 num_warps=8",
            "tile_n=64 num_stages=1 num_splits=32"} <= int8
    for r in variants:
        assert (r["requests"], r["context"]) == (1, 20)
        assert r["max_abs_diff_vs_default"] < 1e-5, r


def test_step_mode_rows(tmp_path, capsys):
    """The default mode (one layer's step, the PyTorch backend vs the Triton one) runs every
    cache, KVQuant's attention alone: its decode, and its prefill over cached prefixes, whose
    two outputs agree."""
    bench_triton_attention.main([
        "--device", "cpu", "--requests", "2", "--min-context", "20", "--max-context", "40",
        "--prefill-chunks", "2", "--chunk-len", "16", "--q-heads", "4", "--kv-heads", "2",
        "--head-dim", "32", "--repeats", "1", "--kv-dtypes", "auto", "kvquant",
        "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "triton_attention.json").read_text())["rows"]
    assert [(r["kv_cache_dtype"], r["step"]) for r in rows] == [
        ("auto", "decode"), ("auto", "prefill"), ("kvquant", "decode"), ("kvquant", "prefill")]
    assert all(r["torch_ms"] > 0 and r["triton_ms"] > 0 for r in rows)
    diffs = [json.loads(line)["kvquant_prefill_max_abs_diff"]
             for line in capsys.readouterr().out.splitlines() if "prefill_max_abs_diff" in line]
    assert len(diffs) == 1 and diffs[0] < 1e-4, diffs  # float32 on CPU


@pytest.mark.parametrize("argv,message", [
    (["--kv-heads", "3"], "--q-heads must be a multiple of --kv-heads"),
    (["--min-context", "9", "--max-context", "8"], "--min-context must not exceed"),
    (["--sweep-contexts", "0"], "positive numbers"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--sweep-variants"], "--sweep-variants needs --sweep-contexts"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_triton_attention.main(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err
