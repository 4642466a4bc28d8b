"""benchmarks/ab_panel_linear.py: the same checkout on both sides gives the same outputs (one
library, called in turn), a ratio per weight and row count, and refuses bad flags."""

import json
from pathlib import Path

import pytest

from benchmark_scripts import load_benchmark
from nanokv.layers import native_linear
from nanokv.layers.native_attention import NativeKernelUnavailable

ROOT = Path(__file__).resolve().parents[2]

try:
    native_linear.load_panel_linear()
except NativeKernelUnavailable as e:  # no C compiler with OpenMP here
    pytest.skip(f"panel kernel unavailable: {e}", allow_module_level=True)


pytestmark = pytest.mark.usefixtures("keep_torch_threads")  # the tool sets its threads


def _tool():
    return load_benchmark("ab_panel_linear")


def test_same_checkout_both_sides(tmp_path):
    out = tmp_path / "ab.json"
    tool = _tool()
    tool.main(["--before", str(ROOT), "--rows", "1", "7", "--rounds", "4", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["weight"], r["rows"]) for r in rows] == [
        (name, m) for name in tool.LAYER_WEIGHTS for m in (1, 7)]
    for r in rows:
        assert (r["n"], r["k"]) == tool.LAYER_WEIGHTS[r["weight"]]
        assert r["max_abs_diff"] == 0.0  # one library on both sides
        assert r["before_ms"] > 0 and r["after_ms"] > 0
        assert r["ratio_q1"] <= r["ratio_median"] <= r["ratio_q3"]


def test_decode_step_both_sides(tmp_path, monkeypatch):
    """--decode-step: one row per row count over every layer's weights and the head, in order;
    small shapes here (the tool's are Qwen3-0.6B's: 874 MB at 4 layers)."""
    tool = _tool()
    monkeypatch.setattr(tool, "LAYER_WEIGHTS", {"qkv": (96, 40), "o": (40, 64),
                                                "gate_up": (130, 40), "down": (40, 65)})
    monkeypatch.setattr(tool, "HEAD_WEIGHT", {"lm_head": (300, 40)})
    out = tmp_path / "ab.json"
    tool.main(["--before", str(ROOT), "--decode-step", "2", "--rows", "1", "3", "8",
               "--rounds", "4", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["layers"], r["rows"]) for r in rows] == [(2, 1), (2, 3), (2, 8)]
    for r in rows:
        assert r["max_abs_diff"] == 0.0
        assert r["before_ms"] > 0 and r["after_ms"] > 0
        assert r["ratio_q1"] <= r["ratio_median"] <= r["ratio_q3"]


@pytest.mark.parametrize("argv,message", [
    (["--rounds", "3"], "--rounds"),
    (["--rows", "0"], "--rows"),
    (["--threads", "0"], "--threads"),
    (["--decode-step", "-1"], "--decode-step"),
    (["--after", "/nonexistent"], "not found"),
])
def test_bad_flags_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        _tool().main(["--before", str(ROOT), *argv])
    assert message in capsys.readouterr().err
