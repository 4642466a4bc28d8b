"""scripts/gpu_profile_decode.py dry-run on CPU (`--device cpu`): the prefill timed, the decode
steps profiled, the figures written under the cache dtype's name (and the PyTorch write's, for
the A/B of a kvquant store's write kernels); bad arguments refused."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import gpu_profile_decode  # noqa: E402

MODEL = str(Path(__file__).resolve().parents[2] / "models" / "nanokv-tiny")


@pytest.mark.parametrize("kv,write,name", [
    ("auto", "kernel", "profile_decode"), ("kvquant", "kernel", "profile_decode_kvquant"),
    ("kvquant", "torch", "profile_decode_kvquant_torch_write")])
def test_dry_run_writes_the_figures(tmp_path, kv, write, name):
    assert gpu_profile_decode.main([
        "--model", MODEL, "--out", str(tmp_path), "--device", "cpu", "--requests", "3",
        "--prompt-len", "40", "--steps", "2", "--kv-cache-dtype", kv,
        "--kvquant-write", write]) == 0
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["kv_cache_dtype"] == kv and result["requests"] == 3
    assert result["kvquant_write"] == write
    assert result["prefill_s"] > 0 and result["prefill_steps"] >= 1
    assert len(result["eager"]["step_wall_ms"]) == 2
    assert (tmp_path / f"{name}_eager.txt").read_text().strip()


@pytest.mark.parametrize("argv,message", [
    (["--requests", "0"], "--requests must be at least 1"),
    (["--prompt-len", "4000"], "--prompt-len must be under 4000"),
    (["--kvquant-write", "torch"], "--kvquant-write torch takes --kv-cache-dtype kvquant"),
])
def test_bad_arguments_are_refused(tmp_path, argv, message, capsys):
    with pytest.raises(SystemExit):
        gpu_profile_decode.main(["--model", MODEL, "--out", str(tmp_path), "--device", "cpu",
                                 *argv])
    assert message in capsys.readouterr().err
