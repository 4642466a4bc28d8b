import pytest
import torch

from nanokv.layers.sampler import Sampler, filter_logits
from nanokv.sampling_params import SamplingParams


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, 0.3], [5.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=0)] * 2
    assert Sampler(0)(logits, params, [0, 0]) == [1, 0]


def test_top_k_and_top_p_masks():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(filter_logits(logits, 2, 1.0)).tolist()
    assert kept == [True, True, False, False]
    # nucleus 0.7: 0.5 alone is below 0.7, so 0.3 joins; 0.15 is not needed
    kept = torch.isfinite(filter_logits(logits, -1, 0.7)).tolist()
    assert kept == [True, True, False, False]
    kept = torch.isfinite(filter_logits(logits, -1, 0.4)).tolist()
    assert kept == [True, False, False, False]


def test_seeded_sampling_is_reproducible_and_batch_independent():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=1.0)
    a = Sampler(0)(logits, [p, other, p], [5, 5, 5])
    b = Sampler(123)(logits[[0]], [p], [5])
    assert a[0] == b[0]
    draws = {Sampler(0)(logits[[0]], [p], [i])[0] for i in range(30)}
    assert len(draws) > 1  # different output indices draw differently


def test_sampling_follows_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    sampler = Sampler(0)
    p = SamplingParams(temperature=1.0)
    counts = torch.zeros(3)
    for _ in range(2000):
        counts[sampler(logits, [p], [0])[0]] += 1
    freq = counts / counts.sum()
    assert abs(freq[0] - 0.7) < 0.05 and abs(freq[2] - 0.1) < 0.03


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-1), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(stop=[""]), "stop"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_bad_sampling_params(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kwargs)
