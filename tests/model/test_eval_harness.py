"""The evaluation harness against independent computations on small slices."""

import json
import math

import pytest
import torch

from nanokv.eval.harness import EvalSettings, heldout_windows, run_eval
from nanokv.eval.report import write_results
from tiny_models import build_tiny_model, load_hf


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("eval-model")), "qwen3", seed=3,
                            max_position_embeddings=1024)


def test_full_cache_perplexity_matches_hf(tok_model):
    settings = EvalSettings(model=tok_model, policies=["full"], tasks=["perplexity", "kl"],
                            context_tokens=192, ppl_windows=2, context_fraction=0.75,
                            engine_options={"block_size": 16})
    rows = run_eval(settings, log=lambda line: None)
    ppl = next(r for r in rows if r.task == "perplexity")
    kl = next(r for r in rows if r.task == "kl")
    # independent: HF forward over each window, cross-entropy of the scored part
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_model)
    hf = load_hf(tok_model)
    nll, count = 0.0, 0
    for w in heldout_windows(tok, 2, 192):
        split = int(len(w) * 0.75)
        with torch.no_grad():
            logits = hf(torch.tensor([w])).logits[0]
        nll += float(torch.nn.functional.cross_entropy(logits[split - 1:-1],
                                                       torch.tensor(w[split:]),
                                                       reduction="sum"))
        count += len(w) - split
    assert ppl.score == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert kl.score == pytest.approx(0.0, abs=1e-6) and kl.extra["top1_agreement"] == 1.0
    assert ppl.kept_fraction == 1.0


def test_compression_is_measured_and_reported(tok_model, tmp_path):
    settings = EvalSettings(model=tok_model, policies=["full", "streaming"],
                            compressions=[2, 4], tasks=["passkey", "perplexity", "kl"],
                            num_samples=3, context_tokens=400, ppl_windows=2,
                            engine_options={"block_size": 16})
    rows = run_eval(settings, log=lambda line: None)
    kl = {r.compression: r for r in rows if r.task == "kl"}
    kept = {r.compression: r.kept_fraction for r in rows if r.task == "perplexity"}
    # keeping less changes the distributions more, and the bytes held really shrink
    assert 0 < kl[2].score < kl[4].score
    assert kept[1.0] == 1.0 and kept[4] < kept[2] < 1.0
    held = {r.compression: r.kv_bytes for r in rows if r.task == "passkey"}
    assert held[4] < held[2] < held[1.0]
    paths = write_results(rows, str(tmp_path), "nanokv eval ...")
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["rows"]) == len(rows) and all(p.endswith((".md", ".json", ".png"))
                                                  for p in paths)


def test_bad_settings(tok_model):
    with pytest.raises(ValueError, match="unknown task"):
        EvalSettings(model=tok_model, tasks=["mmlu"])
    with pytest.raises(ValueError, match="compressions"):
        EvalSettings(model=tok_model, compressions=[0.5])


def test_retrieval_prompts_can_be_shorter_than_the_windows(tok_model):
    common = dict(model=tok_model, policies=["full"], tasks=["passkey", "perplexity"],
                  num_samples=2, context_tokens=512, ppl_windows=1,
                  engine_options={"block_size": 16})
    rows = run_eval(EvalSettings(**common, retrieval_context_tokens=256), log=lambda line: None)
    same = run_eval(EvalSettings(**common), log=lambda line: None)
    held = {r.task: r.kv_bytes for r in rows}
    # a 256-token prompt holds fewer blocks than a 512-token one; the windows are unchanged
    assert held["passkey"] < {r.task: r.kv_bytes for r in same}["passkey"]
    assert held["perplexity"] == {r.task: r.kv_bytes for r in same}["perplexity"]
    with pytest.raises(ValueError, match="retrieval_context_tokens"):
        EvalSettings(**common, retrieval_context_tokens=10)


def test_labelled_policies_and_their_options(tok_model):
    """`label=name` runs policy `name` with the options given under `label`, and its rows carry
    the label; policy options are checked before any task runs."""
    settings = EvalSettings(model=tok_model, policies=["full", "s4=streaming", "s8=streaming"],
                            compressions=[2], tasks=["perplexity"], context_tokens=256,
                            ppl_windows=1, engine_options={"block_size": 16},
                            policy_options={"s4": {"n_sink": 4}, "s8": {"n_sink": 8}})
    rows = run_eval(settings, log=lambda line: None)
    assert [r.policy for r in rows] == ["full", "s4", "s8"]
    # same kept fraction, different sinks: different scores
    assert rows[1].kept_fraction == rows[2].kept_fraction < 1.0
    assert rows[1].score != rows[2].score
    common = dict(model=tok_model, policies=["full", "s4=streaming"], compressions=[2])
    with pytest.raises(ValueError, match="unknown KV policy"):
        EvalSettings(model=tok_model, policies=["s4=bogus"])
    with pytest.raises(ValueError, match="label to a dict"):
        EvalSettings(**common, policy_options=[])
    with pytest.raises(ValueError, match="label to a dict"):
        EvalSettings(**common, policy_options={"s4": 5})
    with pytest.raises(ValueError, match="not a policy of this run"):
        EvalSettings(**common, policy_options={"streaming": {"n_sink": 4}})
    with pytest.raises(ValueError, match=r"'s4=streaming'.*unknown option"):
        EvalSettings(**common, policy_options={"s4": {"bogus": 1}})
    with pytest.raises(ValueError, match="compressions is empty"):
        EvalSettings(**dict(common, compressions=[]))
