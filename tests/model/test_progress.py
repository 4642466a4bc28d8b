"""Progress bars: LLM.generate's (vLLM's use_tqdm), nanokv bench's and nanokv eval's."""

from __future__ import annotations

from nanokv import LLM, SamplingParams
from nanokv.workloads.run import run_bench
from nanokv.eval.harness import EvalSettings, run_eval
from tiny_models import build_tiny_model


class FakeBar:
    made: list[FakeBar] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.n, self.postfix, self.closed = kwargs, 0, "", False
        FakeBar.made.append(self)

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def close(self) -> None:
        self.closed = True


def test_generate_bar_counts_prompts_and_tokens_per_second(tiny_llama):
    llm = LLM(tiny_llama, block_size=16, max_model_len=128, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    FakeBar.made.clear()
    outs = llm.generate([[1, 2, 3], [4, 5, 6, 7], [8, 9]], params, use_tqdm=FakeBar)
    (bar,) = FakeBar.made
    assert bar.kwargs["total"] == 3 and bar.n == 3 and bar.closed
    assert "input:" in bar.postfix and "output:" in bar.postfix and "toks/s" in bar.postfix
    assert [len(o.token_ids) for o in outs] == [5, 5, 5]
    FakeBar.made.clear()
    assert llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids == outs[0].token_ids
    assert FakeBar.made == []


def test_generate_default_bar_on_stderr(tiny_llama, capsys):
    llm = LLM(tiny_llama, block_size=16, max_model_len=128, skip_tokenizer_init=True)
    llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=3))
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err and "toks/s" in err


def test_bench_and_eval_bars(tmp_path, capsys):
    model = build_tiny_model(str(tmp_path / "model"), "qwen3", seed=3,
                             max_position_embeddings=1024)
    run_bench(model, {"block_size": 16, "max_model_len": 128}, 3, (8, 16), (2, 4), seed=0,
              verbose=False)
    err = capsys.readouterr().err
    assert "bench" in err and "3/3" in err and "tok/s" in err
    settings = EvalSettings(model=model, policies=["full", "streaming"], compressions=[2],
                            tasks=["passkey", "perplexity"], num_samples=2, context_tokens=400,
                            ppl_windows=1, engine_options={"block_size": 16})
    rows = run_eval(settings, log=lambda line: None)
    err = capsys.readouterr().err
    # 2 settings (full, streaming 2x) x (2 passkey prompts + 1 perplexity window)
    assert len(rows) == 4 and "eval streaming 2x" in err and "6/6" in err
    assert "Processed prompts" not in err  # one bar for the whole run
