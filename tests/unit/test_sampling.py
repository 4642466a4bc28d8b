import numpy as np
import pytest
import torch

from nanokv.layers.sampler import Sampler, filter_logits
from nanokv.sampling_params import SamplingParams


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, 0.3], [5.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=0)] * 2
    assert Sampler(0)(logits, params, [0, 0]) == [1, 0]


def test_greedy_takes_the_first_maximum_as_argmax_does():
    """Ties (a flat vocabulary row, repeated maxima) and NaN rows: the first index, as
    torch.argmax; over a large random batch too."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0],
                           [float("nan"), 1.0, 2.0, 3.0], [1.0, 9.0, float("nan"), 9.0]])
    params = [SamplingParams(temperature=0)] * 4
    assert Sampler(0)(logits, params, [0] * 4) == logits.argmax(-1).tolist()
    gen = torch.Generator().manual_seed(0)
    big = torch.randint(0, 4, (8, 151936), generator=gen).float()  # many ties per row
    assert Sampler(0)(big, [params[0]] * 8, [0] * 8) == big.argmax(-1).tolist()


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
    (dict(stop=5), "stop must be a string or a list"),
    (dict(stop=0), "stop must be a string or a list"),  # was silently no stop at all
    (dict(stop_token_ids=7), "stop_token_ids must be a list"),
    (dict(stop_token_ids=0), "stop_token_ids must be a list"),
    (dict(ignore_eos="no"), "ignore_eos must be True or False"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output must be True or False"),
    (dict(return_prompt_logits=None), "return_prompt_logits must be True or False"),
    (dict(seed=2**63), r"seed must be None or an integer in \[-2\*\*63, 2\*\*63 - 1\]"),
    (dict(seed=-2**63 - 1), r"seed must be None or an integer in"),
    (dict(skip_special_tokens=0), "skip_special_tokens must be True or False, got 0"),
    (dict(spaces_between_special_tokens=None), "spaces_between_special_tokens must be True or "
                                               "False, got None"),
    (dict(prompt_logprobs=-1), "prompt_logprobs=-1 .the whole vocabulary. is not supported"),
    (dict(prompt_logprobs=21), r"prompt_logprobs must be None or an integer in \[0, 20\]"),
    (dict(bad_words=[""]), "bad_words must be None or a list of non-empty strings"),
    (dict(bad_words="x"), "bad_words must be None or a list of non-empty strings"),
    (dict(bad_words=[3]), "bad_words must be None or a list of non-empty strings"),
    (dict(bad_words=[["x"]]), "bad_words must be None or a list of non-empty strings"),
    (dict(logits_processors=[abs]), "logits_processors=.* is not supported"),
    (dict(logit_bias={"5": 1.0}), r"logit_bias must be a dict of token id \(an integer >= 0\)"),
    (dict(logit_bias={-1: 1.0}), "logit_bias must be a dict of token id"),
    (dict(logit_bias={True: 1.0}), "logit_bias must be a dict of token id"),
    (dict(logit_bias={5: float("nan")}), "-> finite number, got {5: nan}"),
    (dict(logit_bias={5: float("inf")}), "-> finite number"),
    (dict(logit_bias={5: "1"}), "-> finite number"),
    (dict(logit_bias=[5]), "logit_bias must be None or a dict"),
    (dict(allowed_token_ids=[]), r"allowed_token_ids must be None \(any token\) or a non-empty "
                                 "list of token ids"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids must be None"),
    (dict(allowed_token_ids=[3.0]), "allowed_token_ids must be None"),
    (dict(allowed_token_ids=7), "allowed_token_ids must be None"),
    (dict(truncate_prompt_tokens=0), r"truncate_prompt_tokens must be None, -1 \(keep "
                                     r"max_model_len - 1 tokens\) or an integer >= 1"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens must be None, -1"),
    (dict(truncate_prompt_tokens=2.0), "truncate_prompt_tokens must be None, -1"),
    (dict(truncate_prompt_tokens=True), "truncate_prompt_tokens must be None, -1"),
])
def test_bad_sampling_params(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kwargs)


def test_vllm_fields_at_their_defaults_and_numpy_scalars_are_accepted():
    """vLLM's fields nanokv does not implement pass at their defaults; numpy integers and
    floats are taken as Python's (what np.arange / np.random give), bools and numpy bools not."""
    p = SamplingParams(prompt_logprobs=None, bad_words=[], truncate_prompt_tokens=np.int64(-1),
                       logits_processors=None, max_tokens=np.int64(5), top_k=np.int32(3),
                       temperature=np.float32(0.5), seed=np.uint64(2**63 - 1),
                       stop_token_ids=[np.int64(4)], logprobs=np.int8(2))
    assert (p.max_tokens, p.top_k, p.temperature, p.seed, p.stop_token_ids, p.logprobs,
            p.truncate_prompt_tokens) == (5, 3, 0.5, 2**63 - 1, [4], 2, -1)
    assert type(p.truncate_prompt_tokens) is int
    assert all(type(x) is int for x in (p.max_tokens, p.top_k, p.seed, p.stop_token_ids[0]))
    assert type(p.temperature) is float
    with pytest.raises(ValueError, match="max_tokens must be an integer"):
        SamplingParams(max_tokens=np.bool_(True))


