"""A request whose compression point comes before it holds its budget (a prompt shorter than the
budget, or `compress_after` below the policy's protected tokens) is not cut there: during decode
its cache grows to the budget asked for, then the policy evicts and keeps it within
[C, C + B - 1]; a re-selection that found no free block is tried again at the next step.
Oracles: the same request without a policy (identical greedy tokens while nothing was evicted)
and the budget's bounds checked at every step. The shipped model: a trained one, whose greedy
tokens are not near ties."""

import os

import pytest

from nanokv.config import EngineConfig
from nanokv.engine.llm_engine import LLMEngine
from nanokv.sampling_params import SamplingParams

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "..", "models", "nanokv-tiny")
BLOCK = 16
OPTIONS = dict(block_size=BLOCK, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256)
DECODE_EVICTING = [("paged_eviction", None), ("streaming", None),
                   ("streaming", {"slide": "block"}), ("h2o", None)]


def prompt_of(n: int) -> list[int]:
    return [(i * 37) % 300 + 5 for i in range(n)]


def run_alone(prompt: list[int], max_tokens: int, compress_after: int | None = None,
              **options) -> tuple[list[int], list[int], object]:
    """Greedy tokens, the cache length after each step, and the finished request."""
    eng = LLMEngine(EngineConfig.from_kwargs(SHIPPED, **{**OPTIONS, **options}))
    request = eng.make_request(prompt, SamplingParams(temperature=0, ignore_eos=True,
                                                      max_tokens=max_tokens),
                               compress_after=compress_after)
    lengths = cache_lengths(eng, request)
    return list(request.output_token_ids), lengths, request


def cache_lengths(eng: LLMEngine, request) -> list[int]:
    """Run the request to its end; the cache length after each step."""
    eng.add_prepared(request)
    lengths = []
    while eng.has_unfinished_requests():
        eng.step()
        lengths.append(request.num_cached_slots)
    eng.check_invariants()
    return lengths


@pytest.mark.parametrize("policy,options", DECODE_EVICTING)
def test_a_prompt_shorter_than_the_budget_grows_to_it(policy, options):
    budget, prompt = 6 * BLOCK, prompt_of(40)
    plain, _, _ = run_alone(prompt, 150)
    tokens, lengths, request = run_alone(prompt, 150, kv_policy=policy, kv_budget=budget,
                                         kv_policy_options=options)
    assert request.status.value == "length" and request.error is None
    assert request.kv_budget == budget
    # nothing leaves before the cache holds budget + B slots: the first eviction is after the
    # step that fills slot budget + B - 1 (output index budget + B - len(prompt) - 1)
    first_evicting = budget + BLOCK - len(prompt)
    assert tokens[:first_evicting] == plain[:first_evicting]
    assert max(lengths) == budget + BLOCK - 1  # the last output is sampled, never cached
    reached = lengths.index(budget)
    assert all(budget <= n < budget + BLOCK for n in lengths[reached:])
    assert request.num_evicted_tokens == len(prompt) + 150 - 1 - lengths[-1]


@pytest.mark.parametrize("policy,options", DECODE_EVICTING)
def test_a_ratio_keeps_at_least_the_policy_minimum_after_an_early_compression_point(policy,
                                                                                  options):
    """compress_after below the policy's protected tokens (StreamingLLM: its sinks plus one):
    the request is not cut at that point, and decode keeps at least min_budget slots (before,
    the cache was held at the compression point's length, below the policy's minimum, and the
    request ended with an error at its first eviction)."""
    options = {**(options or {}), **({"n_sink": 40} if policy == "streaming" else {})}
    tokens, lengths, request = run_alone(prompt_of(60), 120, compress_after=20,
                                         kv_policy=policy, kv_compression_ratio=0.5,
                                         kv_policy_options=options)
    assert request.status.value == "length" and request.error is None and len(tokens) == 120
    minimum = request.kv_policy.min_budget
    assert request.kv_budget == max(10, minimum)  # floor(20 * 0.5), raised to the minimum
    assert min(lengths[lengths.index(max(lengths)):]) >= request.kv_budget


