"""Penalties, min_p and logprobs in the sampler, against hand-computed references."""

from __future__ import annotations

import math

import pytest
import torch

from nanokv.layers.sampler import Sampler, apply_penalties, filter_logits
from nanokv.sampling_params import SamplingParams


def penalties_by_hand(logits: list[float], p: SamplingParams, prompt: list[int],
                      output: list[int]) -> list[float]:
    """vLLM's rules written token by token."""
    out = []
    for t, x in enumerate(logits):
        if t in prompt or t in output:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        n = output.count(t)
        x -= p.frequency_penalty * n
        x -= p.presence_penalty * (1 if n else 0)
        out.append(x)
    return out


def test_penalties_hand_computed():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    p = SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5,
                       frequency_penalty=0.25)
    got = apply_penalties(logits, p, [0, 4], [3, 3, 2]).tolist()
    # 0: prompt, 2/2; 1: untouched; 2: output once, 0.5/2 - 0.25 - 0.5; 3: twice, 3/2 - 0.5 - 0.5;
    # 4: prompt, negative, -2*2
    assert got == pytest.approx([1.0, -1.0, -0.5, 0.5, -4.0])
    # greedy reads the penalised logits: token 3 (3.0) loses to token 0 (1.0)
    assert Sampler(0)(logits[None], [p], [3], [([0, 4], [3, 3, 2])]) == [0]
    assert Sampler(0)(logits[None], [SamplingParams(temperature=0)], [3]) == [3]


@pytest.mark.parametrize("kwargs", [dict(repetition_penalty=1.3),
                                    dict(presence_penalty=-0.7, frequency_penalty=1.1),
                                    dict(repetition_penalty=0.8, presence_penalty=0.2,
                                         frequency_penalty=-0.4)])
def test_penalties_match_token_by_token_reference(kwargs):
    torch.manual_seed(0)
    logits = torch.randn(64) * 3
    prompt = torch.randint(0, 64, (20,)).tolist()
    output = torch.randint(0, 64, (30,)).tolist()
    p = SamplingParams(**kwargs)
    got = apply_penalties(logits, p, prompt, output)
    ref = penalties_by_hand(logits.tolist(), p, prompt, output)
    assert got.tolist() == pytest.approx(ref, abs=1e-5)


def test_neutral_penalties_change_nothing():
    p = SamplingParams(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                       min_p=0.0)
    assert not p.has_penalties
    torch.manual_seed(1)
    logits = torch.randn(3, 100)
    a = Sampler(5)(logits, [p] * 3, [0, 1, 2])
    b = Sampler(5)(logits, [SamplingParams()] * 3, [0, 1, 2])
    assert a == b


def test_min_p_masks_below_fraction_of_top():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.12, 0.08]))
    kept = torch.isfinite(filter_logits(logits, -1, 1.0, min_p=0.2)).tolist()
    assert kept == [True, True, True, False]  # 0.08 < 0.2 * 0.5 = 0.1 <= 0.12
    p = SamplingParams(temperature=1.0, min_p=0.5)
    sampler = Sampler(0)
    draws = {sampler(logits[None], [p], [0])[0] for _ in range(200)}
    assert draws == {0, 1}  # 0.3 >= 0.25, 0.12 < 0.25


def test_penalised_sampling_matches_reference_distribution():
    logits = torch.log(torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05]))
    p = SamplingParams(temperature=0.9, repetition_penalty=1.5, frequency_penalty=0.3,
                       min_p=0.05)
    history = ([0], [1, 1, 4])
    n = 3000
    batched = torch.zeros(6)
    for t in Sampler(1)(logits.repeat(n, 1), [p] * n, [0] * n, [history] * n):
        batched[t] += 1
    reference = Sampler(2)
    ref = torch.zeros(6)
    for _ in range(n):
        ref[reference.sample_row_reference(logits, p, 0, history)] += 1
    assert (batched / n - ref / n).abs().max() < 0.05


def test_logprobs_are_raw_log_softmax_with_rank_and_top():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    params = [SamplingParams(temperature=0, logprobs=2, repetition_penalty=10.0),
              SamplingParams(temperature=0)]
    out = Sampler(0).sample(logits, params, [0, 0], [([1], []), None])
    ref = torch.log_softmax(logits[0], -1)
    assert out.token_ids[0] == 2  # 3.0 / 10 < 2.0: the penalty moved the argmax
    lp = out.logprobs[0]
    assert lp.token_id == 2 and lp.rank == 2  # rank in the raw distribution
    assert lp.logprob == pytest.approx(float(ref[2]))
    assert [t for t, _ in lp.top] == [1, 2]
    assert [v for _, v in lp.top] == pytest.approx([float(ref[1]), float(ref[2])])
    assert math.isclose(sum(math.exp(v) for v in ref.tolist()), 1.0, rel_tol=1e-6)
    assert out.logprobs[1] is None


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(min_p=1.5), "min_p"),
    (dict(logprobs=21), "logprobs"),
    (dict(max_tokens=True), "max_tokens"),
])
def test_bad_new_params(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kwargs)
