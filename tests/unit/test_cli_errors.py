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
    (["simulate", "--workload", "chat", *SIM, "--block-size", "0"],
     "--block-size: expected integers >= 1"),
    (["simulate", "--workload", "chat", *SIM, "--block-size", "8"],
     "block size must be an integer in [16, 1024]"),
    (["simulate", "--workload", "chat", *SIM, "--max-num-batched-tokens", "0"],
     "--max-num-batched-tokens: expected integers >= 1"),
    (["simulate", "--workload", "chat", *SIM, "--max-model-len", "0"],
     "--max-model-len: expected integers >= 1"),
    (["simulate", "--workload", "chat", *SIM, "--rate", "nan"],
     "--rate: expected finite numbers > 0"),
    (["simulate", "--workload", "chat", *SIM, "--compression-ratio", "1"],
     "compression ratio (fraction removed) must be in [0, 1)"),
    (["simulate", "--workload", "chat", *SIM, "--eviction-ratio", "0"],
     "eviction ratio must be in (0, 1]"),
    (["simulate", "--workload", "chat", *SIM, "--kv-cache-dtype", "int4"],
     "kv_cache_dtype must be one of"),
    (["advise", "--workload", "rag", *SIM, "--compressions", "0.5,1.5"],
     "compression ratio (fraction removed) must be in [0, 1), got 1.5"),
    (["advise", "--workload", "rag", *SIM, "--block-sizes", "16,2048"],
     "block sizes must each be an integer in [16, 1024], got 2048"),
    (["advise", "--workload", "rag", *SIM, "--rates", "1,-2"],
     "--rates: expected finite numbers > 0"),
    (["simulate", "--workload", "chat", *SIM, "--max-model-len", "100000"],
     "--max-model-len 100000 is beyond the model's max_position_embeddings"),
    (["generate", "--model", TINY, "--block-size", "abc"],
     "--block-size: must be 'auto' or an integer in [16, 1024], got 'abc'"),
    (["generate", "--model", TINY, "--kv-policy-options", "{bad"],
     "--kv-policy-options: must be JSON"),
    (["eval", "--model", TINY, "--policies", "full", "--kv-policy", "streaming",
      "--kv-budget", "32"], "engine options ['kv_budget', 'kv_policy'] conflict"),
    (["eval", "--model", TINY, "--policies", "full", "--tasks", "passkey", "--context-tokens",
      "99999", "--num-samples", "1", "--num-threads", "1"],
     "--context-tokens 99999 is too long for this model: the prompts need max_model_len "
     "100063"),
    (["generate", "--model", TINY, "--kv-cache-dtype", "int8", "--kv-policy", "kvzip",
      "--kv-budget", "32"], "kv_policy 'kvzip' scores the cache with an extra forward pass, "
                            "which needs the float KV pool"),
    (["generate", "--model", TINY, "--kv-policy", "bogus", "--kv-budget", "32"],
     "available: ['full', 'h2o'"),
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

    import nanokv.sim.advise

    monkeypatch.setattr(nanokv.eval.harness, "run_eval", no_work)
    monkeypatch.setattr(nanokv.sim.advise, "sweep", no_work)
    monkeypatch.setattr(nanokv.sim.advise, "evaluate", no_work)
    monkeypatch.setattr(nanokv.workloads.run, "run_bench", no_work)
    rc, last = run(["eval", "--model", TINY, "--policies", "full,bogus"], capsys)
    assert rc == 2 and "unknown KV policy ['bogus']" in last
    rc, last = run(["bench", "--model", TINY, "--step-model-out", "/nonexistent/x.json"],
                   capsys)
    assert rc == 2 and "--step-model-out: the directory of '/nonexistent/x.json'" in last
    trace = Path(__file__).resolve().parent / "_no_trace_needed.jsonl"  # never opened
    rc, last = run(["advise", "--trace", str(trace), *SIM, "--rates", "1"], capsys)
    assert rc == 2 and "--rates needs --workload" in last
    rc, last = run(["eval", "--model", TINY, "--policies", "full,snapkv", "--policy-options",
                    '{"snapkv": {"bogus": 1}}'], capsys)
    assert rc == 2 and "unknown option(s) ['bogus'] for KV policy 'snapkv'" in last
    rc, last = run(["eval", "--model", TINY, "--policies", "full,snapkv", "--compressions", ""],
                   capsys)
    assert rc == 2 and "compressions is empty" in last
    import nanokv.engine.llm_engine
    import nanokv.quant.calibrate

    monkeypatch.setattr(nanokv.engine.llm_engine, "LLMEngine", no_work)  # no server starts
    rc, last = run(["serve", "--model", TINY, "--router", "pow2", "--metrics-port", "9100"],
                   capsys)
    assert rc == 2 and ("--router, --metrics-port set the replicas of Ray Serve: they need "
                        "--replicas N") in last
    rc, last = run(["serve", "--model", TINY, "--responses-store-size", "-1"], capsys)
    assert rc == 2 and "responses_store_size must be an integer >= 0, got -1" in last
    rc, last = run(["serve", "--model", TINY, "--replicas", "2", "--responses-store-size", "4"],
                   capsys)
    assert rc == 2 and "--responses-store-size keeps responses in one engine process" in last
    rc, last = run(["serve", "--model", TINY, "--served-model-name", " "], capsys)
    assert rc == 2 and "--served-model-name must be a non-empty name" in last
    rc, last = run(["serve", "--model", TINY, "--reasoning-parser", "qwen"], capsys)
    assert rc == 2 and "--reasoning-parser" in last and "'deepseek_r1', 'qwen3'" in last
    # generate: the sampling flags and prompts before the model loads (LLMEngine is no_work)
    for argv, fragment in ((["--max-tokens", "0"], "max_tokens must be an integer >= 1"),
                           (["--temperature", "-1"], "temperature must be a finite number"),
                           (["--top-p", "0"], "top_p must be in (0, 1]"),
                           (["--sampling-seed", str(2**64)], "seed must be None or an integer"),
                           (["--prompt", ""], "--prompt must not be empty"),
                           (["--skip-tokenizer-init"], "--skip-tokenizer-init needs the "
                                                       "prompts as --prompt-token-ids"),
                           (["--skip-tokenizer-init", "--prompt", "hi"],
                            "text prompts cannot be encoded"),
                           (["--skip-tokenizer-init", "--prompt-token-ids", "1,2", "--stop",
                             "x"], "--stop strings are matched in the output text")):
        rc, last = run(["generate", "--model", TINY, *argv], capsys)
        assert rc == 2 and fragment in last, (argv, last)
    rc, last = run(["generate", "--model", TINY, "--prompt-token-ids", "1,-2"], capsys)
    assert rc == 2 and "--prompt-token-ids: expected comma-separated token ids" in last
    monkeypatch.setattr(nanokv.quant.calibrate, "calibrate", no_work)
    rc, last = run(["calibrate", "--model", TINY, "--output", "/nonexistent/dir/cal.json"],
                   capsys)
    assert rc == 2 and "--output: the directory of '/nonexistent/dir/cal.json'" in last


