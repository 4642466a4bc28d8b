"""User errors on the command line: exit 2 with one line naming the flag or the file, before any
work is done; never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanokv.cli import main

TINY = str(Path(__file__).resolve().parents[2] / "models" / "nanokv-tiny")
SIM = ["--model-config", TINY, "--kv-memory", "64MiB"]


def run(argv, capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err[-1] if err else ""


@pytest.mark.parametrize("argv,fragment", [
    (["simulate", "--trace", "/nonexistent/t.jsonl", *SIM],
     "No such file or directory: /nonexistent/t.jsonl"),
    (["simulate", "--workload", "chat", *SIM, "--step-model", "/nonexistent/m.json"],
     "No such file or directory: /nonexistent/m.json"),
    (["simulate", "--workload", "chat", *SIM, "--num-requests", "3", "--save-trace",
      "/nonexistent/t.jsonl"], "No such file or directory: /nonexistent/t.jsonl"),
    (["simulate", "--workload", "rag", *SIM, "--max-num-seqs-sim", "0"],
     "--max-num-seqs-sim: expected integers >= 1"),
    (["advise", "--workload", "rag", *SIM, "--max-num-seqs", "8,0"],
     "--max-num-seqs: expected integers >= 1"),
    (["advise", "--workload", "rag", *SIM, "--kv-dtypes", "int8,bogus"],
     "--kv-dtypes: unknown kv_cache_dtype ['bogus']; allowed: auto, int8"),
    (["advise", "--workload", "rag", *SIM, "--block-sizes", "16,x"],
     "--block-sizes: expected comma-separated integers"),
    (["eval", "--model", TINY, "--compressions", "abc"],
     "--compressions must be comma-separated numbers"),
])
def test_user_errors_exit_2_with_one_line(argv, fragment, capsys):
    rc, last = run(argv, capsys)
    assert rc == 2 and fragment in last, last


def test_a_step_model_that_is_not_json_is_named(tmp_path, capsys):
    bad = tmp_path / "model.json"
    bad.write_text("not json")
    rc, last = run(["simulate", "--workload", "chat", *SIM, "--step-model", str(bad)], capsys)
    assert rc == 2 and f"{bad} is not a fitted step model" in last


def test_checks_come_before_the_work(monkeypatch, capsys):
    """A bad policy name or output location fails before the first model is loaded."""
    import nanokv.eval.harness
    import nanokv.workloads.run

    def no_work(*args, **kwargs):
        raise AssertionError("ran before the arguments were checked")

    monkeypatch.setattr(nanokv.eval.harness, "run_eval", no_work)
    monkeypatch.setattr(nanokv.workloads.run, "run_bench", no_work)
    rc, last = run(["eval", "--model", TINY, "--policies", "full,bogus"], capsys)
    assert rc == 2 and "unknown KV policy ['bogus']" in last
    rc, last = run(["bench", "--model", TINY, "--step-model-out", "/nonexistent/x.json"],
                   capsys)
    assert rc == 2 and "--step-model-out: the directory of '/nonexistent/x.json'" in last


def test_unreadable_calibration_files(tmp_path):
    from nanokv.quant.calibration_file import load_calibration

    binary = tmp_path / "binary.json"
    binary.write_bytes(b"{\x80\x81")
    with pytest.raises(ValueError, match="cannot read calibration file .*binary.json"):
        load_calibration(binary)
