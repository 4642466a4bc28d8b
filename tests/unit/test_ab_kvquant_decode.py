"""benchmarks/ab_kvquant_decode.py: the same checkout on both sides gives the same outputs (the
one library, called in turn), a ratio per shape, and refuses bad flags."""

import json
from pathlib import Path

import pytest

from benchmark_scripts import load_benchmark
from nanokv.layers.native_attention import NativeKernelUnavailable
from nanokv.layers.native_quant_attention import load_quant_kernels

ROOT = Path(__file__).resolve().parents[2]

try:
    load_quant_kernels()
except NativeKernelUnavailable as e:  # no C compiler with OpenMP here
    pytest.skip(f"quantized kernels unavailable: {e}", allow_module_level=True)


pytestmark = pytest.mark.usefixtures("keep_torch_threads")  # the tool sets its threads


def _tool():
    return load_benchmark("ab_kvquant_decode")


def test_same_checkout_both_sides(tmp_path, monkeypatch):
    import nanokv.layers.native_quant_attention as nqa

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    own = nqa._LIBRARY
    out = tmp_path / "ab.json"
    _tool().main(["--before", str(ROOT), "--requests", "2", "--contexts", "40", "--bits", "4",
                  "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64",
                  "--block-size", "16", "--rounds", "4", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["requests"], r["context"], r["bits"]) for r in rows] == [(2, 40, 4), (2, 40, 2)]
    for r in rows:
        assert r["max_abs_diff"] == 0.0  # one library on both sides
        assert r["before_us_per_token"] > 0 and r["after_us_per_token"] > 0
        assert r["ratio_q1"] <= r["ratio_median"] <= r["ratio_q3"]
    # the process's own library is back (the A/B's lack the switches' typing: a later call
    # of a switch through one of them got an untyped argument)
    assert nqa._LIBRARY is own


@pytest.mark.parametrize("store", ["int8", "fp8_e4m3"])
def test_per_token_stores_both_sides(tmp_path, monkeypatch, store):
    """--store times the per-token kernel: one row per shape (--bits ignored), equal outputs."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "ab.json"
    _tool().main(["--before", str(ROOT), "--store", store, "--requests", "2", "--contexts",
                  "40", "70", "--bits", "4", "2", "--q-heads", "4", "--kv-heads", "2",
                  "--head-dim", "64", "--block-size", "16", "--rounds", "4", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["store"], r["context"], r["bits"]) for r in rows] == [(store, 40, None),
                                                                   (store, 70, None)]
    for r in rows:
        assert r["max_abs_diff"] == 0.0
        assert r["before_us_per_token"] > 0 and r["after_us_per_token"] > 0


@pytest.mark.parametrize("argv,message", [
    (["--rounds", "3"], "--rounds"),
    (["--contexts", "0"], "--contexts"),
    (["--q-heads", "3", "--kv-heads", "2"], "multiple"),
    (["--after", "/nonexistent"], "not found"),
    (["--store", "float32"], "--store"),
])
def test_bad_flags_are_refused(argv, message, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(SystemExit):
        _tool().main(["--before", str(ROOT), *argv])
    assert message in capsys.readouterr().err


def test_more_than_one_thread_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    with pytest.raises(SystemExit):
        _tool().main(["--before", str(ROOT)])
    assert "OMP_NUM_THREADS=1" in capsys.readouterr().err
