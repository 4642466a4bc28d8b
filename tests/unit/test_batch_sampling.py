"""The batched device sampler against the per-row host references: the same tokens for the same
seeds in mixed batches, seeded rows independent of their batch, per-row filters and penalties
equal to `filter_logits` / `apply_penalties`, logit_bias and allowed_token_ids equal to
`shape_logits`, log-probabilities equal to `token_logprobs`."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from nanokv.layers.batch_sampling import (RowParams, apply_penalties_batch, filter_logits_batch,
                                          shape_logits_batch)
from nanokv.layers.sampler import (Sampler, apply_penalties, filter_logits, shape_logits,
                                   token_logprobs)
from nanokv.sampling_params import SamplingParams

VOCAB = 300


def random_params(rng: random.Random) -> SamplingParams:
    """One of the mixes a server sees: greedy or tempered, filters, penalties, seeds."""
    kind = rng.choice(["greedy", "temp", "top_k", "top_p", "min_p", "all", "penalties"])
    kw: dict = {}
    if kind == "greedy":
        kw["temperature"] = 0
    else:
        kw["temperature"] = rng.choice([0.3, 0.7, 1.0, 1.6])
    if kind in ("top_k", "all"):
        kw["top_k"] = rng.choice([1, 5, 40, VOCAB + 10])
    if kind in ("top_p", "all"):
        kw["top_p"] = rng.choice([0.1, 0.5, 0.9])
    if kind in ("min_p", "all"):
        kw["min_p"] = rng.choice([0.01, 0.1, 0.4])
    if kind in ("penalties", "all") or rng.random() < 0.2:
        kw["repetition_penalty"] = rng.choice([1.0, 0.8, 1.3])
        kw["frequency_penalty"] = rng.choice([0.0, 0.5, -0.4])
        kw["presence_penalty"] = rng.choice([0.0, 0.7])
    if rng.random() < 0.5:
        kw["seed"] = rng.randrange(1000)
    if rng.random() < 0.2:
        kw["logprobs"] = rng.choice([0, 3])
    return SamplingParams(**kw)


def random_batch(seed: int, n: int):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    logits = torch.randn(n, VOCAB) * 3  # [N, vocab]
    params = [random_params(rng) for _ in range(n)]
    indices = [rng.randrange(50) for _ in range(n)]
    histories = [([rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))],
                  [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 20))])
                 for _ in range(n)]
    return logits, params, indices, histories


@pytest.mark.parametrize("seed", range(6))
def test_batched_equals_per_row_reference(seed):
    logits, params, indices, histories = random_batch(seed, 24)
    for engine_seed in (0, 11):  # unseeded rows draw from the engine's generator in both
        got = Sampler(engine_seed).sample(logits, params, indices, histories).token_ids
        ref = Sampler(engine_seed).sample_reference(logits, params, indices, histories)
        assert got == ref
    assert any(not p.greedy for p in params) and any(p.has_penalties for p in params)


@pytest.mark.parametrize("seed", range(4))
def test_banned_tokens_are_never_picked_and_match_the_reference(seed):
    """min_tokens' banned tokens (each row's EOS / stop ids) are masked before every filter:
    the batched path equals the host reference, no row picks a banned token, and the raw
    log-probabilities are those of the unmasked logits."""
    logits, params, indices, histories = random_batch(seed, 24)
    rng = random.Random(seed)
    # each row bans its 1-3 likeliest tokens (what greedy or top-k would pick), or nothing
    banned = [tuple(logits[i].topk(rng.randint(1, 3)).indices.tolist())
              if rng.random() < 0.7 else () for i in range(len(params))]
    banned[0] = (VOCAB + 5,)  # an id past the vocabulary: nothing to mask
    out = Sampler(3).sample(logits, params, indices, histories, banned)
    assert out.token_ids == Sampler(3).sample_reference(logits, params, indices, histories,
                                                        banned)
    assert all(t not in b for t, b in zip(out.token_ids, banned))
    raw = Sampler(3).sample(logits, params, indices, histories)
    for lp, ref, p in zip(out.logprobs, raw.logprobs, params):
        assert (lp is None) == (p.logprobs is None)
        if lp is not None:
            assert lp.top == ref.top  # the unmasked distribution


def test_seeded_row_does_not_depend_on_its_batch():
    logits, params, indices, histories = random_batch(7, 16)
    mine = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, seed=4242,
                          repetition_penalty=1.2)
    row = torch.randn(VOCAB) * 3
    history = ([1, 2, 3], [4, 4])
    alone = [Sampler(s).sample(row[None], [mine], [9], [history]).token_ids[0]
             for s in (0, 1)]
    for place in (0, 5, 16):  # first, middle, last; different neighbours, different generator
        lg = torch.cat([logits[:place], row[None], logits[place:]])
        ps = params[:place] + [mine] + params[place:]
        ix = indices[:place] + [9] + indices[place:]
        hs = histories[:place] + [history] + histories[place:]
        assert Sampler(place).sample(lg, ps, ix, hs).token_ids[place] == alone[0]
    assert alone[0] == alone[1]
    # and the draws do vary with the output index (the seed is not a constant token)
    draws = {Sampler(0).sample(row[None], [mine], [i], [history]).token_ids[0]
             for i in range(40)}
    assert len(draws) > 1


@pytest.mark.parametrize("seed", range(4))
def test_filters_equal_filter_logits_row_by_row(seed):
    logits, params, _, _ = random_batch(100 + seed, 20)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    rp = RowParams.build(params, rows, np.zeros(len(rows)), VOCAB, torch.device("cpu"))
    scaled = logits[rows] / rp.temperature  # [S, vocab]
    got = torch.isfinite(filter_logits_batch(scaled.clone(), rp))
    for j, i in enumerate(rows):
        p = params[i]
        ref = torch.isfinite(filter_logits(scaled[j], p.top_k, p.top_p, p.min_p))
        assert torch.equal(got[j], ref), (i, p)


def test_penalties_equal_apply_penalties_row_by_row():
    logits, params, _, histories = random_batch(3, 30)
    got = apply_penalties_batch(logits, params, histories)
    for i, p in enumerate(params):
        ref = apply_penalties(logits[i], p, *histories[i]) if p.has_penalties else logits[i]
        assert torch.equal(got[i], ref), i
    # token ids beyond the vocabulary (a larger tokenizer) are ignored, as in the reference
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)
    out = apply_penalties_batch(logits[:1], [p], [([VOCAB + 3, 1], [VOCAB + 5, 2])])
    assert torch.equal(out[0], apply_penalties(logits[0], p, [VOCAB + 3, 1], [VOCAB + 5, 2]))


def test_penalties_without_history_raise():
    p = SamplingParams(presence_penalty=0.5)
    with pytest.raises(ValueError, match="penalties need"):
        Sampler(0).sample(torch.randn(1, VOCAB), [p], [0], None)


def test_logprobs_equal_the_host_reference():
    logits, params, indices, histories = random_batch(9, 24)
    params = [SamplingParams(**{**p.__dict__, "logprobs": k})
              for p, k in zip(params, [None, 0, 2, 5] * 6)]
    out = Sampler(0).sample(logits, params, indices, histories)
    ref = token_logprobs(logits, params, out.token_ids)
    for got, want in zip(out.logprobs, ref):
        if want is None:
            assert got is None
            continue
        assert (got.token_id, got.rank) == (want.token_id, want.rank)
        assert got.logprob == pytest.approx(want.logprob, abs=1e-6)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-6)


@pytest.mark.parametrize("kwargs", [dict(top_k=7), dict(top_p=0.6), dict(min_p=0.2),
                                    dict(top_k=30, top_p=0.8, min_p=0.05)])
def test_a_filter_every_row_asked_for_equals_the_reference(kwargs):
    """Every sampled row with the same filter (it then runs in place on the whole batch), next to
    greedy rows."""
    torch.manual_seed(5)
    logits = torch.randn(12, VOCAB) * 3
    params = [SamplingParams(temperature=0.9, seed=i if i % 2 else None, **kwargs)
              for i in range(10)] + [SamplingParams(temperature=0)] * 2
    indices = list(range(12))
    got = Sampler(3).sample(logits, params, indices).token_ids
    assert got == Sampler(3).sample_reference(logits, params, indices)


def with_bias_and_allowed(params: list[SamplingParams], seed: int) -> list[SamplingParams]:
    """The same rows, some with a logit_bias, some with allowed_token_ids, some with both."""
    rng = random.Random(seed)
    out = []
    for p in params:
        kw: dict = {}
        r = rng.random()
        if r < 0.5:
            kw["logit_bias"] = {rng.randrange(VOCAB): rng.choice([-100.0, -3.5, 0.7, 8.0, 100.0])
                                for _ in range(rng.randint(1, 6))}
        if 0.3 < r < 0.75:
            kw["allowed_token_ids"] = rng.sample(range(VOCAB), rng.randint(1, 25))
        out.append(SamplingParams(**{**p.__dict__, **kw}))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_bias_and_allowed_tokens_equal_the_per_row_reference(seed):
    """logit_bias and allowed_token_ids in mixed batches (with penalties, filters, banned
    tokens, greedy and seeded rows): the batched path equals the host reference token for
    token, and no row leaves its allowed set."""
    logits, params, indices, histories = random_batch(200 + seed, 24)
    params = with_bias_and_allowed(params, seed)
    banned = [tuple(logits[i].topk(2).indices.tolist()) if i % 4 == 0 else ()
              for i in range(len(params))]
    for engine_seed in (0, 5):
        got = Sampler(engine_seed).sample(logits, params, indices, histories, banned).token_ids
        assert got == Sampler(engine_seed).sample_reference(logits, params, indices, histories,
                                                            banned)
        for t, p in zip(got, params):
            assert p.allowed_token_ids is None or t in p.allowed_token_ids
    assert any(p.logit_bias for p in params) and any(p.allowed_token_ids for p in params)


def test_shape_logits_batch_equals_shape_logits_row_by_row():
    logits, params, _, _ = random_batch(31, 30)
    params = with_bias_and_allowed(params, 31)
    got = shape_logits_batch(logits, params)
    for i, p in enumerate(params):
        assert torch.equal(got[i], shape_logits(logits[i], p)), i
        if p.allowed_token_ids is not None:
            outside = torch.ones(VOCAB, dtype=torch.bool)
            outside[p.allowed_token_ids] = False
            assert torch.isneginf(got[i][outside]).all()
        for t, b in (p.logit_bias or {}).items():
            if p.allowed_token_ids is None or t in p.allowed_token_ids:
                assert float(got[i, t]) == pytest.approx(float(logits[i, t]) + b)


def test_rows_without_bias_or_allowed_tokens_cost_nothing():
    """No row with either: the logits themselves come back (no copy, no upload)."""
    logits, params, _, _ = random_batch(4, 16)
    assert shape_logits_batch(logits, params) is logits
    row = logits[0]
    assert shape_logits(row, params[0]) is row


def test_bias_comes_before_the_penalties_and_logprobs_stay_raw():
    """vLLM V1's order: the bias is added, then the repetition penalty divides the biased
    logit: (2 + 2) / 2 = 2 < 2.5, where penalising first would give 2 / 2 + 2 = 3 > 2.5. The
    log-probabilities are the raw distribution's (vLLM's raw_logprobs), bias or not."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 1], logits[0, 2] = 2.0, 2.5
    p = SamplingParams(temperature=0, logit_bias={1: 2.0}, repetition_penalty=2.0, logprobs=2)
    out = Sampler(0).sample(logits, [p], [0], [([1], [])])
    assert out.token_ids == [2]
    assert Sampler(0).sample_reference(logits, [p], [0], [([1], [])]) == [2]
    plain = Sampler(0).sample(logits, [SamplingParams(temperature=0, logprobs=2)], [0])
    assert out.logprobs[0].top == plain.logprobs[0].top
    assert out.logprobs[0].logprob == plain.logprobs[0].logprob
