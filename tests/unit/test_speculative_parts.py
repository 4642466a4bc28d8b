"""Speculative decoding's parts without a model: the n-gram drafts (`NgramIndex`, numpy) against
the token-list reference (`propose_ngram`), a brute force over every n-gram and Hugging Face's
prompt lookup; the config's
validation and vLLM's defaults; the counters as deltas and as Prometheus counters."""

from __future__ import annotations

import random

import pytest

from nanokv.metrics.prometheus import PrometheusExporter
from nanokv.metrics.stats import IterationStats, SchedulerDeltas
from nanokv.scheduler.output import SchedulerStats
from nanokv.spec import NgramIndex, SpeculativeConfig, propose_ngram
from nanokv.spec.stats import SpecDecodeStats
from test_metrics_prometheus import CONFIG, scrape


def brute_force(tokens, min_n, max_n, k):
    """Every (n, start) pair: the longest n with an earlier occurrence, its first start."""
    best = None
    for n in range(min_n, max_n + 1):
        for s in range(len(tokens) - n):  # s + n <= len - 1: a token follows the n-gram
            if tokens[s:s + n] == tokens[len(tokens) - n:] and s + n < len(tokens):
                if best is None or (n, -s) > (best[0], -best[1]):
                    best = (n, s)
    if best is None:
        return []
    n, s = best
    return tokens[s + n:s + n + k]


def test_drafts_equal_the_reference_and_a_brute_force():
    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 50))]
        low = rng.randint(1, 4)
        high, k = rng.randint(low, 6), rng.randint(1, 6)
        index = NgramIndex()
        cut = rng.randint(0, len(tokens))
        index.sync(tokens[:cut])  # then grown as a request's outputs come
        index.sync(tokens[:cut], tokens[cut:])
        want = brute_force(tokens, low, high, k)
        assert propose_ngram(tokens, low, high, k) == want
        assert index.propose(low, high, k) == want


def test_drafts_equal_hugging_face_prompt_lookup():
    """transformers' PromptLookupCandidateGenerator (n-grams down to 1) as the oracle."""
    import torch
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    rng = random.Random(1)
    for _ in range(300):
        tokens = [rng.randrange(5) for _ in range(rng.randint(2, 40))]
        high, k = rng.randint(1, 5), rng.randint(1, 6)
        hf = PromptLookupCandidateGenerator(num_output_tokens=k, max_matching_ngram_size=high,
                                            max_length=1000)
        ids, _ = hf.get_candidates(torch.tensor([tokens]))
        index = NgramIndex()
        index.sync(tokens)
        assert index.propose(1, high, k) == ids[0, len(tokens):].tolist()


def test_the_index_grows_past_its_first_array_and_refuses_to_shrink():
    index = NgramIndex()
    tokens = list(range(300)) + list(range(10))
    index.sync(tokens[:200], tokens[200:])
    assert index.propose(3, 3, 4) == [10, 11, 12, 13]
    index.sync(tokens + [10, 11, 12])  # two earlier occurrences: the first one's followers
    assert index.propose(3, 3, 4) == [13, 14, 15, 16]
    with pytest.raises(ValueError, match="shrank"):
        index.sync(tokens[:5])


def test_config_defaults_and_errors():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    for given, fragment in (
            ({}, "needs num_speculative_tokens"),
            ({"num_speculative_tokens": 0}, "must be an integer >= 1"),
            ({"num_speculative_tokens": 17}, "<= 16"),
            ({"num_speculative_tokens": 2, "method": "eagle"}, "method must be one of"),
            ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
             "prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
            ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown key(s) ['draft_model']"),
            ([1], "must be a dict")):
        with pytest.raises(ValueError) as e:
            SpeculativeConfig.from_dict(given)
        assert fragment in str(e.value)


