"""A KV-policy step that found the pool short of blocks (`request.policy_wait`: a compaction's
copy-on-write, KVzip's scratch blocks) has them kept free by the scheduler at the next step, so
the oldest running request waits one step, not two. Three ways the second try could still find
too few blocks, each checked on the shipped model: a request admitted after the reservation
sharing the waiting request's blocks (one more copy), a KVzip pass tried a decode step later
(one more slot), and a newer request's waiting step running first and taking the oldest one's
blocks. Oracles: the waits and the running order observed after every step, invariants, every
block back at the end."""

import os

from nanokv.config import EngineConfig
from nanokv.engine.llm_engine import LLMEngine
from nanokv.policies.base import PolicyConfig
from nanokv.sampling_params import SamplingParams

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "..", "models", "nanokv-tiny")


def engine(**options) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(
        SHIPPED, **{"block_size": 16, "max_model_len": 144, "max_num_seqs": 6,
                    "enable_prefix_caching": True, **options}))


def tokens(n: int, mul: int, add: int) -> list[int]:
    return [(i * mul) % 3000 + add for i in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens)


def run(eng: LLMEngine, oldest, between_steps=None) -> list[int]:
    """Run to the end; the steps after which `oldest`, running first with newer requests beside
    it, still waited though it had waited before the step too."""
    late, step = [], 0
    while eng.has_unfinished_requests():
        step += 1
        if between_steps is not None:
            between_steps(step)
        waited = oldest.policy_wait is not None
        eng.step()
        eng.check_invariants()
        running = eng.scheduler.running
        if waited and oldest.policy_wait is not None and len(running) > 1 \
                and running[0] is oldest:
            late.append(step)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    return late


def test_a_request_admitted_after_the_reservation_pays_for_the_copy_it_adds():
    """C, admitted the step after A's compaction waited, takes prefix hits on blocks A held
    alone: each is one more copy for A's retry, kept free before C is admitted."""
    eng = engine(max_model_len=128, max_num_batched_tokens=48, num_kv_blocks=8,
                 kv_policy="streaming", kv_budget=32)
    prefix = tokens(64, 37, 7)
    a = eng.make_request(prefix + [11 + i for i in range(10)], greedy(20), request_id="A")
    b = eng.make_request(prefix[:16] + [400 + i for i in range(10)], greedy(20), request_id="B")
    c = eng.make_request(prefix[:32] + [1500 + i for i in range(10)], greedy(20), request_id="C")
    d = eng.make_request(tokens(20, 1, 900), greedy(20), request_id="D")
    eng.add_prepared(d)
    eng.add_prepared(a)
    seen = []

    def between_steps(step):
        if step == 2:
            eng.add_prepared(b)
        if step == 3:
            seen.append(a.policy_wait)
            eng.abort("D")  # frees blocks without a preemption: admission runs
            eng.add_prepared(c)

    assert run(eng, a, between_steps) == []
    assert seen[0] is not None, "A's compaction did not wait: the scenario lost its point"
    assert all(r.error is None for r in (a, b, c))


def test_a_kvzip_pass_tried_a_decode_step_later_has_the_blocks_it_needs_then():
    """The scratch blocks a failed pass needs are counted for the cache it will have at its
    next try (one slot more), so that try does not fail again for want of one block."""
    eng = engine(max_num_seqs=4, max_num_batched_tokens=128, num_kv_blocks=9,
                 kv_policy="kvzip", kv_budget=32)
    a = eng.make_request(tokens(42, 37, 7), greedy(20), request_id="A")
    for r in (a, eng.make_request(tokens(20, 53, 9), greedy(20), request_id="B"),
              eng.make_request(tokens(20, 71, 5), greedy(20), request_id="E")):
        eng.add_prepared(r)
    waits = []
    late = run(eng, a, lambda step: waits.append(a.policy_wait))
    assert any(w is not None for w in waits), "A never waited: the scenario lost its point"
    assert late == []


def test_the_oldest_waiting_step_runs_first():
    """A newer request's waiting step (W, decoding: scheduled before A's prefill chunk) must not
    take the blocks kept free for the oldest request's (A) first."""
    eng = engine(max_num_batched_tokens=48, num_kv_blocks=9)
    prefix = tokens(48, 37, 7)
    a = eng.make_request(prefix + [100 + i for i in range(15)], greedy(4), request_id="A",
                         kv_policy=PolicyConfig("streaming", budget=32), compress_after=60)
    x = eng.make_request(prefix + [200, 201], greedy(20), request_id="X")
    w = eng.make_request(prefix + [300 + i for i in range(10)], greedy(20), request_id="W",
                         kv_policy=PolicyConfig("streaming", budget=48))
    z = eng.make_request(tokens(20, 1, 500), greedy(20), request_id="Z")
    eng.add_prepared(a)
    waits = []

    def between_steps(step):
        waits.append((a.policy_wait, w.policy_wait))
        if step == 2:
            for r in (x, w, z):
                eng.add_prepared(r)
        if step == 3:
            eng.abort("Z")

    assert run(eng, a, between_steps) == []
    assert any(wa is not None for wa, _ in waits) and any(ww is not None for _, ww in waits), \
        "A and W did not both wait: the scenario lost its point"
