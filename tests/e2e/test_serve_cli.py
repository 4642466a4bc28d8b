"""`nanokv serve` flag validation: bad values exit 2 with a message, before loading the model."""

import pytest

from nanokv.cli import main


@pytest.mark.parametrize("flags,fragment", [
    (["--port", "0"], "--port"),
    (["--max-waiting", "-1"], "max_waiting"),
    (["--request-timeout", "0"], "request_timeout"),
    (["--metrics-window", "-5"], "metrics_window"),
    (["--retry-after", "-1"], "--retry-after"),
    (["--api-key", ""], "--api-key"),
    (["--chat-template", "/nonexistent/template.jinja"], "--chat-template"),
    (["--model", "/somewhere/else"], "given twice"),
    (["--max-body-bytes", "0"], "max_body_bytes"),
    (["--max-prompt-chars", "0"], "max_prompt_chars"),
    (["--max-stop-strings", "0"], "max_stop_strings"),
    (["--shutdown-timeout", "-1"], "shutdown_timeout"),
    (["--request-classes", "a,bad class"], "request class"),
    (["--lora-modules", "a"], "give name=path"),
    (["--lora-modules", '{"name": "a"}'], "with \"name\" and \"path\""),
    (["--lora-modules", "{oops"], "is not JSON"),
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a=/x", "b=/y", "a=/z"], "names must differ"),
    (["--enable-lora", "--lora-modules", "a=/nonexistent"], "is not a directory"),
    (["--served-model-name", "a", "--enable-lora", "--lora-modules", "a=/x"],
     "named as the served model"),
    (["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"], "max_cpu_loras (1)"),
    (["--allow-runtime-lora-updating"], "needs --enable-lora"),
    (["--enable-lora", "--allow-runtime-lora-updating", "--replicas", "2"], "not with --replicas"),
])
def test_bad_serve_flags(tiny_llama, capsys, flags, fragment):
    assert main(["serve", tiny_llama, *flags]) == 2
    assert fragment in capsys.readouterr().err


def test_every_serve_flag_has_help(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--served-model-name", "--api-key", "--max-waiting",
                 "--request-timeout", "--retry-after", "--metrics-window", "--chat-template",
                 "--check-invariants", "--log-level", "--no-access-log", "--max-body-bytes",
                 "--max-prompt-chars", "--max-stop-strings", "--max-stop-length",
                 "--shutdown-timeout", "--request-classes", "--enable-lora", "--lora-modules",
                 "--max-loras", "--max-lora-rank", "--max-cpu-loras",
                 "--allow-runtime-lora-updating"):
        assert flag in out
    assert "127.0.0.1" in out


def test_vllm_runtime_lora_variable_turns_runtime_updating_on(monkeypatch, tiny_llama, capsys):
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING=true|1 acts as --allow-runtime-lora-updating (vLLM's
    switch), so it too needs --enable-lora; other values leave it off."""
    import argparse

    from nanokv.server.cli import runtime_lora_updating

    off = argparse.Namespace(allow_runtime_lora_updating=False)
    for value, on in (("true", True), ("1", True), ("TRUE", True), ("0", False), ("", False)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert runtime_lora_updating(off) is on
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    assert main(["serve", tiny_llama]) == 2
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING) needs --enable-lora" in capsys.readouterr().err