def test_unreadable_calibration_files(tmp_path):
    from nanokv.quant.calibration_file import load_calibration

    binary = tmp_path / "binary.json"
    binary.write_bytes(b"{\x80\x81")
    with pytest.raises(ValueError, match="cannot read calibration file .*binary.json"):
        load_calibration(binary)


def test_load_tester_options_and_an_unreachable_server(capsys):
    """Bad load-test options exit 2 naming the option; a server that cannot be reached gives the
    summary (every request failed, /metrics not read) and exit 1, not a traceback."""
    from nanokv.workloads import loadtest

    url = "http://127.0.0.1:9"  # the discard port: connections are refused
    base = ["--url", url, "--model", "m", "--duration", "0.2"]
    assert loadtest.main(base + ["--concurrency", "0"]) == 2
    assert "concurrency must be an integer >= 1, got 0" in capsys.readouterr().err
    assert loadtest.main(base + ["--max-tokens", "5", "3"]) == 2
    assert "max_tokens maximum must be an integer >= 5, got 3" in capsys.readouterr().err
    assert loadtest.main(base + ["--request-timeout", "0"]) == 2
    assert "request_timeout must be a finite number of seconds > 0" in capsys.readouterr().err
    assert loadtest.main(["--url", url, "--duration", "0.2"]) == 2  # no --model: listing fails
    assert f"cannot list the models of {url}" in capsys.readouterr().err
    assert loadtest.main(base + ["--concurrency", "1", "--json"]) == 1
    import json

    summary = json.loads(capsys.readouterr().out)
    assert summary["sent"] >= 1 and summary["failed"] == summary["sent"]
    assert summary["completed"] == 0 and summary["idle_error"].startswith("/metrics not read")