def test_a_prompt_longer_than_the_budget_is_cut_at_once():
    """The unchanged case, for contrast: the prompt's cache is cut to the budget after prefill."""
    budget = 3 * BLOCK
    _, lengths, request = run_alone(prompt_of(100), 40, kv_policy="streaming",
                                    kv_budget=budget)
    assert request.kv_budget == budget
    assert lengths[0] == budget  # the prefill step compressed 100 -> 48
    assert all(budget <= n < budget + BLOCK for n in lengths)


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_a_reselection_without_free_blocks_is_tried_again_at_the_next_step(policy):
    """A re-selecting policy's compaction whose copy-on-write finds no free block (made to fail
    here once, at the first selection while decoding) is tried again at the next step: the
    cache is back within B ceil(C / B) + B - 1 slots then, not a block later."""
    budget, prompt = 3 * BLOCK, prompt_of(40)
    eng = LLMEngine(EngineConfig.from_kwargs(SHIPPED, **OPTIONS, kv_policy=policy,
                                             kv_budget=budget))
    request = eng.make_request(prompt, SamplingParams(temperature=0, ignore_eos=True,
                                                      max_tokens=60))
    make_private, failed = eng.block_manager.make_private, []

    def no_free_block_once(req, indexes, spare=()):
        if req.compressed and failed in ([], [req.num_cached_slots]):  # both tries of a step
            failed.append(req.num_cached_slots)
            return None  # as when every block is taken, and no spare one helps
        return make_private(req, indexes, spare)

    eng.block_manager.make_private = no_free_block_once
    lengths = cache_lengths(eng, request)
    bound = budget + BLOCK - 1
    assert failed == [budget + BLOCK] * 2  # the first selection while decoding failed
    at = lengths.index(budget + BLOCK)
    assert lengths[at + 1] == budget  # tried again at the next step
    assert max(lengths) == budget + BLOCK and all(n <= bound for n in lengths[at + 1:])
    assert request.status.value == "length" and request.error is None


@pytest.mark.parametrize("policy", ["streaming", "paged_eviction"])
def test_a_compaction_short_of_blocks_for_copy_on_write_gets_them_at_the_next_step(policy):
    """Requests sharing a prompt prefix (prefix caching) in a pool with no free block: a
    compaction must copy the shared blocks it rewrites, finds no block for the copies, and waits.
    The scheduler keeps the copies' blocks free at the next step (preempting newer requests), so
    each request's cache is past the budget's bound after at most one step of its compression,
    not for as long as the pool stays full."""
    budget = 3 * BLOCK
    eng = LLMEngine(EngineConfig.from_kwargs(
        SHIPPED, **{**OPTIONS, "max_model_len": 160}, kv_policy=policy, kv_budget=budget,
        num_kv_blocks=10, enable_prefix_caching=True))
    prefix = prompt_of(4 * BLOCK)
    requests = [eng.make_request(prefix + [(i * 11 + j) % 300 + 5 for i in range(20)],
                                 SamplingParams(temperature=0, ignore_eos=True, max_tokens=70))
                for j in range(3)]
    for request in requests:
        eng.add_prepared(request)
    bound = budget + BLOCK - 1
    steps_past_bound = {r.request_id: 0 for r in requests}
    waited = 0
    while eng.has_unfinished_requests():
        waited += any(r.policy_wait is not None for r in eng.scheduler.running)
        eng.step()
        eng.check_invariants()
        for r in eng.scheduler.running:
            if r.num_computed_tokens >= r.compress_point and r.num_cached_slots > bound:
                steps_past_bound[r.request_id] += 1
    assert waited, "no compaction had to wait for blocks: the scenario lost its point"
    assert all(r.status.value == "length" and r.error is None for r in requests)
    assert max(steps_past_bound.values()) <= 1, steps_past_bound
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