def vllm_dense_schedule(schedule, max_batch, k):
    """A brute force of vLLM's batch-size lookup: per batch size, the k of the range holding
    it, else of the last range before it; capped at k."""
    out = {}
    for b in range(1, max_batch + 1):
        holding = [t for first, last, t in schedule if first <= b <= last]
        before = [t for first, last, t in sorted(schedule) if last < b]
        out[b] = min(k, holding[0] if holding else before[-1])
    return out


@pytest.mark.parametrize("schedule", [[[1, 1, 4], [2, 3, 2], [5, 8, 0]], [[1, 64, 3]],
                                      [[9, 12, 1], [1, 4, 6]], [[1, 2, 0], [40, 50, 8]]])
def test_draft_tokens_by_batch_size_follow_vllms_schedule(schedule):
    c = SpeculativeConfig.from_dict({"num_speculative_tokens": 5,
                                     "num_speculative_tokens_per_batch_size": schedule})
    assert {b: c.tokens_for_batch(b) for b in range(1, 70)} == vllm_dense_schedule(
        schedule, 69, 5)
    plain = SpeculativeConfig.from_dict({"num_speculative_tokens": 5})
    assert plain.per_batch_size is None and plain.tokens_for_batch(40) == 5


@pytest.mark.parametrize("schedule,fragment", [
    ([], "must be a non-empty list"), ({"1": 2}, "must be a non-empty list"),
    ([[1, 2]], "got the entry [1, 2]"), ([[1, 2, "3"]], "got the entry"),
    ([[1, 2, True]], "got the entry"), ([[0, 2, 1]], "1 <= first <= last"),
    ([[3, 2, 1]], "1 <= first <= last"), ([[1, 2, -1]], "k must be >= 0"),
    ([[1, 4, 2], [4, 8, 1]], "must not overlap"), ([[2, 4, 2]], "must start at batch size 1")])
def test_bad_batch_size_schedules_say_what_is_allowed(schedule, fragment):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_dict({"num_speculative_tokens": 4,
                                     "num_speculative_tokens_per_batch_size": schedule})
    assert "num_speculative_tokens_per_batch_size" in str(e.value) and fragment in str(e.value)


def test_the_scheduler_drafts_by_the_running_batch_size():
    """Each step's drafts per request are the schedule's k for the requests running when the
    step is scheduled (at most: a request's n-grams may give fewer)."""
    from nanokv.cache.block_manager import BlockManager
    from nanokv.request import Request
    from nanokv.sampling_params import SamplingParams
    from nanokv.scheduler.output import RunnerOutput
    from nanokv.scheduler.scheduler import Scheduler

    spec = SpeculativeConfig.from_dict({"num_speculative_tokens": 4, "prompt_lookup_max": 2,
                                        "prompt_lookup_min": 1,
                                        "num_speculative_tokens_per_batch_size":
                                            [[1, 1, 4], [2, 2, 2], [3, 8, 0]]})
    sched = Scheduler(BlockManager(64, 4, True), 8, 256, 128, speculative=spec)
    loop = [5, 6, 7, 8]
    for i in range(3):  # each leaves at another length
        sched.add_request(Request(f"r{i}", loop * 3, SamplingParams(max_tokens=8 + 12 * i)))
    seen = set()
    while sched.has_unfinished:
        running = len(sched.running)
        out = sched.schedule()
        for s in out.scheduled:
            if s.sample and s.num_tokens > 1 + len(s.draft_token_ids):
                continue  # a prefill chunk
            request = sched.requests[s.request_id]
            left = request.params.max_tokens - request.num_output_tokens - 1
            want = {1: 4, 2: 2}.get(running, 0)
            assert len(s.draft_token_ids) == min(want, left)
            seen.add(want)
        samples = {}
        for s in out.scheduled:
            n = len(sched.requests[s.request_id].output_token_ids)
            samples[s.request_id] = (loop * 20)[n:n + 1 + len(s.draft_token_ids)]
        sched.update_from_output(out, RunnerOutput(
            {r: t[0] for r, t in samples.items()}, draft_samples={r: t[1:] for r, t in
                                                                  samples.items()}))
    assert seen == {0, 2, 4}


