"""SamplingParams.logit_bias and allowed_token_ids (vLLM's) on the shipped model, against Hugging
Face transformers' logits: greedy decoding reads argmax(hf_logits + bias) over the allowed
tokens at every step; rows without them are unchanged; log-probabilities stay raw."""

from pathlib import Path

import pytest
import torch

from nanokv import LLM, SamplingParams
from tiny_models import hf_greedy, load_hf

SHIPPED = str(Path(__file__).resolve().parents[2] / "models" / "nanokv-tiny")
PROMPTS = [[40, 41, 42, 43, 44], [7, 8, 9, 10], [300, 301, 302], [11, 500, 12, 900, 13]]
STEPS = 8


@pytest.fixture(scope="module")
def llm():
    return LLM(SHIPPED, block_size=16, max_model_len=128)


@pytest.fixture(scope="module")
def hf():
    return load_hf(SHIPPED)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, **kw)


def hf_shaped_greedy(hf, prompt: list[int], steps: int, bias: dict[int, float] | None = None,
                     allowed: list[int] | None = None) -> list[int]:
    """The oracle: each step argmax(hf_logits + bias) over the allowed tokens."""
    ids = list(prompt)
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()  # [vocab]
        for t, b in (bias or {}).items():
            logits[t] += b
        if allowed is not None:
            keep = torch.full_like(logits, float("-inf"))
            keep[allowed] = 0.0
            logits = logits + keep
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def assert_no_blocks_held(llm):
    bm = llm.engine.block_manager
    llm.engine.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_a_large_bias_forces_its_token(llm, hf):
    prompt = PROMPTS[0]
    free, logits = hf_greedy(hf, prompt, STEPS)
    chosen = int(logits[0].argmin())  # the token HF thinks least likely
    assert chosen not in free
    out = llm.generate([prompt], greedy(logit_bias={chosen: 100.0}))[0]
    assert out.token_ids == [chosen] * STEPS


def test_a_bias_moves_the_argmax_exactly_as_hf_logits_plus_bias(llm, hf):
    """The runner-up token given just enough bias to win the first step (and a little less: it
    does not), then 8 biased steps against the oracle; a -100 bias on the top token gives the
    runner-up."""
    prompt = PROMPTS[1]
    _, logits = hf_greedy(hf, prompt, 1)
    top2 = logits[0].topk(2)
    first, second = top2.indices.tolist()
    gap = float(top2.values[0] - top2.values[1])
    for bias, winner in ((gap + 0.05, second), (gap - 0.05, first)):
        expected = int((logits[0] + torch.zeros_like(logits[0]).index_fill_(
            0, torch.tensor([second]), bias)).argmax())
        assert expected == winner
        out = llm.generate([prompt], greedy(logit_bias={second: bias}))[0]
        assert out.token_ids[0] == winner
        assert out.token_ids == hf_shaped_greedy(hf, prompt, STEPS, bias={second: bias})
    out = llm.generate([prompt], greedy(logit_bias={first: -100.0}))[0]
    assert out.token_ids == hf_shaped_greedy(hf, prompt, STEPS, bias={first: -100.0})
    assert out.token_ids[0] == second


def test_allowed_token_ids_restrict_greedy_to_the_allowed_argmax(llm, hf):
    prompt = PROMPTS[2]
    free, logits = hf_greedy(hf, prompt, STEPS)
    # the HF ranks 5, 50, 500 and 3000 of the first step: none of them HF's free choice
    order = logits[0].argsort(descending=True).tolist()
    allowed = [order[4], order[49], order[499], order[2999]]
    out = llm.generate([prompt], greedy(allowed_token_ids=allowed))[0]
    assert out.token_ids[0] == order[4]
    assert set(out.token_ids) <= set(allowed)
    assert out.token_ids == hf_shaped_greedy(hf, prompt, STEPS, allowed=allowed)
    # with a bias on an allowed token as well: both apply
    bias = {allowed[2]: 6.0, order[0]: 100.0}  # order[0] is not allowed: it stays out
    out = llm.generate([prompt], greedy(allowed_token_ids=allowed, logit_bias=bias))[0]
    assert out.token_ids == hf_shaped_greedy(hf, prompt, STEPS, bias=bias, allowed=allowed)
    assert order[0] not in out.token_ids


def test_a_mixed_batch_leaves_the_plain_rows_unchanged(llm, hf):
    """Rows with and without bias / allowed tokens in the same steps: the plain rows decode as
    HF's greedy, the others as the oracle."""
    plain = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    bias = {int(plain[1][1][0].argmin()): 100.0}
    allowed = plain[3][1][0].argsort(descending=True)[3:40].tolist()
    params = [greedy(), greedy(logit_bias=bias), greedy(), greedy(allowed_token_ids=allowed)]
    outs = llm.generate(PROMPTS, params)
    assert outs[0].token_ids == plain[0][0]
    assert outs[2].token_ids == plain[2][0]
    assert outs[1].token_ids == hf_shaped_greedy(hf, PROMPTS[1], STEPS, bias=bias)
    assert outs[3].token_ids == hf_shaped_greedy(hf, PROMPTS[3], STEPS, allowed=allowed)
    assert_no_blocks_held(llm)


def test_seeded_sampling_never_leaves_the_allowed_set(llm):
    allowed = [5, 77, 301, 1024, 4095]
    params = [SamplingParams(temperature=1.5, seed=seed, max_tokens=24, ignore_eos=True,
                             allowed_token_ids=allowed, top_p=0.95 if seed % 2 else 1.0,
                             logit_bias={5: -2.0, 77: 3.0} if seed % 3 == 0 else None)
              for seed in range(8)]
    outs = llm.generate([PROMPTS[i % 4] for i in range(8)], params)
    for out in outs:
        assert set(out.token_ids) <= set(allowed)
    assert len({t for out in outs for t in out.token_ids}) > 1  # sampled, not one token
    again = llm.generate([PROMPTS[i % 4] for i in range(8)], params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_logprobs_are_the_raw_distribution_bias_or_not(llm, hf):
    """As vLLM's default raw_logprobs: the forced token's log-probability is HF's unbiased one."""
    prompt = PROMPTS[0]
    _, logits = hf_greedy(hf, prompt, 1)
    chosen = int(logits[0].argmin())
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=2,
                                                logit_bias={chosen: 100.0},
                                                allowed_token_ids=[chosen, 9]))[0]
    lp = out.outputs[0].logprobs[0]
    ref = logits[0].log_softmax(-1)
    assert lp.token_id == chosen
    assert lp.logprob == pytest.approx(float(ref[chosen]), abs=1e-4)
    assert lp.rank == logits.shape[1]  # the least likely token of the raw distribution
    assert [t for t, _ in lp.top] == ref.topk(2).indices.tolist()


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    vocab = llm.engine.hf_config.vocab_size
    for params, fragment in [
            (greedy(logit_bias={3: 1.0, vocab: 2.0}),
             rf"logit_bias keys \(token ids\) must be in \[0, {vocab}\) \(the vocabulary\); "
             rf"got \[{vocab}\]"),
            (greedy(allowed_token_ids=[3, vocab + 7]),
             rf"allowed_token_ids must be in \[0, {vocab}\) \(the vocabulary\); "
             rf"got \[{vocab + 7}\]")]:
        with pytest.raises(ValueError, match=fragment):
            llm.generate([PROMPTS[0], PROMPTS[1]], [greedy(), params])
    with pytest.raises(ValueError, match="allowed_token_ids must be None"):
        greedy(allowed_token_ids=[])
    assert_no_blocks_held(llm)
    assert not llm.engine.has_unfinished_requests()