def test_seeds_of_the_64_bit_range_draw_distinct_streams():
    """Every signed 64-bit seed gets its own stream: -1 and 2**63 - 1 (equal mod 2**63), 0 and
    2**32 (equal in the 32 bits the CPU generator keeps) and the range's two ends differ; seed +
    j of the n samples wraps inside the range."""
    logits = torch.zeros(1, 1000)  # uniform: the draw is the uniform's bucket
    draws = {}
    for seed in (-1, 2**63 - 1, -2**63, 0, 1, 2**32):
        p = SamplingParams(temperature=1.0, seed=seed)
        draws[seed] = [Sampler(0)(logits, [p], [i])[0] for i in range(8)]
    assert len({tuple(d) for d in draws.values()}) == len(draws)
    assert SamplingParams(seed=2**63 - 1).sample(2).seed == -2**63 + 1
    assert SamplingParams(seed=5).sample(2).seed == 7
    assert SamplingParams(seed=None).sample(3).seed is None


@pytest.mark.parametrize("kwargs", [dict(temperature=0.7), dict(temperature=1.3, top_k=4),
                                    dict(temperature=1.0, top_p=0.8)])
def test_batched_race_matches_the_multinomial_reference(kwargs):
    """The batched exponential race and the per-row softmax + multinomial draw from the same
    distribution: frequencies over 3000 draws of a 6-token row agree within sampling error, and
    filtered tokens never appear."""
    logits = torch.log(torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05]))
    p = SamplingParams(**kwargs)
    sampler, reference = Sampler(1), Sampler(2)
    n = 3000
    batched = torch.zeros(6)
    rows = logits.repeat(n, 1)  # [n, 6]: all draws in one batched call
    for t in sampler(rows, [p] * n, [0] * n):
        batched[t] += 1
    ref = torch.zeros(6)
    for _ in range(n):
        ref[reference.sample_row_reference(logits, p, 0)] += 1
    assert (batched / n - ref / n).abs().max() < 0.05
    allowed = torch.isfinite(filter_logits(logits / p.temperature, p.top_k, p.top_p))
    assert (batched[~allowed] == 0).all()


def test_mixed_batch_keeps_greedy_and_seeded_rows():
    torch.manual_seed(3)
    logits = torch.randn(4, 1000)
    seeded = SamplingParams(temperature=0.9, seed=7)
    params = [SamplingParams(temperature=0), seeded, SamplingParams(temperature=0.9), seeded]
    out = Sampler(0)(logits, params, [0, 3, 0, 3])
    assert out[0] == int(logits[0].argmax())
    assert out[1] == Sampler(99)(logits[[1]], [seeded], [3])[0]  # its own noise only
    assert out[3] == Sampler(5)(logits[[3]], [seeded], [3])[0]


def test_logit_bias_and_allowed_token_ids_take_numpy_scalars():
    """Not clamped (vLLM's SamplingParams keeps any bias; its server clamps to [-100, 100]);
    an empty logit_bias is no bias."""
    p = SamplingParams(logit_bias={np.int64(3): np.float32(250.0), 4: -1},
                       allowed_token_ids=(np.int32(4), 5))
    assert p.logit_bias == {3: 250.0, 4: -1.0} and p.allowed_token_ids == [4, 5]
    assert all(type(t) is int for t in [*p.logit_bias, *p.allowed_token_ids])
    assert all(type(b) is float for b in p.logit_bias.values())
    assert SamplingParams(logit_bias={}).logit_bias is None
