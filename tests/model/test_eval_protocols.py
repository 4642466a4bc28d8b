"""`nanokv eval`'s question-uncompressed protocol and the seeded perplexity / KL windows."""

import pytest

import nanokv.engine.policy_runner as runner_module
from nanokv.eval.harness import EvalSettings, heldout_windows, run_eval
from nanokv.eval import tasks
from tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("eval-protocols")), "qwen3", seed=3,
                            max_position_embeddings=1024)


def compressions(monkeypatch) -> list:
    """(tokens computed, prompt length, cached slots before) at every compression."""
    seen = []
    real = runner_module.PolicyRunner.compress

    def spy(self, request):
        seen.append((request.num_computed_tokens, request.num_prompt_tokens,
                     request.num_cached_slots))
        return real(self, request)

    monkeypatch.setattr(runner_module.PolicyRunner, "compress", spy)
    return seen


@pytest.mark.parametrize("protocol", ["whole", "question"])
def test_question_protocol_leaves_the_question_uncompressed(tok_model, monkeypatch, protocol):
    from transformers import AutoTokenizer

    seen = compressions(monkeypatch)
    settings = EvalSettings(model=tok_model, policies=["knorm"], compressions=[4],
                            tasks=["passkey"], num_samples=2, context_tokens=300, seed=11,
                            protocol=protocol, engine_options={"block_size": 16})
    rows = run_eval(settings, log=lambda line: None, progress=False)
    tok = AutoTokenizer.from_pretrained(tok_model)
    samples = [tasks.passkey_sample(tok, 300 - 16, seed=11 + i) for i in range(2)]
    assert [r.extra["protocol"] for r in rows] == [protocol, protocol]
    assert len(seen) == 2
    for (computed, prompt_len, slots), x in zip(seen, samples):
        full = tok.encode(x.prompt)
        assert prompt_len == len(full)
        question = tok.encode(x.prompt[:-len(x.meta["question"])])
        if protocol == "whole":
            assert computed == slots == len(full)
        else:  # compressed at the end of the context: the question's tokens come after
            assert full[:computed] == question[:computed] and computed < len(full)
            assert len(full) - computed >= len(tok.encode(" " + x.meta["question"])) - 2
    row = next(r for r in rows if r.policy == "knorm")
    assert row.kept_fraction < 0.5  # a quarter of what was compressed (+ the question)

def test_question_protocol_keeps_question_slots(tok_model, monkeypatch):
    """Every question token is still cached at the end: slots = C + question + outputs - 1."""
    from nanokv import LLM, SamplingParams

    llm = LLM(tok_model, block_size=16, max_model_len=400, kv_policy="knorm", kv_budget=40)
    tok = llm.tokenizer
    x = tasks.passkey_sample(tok, 300, seed=2)
    full = tok.encode(x.prompt)
    context = len(tok.encode(x.prompt[:-len(x.meta["question"])])) - 1
    request = llm.engine.make_request(x.prompt, SamplingParams(temperature=0, max_tokens=4,
                                                                ignore_eos=True),
                                      compress_after=context)
    out, = llm.generate_requests([request], use_tqdm=False)
    assert out.kv_slots_at_finish == 40 + (len(full) - context) + 3


def test_eval_seed_draws_other_windows(tok_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_model)
    first = heldout_windows(tok, 3, 128)
    assert heldout_windows(tok, 3, 128, seed=0) == first  # seed 0: the windows as before
    consecutive = heldout_windows(tok, 24, 128)
    for seed in (1, 7):
        drawn = heldout_windows(tok, 3, 128, seed=seed)
        assert drawn != first and len(drawn) == 3
        assert all(w in consecutive for w in drawn)  # whole windows of the same text
        assert heldout_windows(tok, 3, 128, seed=seed) == drawn  # reproducible
    assert heldout_windows(tok, 3, 128, seed=1) != heldout_windows(tok, 3, 128, seed=7)
    ppl = {}
    for seed in (0, 7):
        settings = EvalSettings(model=tok_model, policies=["full"], tasks=["perplexity"],
                                context_tokens=128, ppl_windows=2, seed=seed,
                                engine_options={"block_size": 16})
        ppl[seed] = run_eval(settings, log=lambda line: None, progress=False)[0].score
    assert ppl[0] != ppl[7]


def test_bad_protocol(tok_model):
    with pytest.raises(ValueError, match="protocol"):
        EvalSettings(model=tok_model, protocol="context")