def snapshot(stats: SpecDecodeStats) -> SchedulerStats:
    return SchedulerStats(0, 0, 10, 10, 0.0, 0, 0, 0, 0, {}, spec_decode=stats.copy())


def test_counters_go_to_prometheus_as_deltas():
    stats = SpecDecodeStats(3)
    deltas, exporter = SchedulerDeltas(), PrometheusExporter("m", CONFIG, window_s=60.0)
    assert not any("spec_decode" in name for name, _ in scrape(exporter))  # none until used
    stats.record(3, 2)
    it = IterationStats(time=0.0)
    deltas.fill(snapshot(stats), it)
    exporter.record(it)
    stats.record(2, 0)
    stats.record(3, 3)
    it = IterationStats(time=1.0)
    deltas.fill(snapshot(stats), it)
    assert (it.spec_decode.num_drafts, it.spec_decode.num_accepted_tokens) == (2, 3)
    exporter.record(it)
    m = scrape(exporter)
    assert m[("nanokv:spec_decode_num_drafts_total", ())] == 3
    assert m[("nanokv:spec_decode_num_draft_tokens_total", ())] == 8
    assert m[("nanokv:spec_decode_num_accepted_tokens_total", ())] == 5
    assert [m[("nanokv:spec_decode_num_accepted_tokens_per_pos_total",
               (("position", str(i)),))] for i in range(3)] == [2, 2, 1]
    assert stats.acceptance_rate == 5 / 8
    assert stats.since(stats.copy()).acceptance_rate is None  # nothing drafted: no rate


@pytest.mark.parametrize("min_tokens,bad_words", [
    (0, [[7, 8], [5], [9, 5, 6]]), (6, []), (5, [[6, 7]]), (2, [[8, 5, 6, 7, 8]])])
def test_each_draft_row_bans_as_if_the_drafts_before_it_were_outputs(min_tokens, bad_words):
    """The scheduler's banned tokens of every sampling row of a drafting request: row j's are
    what a brute force over outputs + drafts[:j] bans (min_tokens' stop tokens, the bad words'
    completing tokens); the drafts come from the prompt's loop."""
    from nanokv.bad_words import completing_tokens
    from nanokv.cache.block_manager import BlockManager
    from nanokv.request import Request
    from nanokv.sampling_params import SamplingParams
    from nanokv.scheduler.output import RunnerOutput
    from nanokv.scheduler.scheduler import Scheduler

    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                        "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    sched = Scheduler(BlockManager(32, 4, True), 4, 64, 64, speculative=spec)
    loop = [5, 6, 7, 8]
    params = SamplingParams(max_tokens=20, min_tokens=min_tokens, stop_token_ids=[9])
    request = Request("r", loop * 3, params, eos_token_ids=(2,))
    request.bad_words_token_ids = bad_words
    sched.add_request(request)
    checked = 0
    step = 0
    while sched.has_unfinished:
        out = sched.schedule()
        s, = out.scheduled
        outputs = list(request.output_token_ids)
        if step:  # decoding: drafts from the loop
            assert s.draft_token_ids
            expected = []
            for j in range(1 + len(s.draft_token_ids)):
                seen = outputs + s.draft_token_ids[:j]
                banned = (2, 9) if len(outputs) + j < min_tokens else ()
                expected.append(set(banned) | set(completing_tokens(bad_words, seen)))
            got = [set(b) for b in s.banned_token_ids] or [set()] * len(expected)
            assert got == expected
            checked += any(expected)
        # the loop goes on (the drafts that follow it accepted)
        tokens = (loop * 8)[len(outputs):len(outputs) + 1 + len(s.draft_token_ids)]
        sched.update_from_output(out, RunnerOutput({"r": tokens[0]},
                                                   draft_samples={"r": tokens[1:]}))
        step += 1
    assert checked and request.output_token_ids == (loop * 5)[:20]
