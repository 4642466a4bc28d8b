"""Scheduler without a model: a fake runner that writes a content key into a fake KV pool for every
scheduled token, checks that every slot a request attends to holds that request's own prefix, and
samples a scripted token for every request with sample=True."""

from __future__ import annotations

import random

import pytest

from nanokv.cache.block_manager import BlockManager
from nanokv.request import PolicyBlockWait, Request, RequestStatus
from nanokv.sampling_params import SamplingParams
from nanokv.scheduler.output import RunnerOutput, SchedulerOutput
from nanokv.scheduler.scheduler import Scheduler


def default_script(request_id: str, index: int) -> int:
    """The token a request samples at output index `index` (deterministic, never 0..9)."""
    return 10 + (sum(map(ord, request_id)) * 7 + index * 13) % 50


class FakeRunner:
    def __init__(self, block_size: int, script=default_script) -> None:
        self.bs = block_size
        self.script = script
        self.pool: dict[int, tuple] = {}  # flat slot -> (salt, tokens up to and including it)

    def slot(self, table: list[int], j: int) -> int:
        return table[j // self.bs] * self.bs + j % self.bs

    def __call__(self, sched: Scheduler, out: SchedulerOutput) -> RunnerOutput:
        # write every new token's K/V first (as the model does per layer) ...
        for s in out.scheduled:
            request = sched.requests[s.request_id]
            tokens = request.all_token_ids
            assert s.token_ids == tokens[s.start_position:s.start_position + s.num_tokens]
            assert s.start_slot == s.start_position  # no KV policy: slots are positions
            for j in range(s.num_tokens):
                pos = s.start_position + j
                self.pool[self.slot(s.block_table, s.start_slot + j)] = (
                    request.cache_salt, tuple(tokens[:pos + 1]))
        # ... then read the whole context: every slot must hold this request's own prefix
        for s in out.scheduled:
            request = sched.requests[s.request_id]
            tokens = request.all_token_ids
            context = s.start_slot + s.num_tokens
            assert len(s.block_table) >= -(-context // self.bs)
            for j in range(context):
                assert self.pool.get(self.slot(s.block_table, j)) == (
                    request.cache_salt, tuple(tokens[:j + 1])), (s.request_id, j)
        return RunnerOutput({s.request_id: self.script(s.request_id, s.output_index)
                             for s in out.scheduled if s.sample})


class Harness:
    def __init__(self, num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                 max_model_len=64, enable_chunked_prefill=True, enable_prefix_caching=True,
                 script=default_script) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.sched = Scheduler(self.bm, max_num_seqs, max_num_batched_tokens, max_model_len,
                               enable_chunked_prefill)
        self.runner = FakeRunner(block_size, script)
        self.all: dict[str, Request] = {}
        self.outputs: list[SchedulerOutput] = []
        self.steps = 0

    def add(self, rid, prompt, eos=(), salt=None, **params) -> Request:
        params.setdefault("max_tokens", 8)
        request = Request(rid, list(prompt), SamplingParams(**params), eos_token_ids=eos,
                          cache_salt=salt)
        self.sched.add_request(request)
        self.all[rid] = request
        self.sched.check_invariants()
        return request

    def step(self) -> SchedulerOutput:
        sched = self.sched
        running_before = list(sched.running)
        computed_before = {r.request_id: r.num_computed_tokens for r in sched.requests.values()}
        out = sched.schedule()
        sched.check_invariants()
        # budgets
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= sched.max_num_seqs
        assert len(sched.running) <= sched.max_num_seqs
        ids = [s.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids))
        # decodes first
        flags = [s.is_decode for s in out.scheduled]
        assert flags == sorted(flags, reverse=True)
        # recompute preemption: the newest running requests, newest first
        k = len(out.preempted_request_ids)
        assert out.preempted_request_ids == [r.request_id for r in running_before[::-1][:k]]
        assert not set(out.preempted_request_ids) & set(ids)
        for rid in out.preempted_request_ids:
            r = self.all[rid]
            assert r.status == RequestStatus.PREEMPTED and not r.block_table
            assert r.num_computed_tokens == 0
        for s in out.scheduled:
            r = self.all[s.request_id]
            assert s.num_tokens >= 1
            assert r.status == RequestStatus.RUNNING
            assert s.start_position == r.num_computed_tokens
            if r in running_before:  # contiguous chunks: it goes on where it stopped
                assert s.start_position == computed_before[s.request_id]
            else:  # admitted (or readmitted) now: starts after its prefix-cache hit, if any
                assert computed_before[s.request_id] == 0
                assert s.start_position % self.bm.block_size == 0
            assert s.sample == (s.start_position + s.num_tokens == r.num_tokens)
            assert s.output_index == r.num_output_tokens
            assert s.block_table == r.block_table
        runner_out = self.runner(sched, out)
        sched.update_from_output(out, runner_out)
        sched.check_invariants()
        self.outputs.append(out)
        self.steps += 1
        return out

    def run(self, max_steps=10_000, on_step=None) -> None:
        while self.sched.has_unfinished:
            self.step()
            if on_step is not None:
                on_step(self)
            assert self.steps < max_steps, "no progress"
        self.assert_all_free()

    def assert_all_free(self) -> None:
        assert not self.sched.running and not self.sched.waiting
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_cnt == 0 for b in self.bm.blocks)
        self.sched.check_invariants()


def expected_output(request: Request, max_model_len: int, script=default_script):
    """Brute-force stop rules: the tokens the script produces until one rule fires."""
    p = request.params
    out = []
    while True:
        t = script(request.request_id, len(out))
        out.append(t)
        n = len(out)
        if n >= p.min_tokens:
            if not p.ignore_eos and t in request.eos_token_ids:
                return out, RequestStatus.FINISHED_STOPPED
            if t in p.stop_token_ids:
                return out, RequestStatus.FINISHED_STOPPED
        if n >= p.max_tokens or request.num_prompt_tokens + n >= max_model_len:
            return out, RequestStatus.FINISHED_LENGTH


# ---- continuous batching ---------------------------------------------------------------------
def test_continuous_batching_respects_budgets():
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=20,
                max_model_len=64)
    rng = random.Random(1)
    for i in range(8):
        h.add(f"r{i}", [rng.randrange(100, 200) for _ in range(rng.randint(5, 15))],
              max_tokens=rng.randint(4, 10), ignore_eos=True)
    max_running = 0
    mixed_steps = 0
    h.run(on_step=lambda h: None)
    for out in h.outputs:
        max_running = max(max_running, len(out.scheduled))
        decodes = any(s.is_decode for s in out.scheduled)
        new_prefill = any(s.start_position == 0 for s in out.scheduled)
        mixed_steps += decodes and new_prefill
    assert max_running == 3
    assert mixed_steps > 0  # new requests join a batch that is decoding
    for r in h.all.values():
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_output(r, 64)[0]
        assert r.num_output_tokens == r.params.max_tokens


def test_max_num_seqs_limits_admission():
    h = Harness(max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        h.add(f"r{i}", [1, 2, 3], max_tokens=3, ignore_eos=True)
    out = h.step()
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in h.sched.waiting] == ["r2", "r3"]
    out = h.step()
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    h.run()


def test_batched_token_budget_limits_admission():
    h = Harness(max_num_batched_tokens=10, max_num_seqs=8)
    h.add("a", range(100, 106), max_tokens=2, ignore_eos=True)
    h.add("b", range(200, 206), max_tokens=2, ignore_eos=True)
    out = h.step()
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("a", 6), ("b", 4)]
    out = h.step()  # a decodes, b finishes its prompt
    assert [(s.request_id, s.num_tokens, s.sample) for s in out.scheduled] == [
        ("a", 1, True), ("b", 2, True)]
    h.run()


# ---- chunked prefill -------------------------------------------------------------------------
def test_chunked_prefill_splits_long_prompt():
    h = Harness(num_blocks=32, block_size=4, max_num_batched_tokens=16, max_model_len=80)
    prompt = list(range(100, 150))  # 50 tokens
    r = h.add("long", prompt, max_tokens=3, ignore_eos=True)
    chunks = []
    for _ in range(4):
        (s,) = h.step().scheduled
        chunks.append((s.start_position, s.start_slot, s.num_tokens, s.sample))
        assert s.token_ids == prompt[s.start_position:s.start_position + s.num_tokens]
        assert len(s.block_table) == -(-(s.start_slot + s.num_tokens) // 4)
    assert chunks == [(0, 0, 16, False), (16, 16, 16, False), (32, 32, 16, False),
                      (48, 48, 2, True)]
    assert r.num_output_tokens == 1 and r.num_computed_tokens == 50
    (s,) = h.step().scheduled
    assert (s.start_position, s.num_tokens, s.sample, s.is_decode) == (50, 1, True, True)
    h.run()
    assert r.output_token_ids == expected_output(r, 80)[0]


def test_without_chunked_prefill_prompts_are_scheduled_whole():
    h = Harness(max_num_batched_tokens=32, enable_chunked_prefill=False)
    h.add("a", range(100, 120), max_tokens=2, ignore_eos=True)
    h.add("b", range(200, 220), max_tokens=2, ignore_eos=True)
    out = h.step()
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("a", 20)]
    out = h.step()
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 20)]
    h.run()


# ---- decodes first ---------------------------------------------------------------------------
def test_decodes_get_budget_before_prefill_chunks():
    h = Harness(num_blocks=64, max_num_batched_tokens=4, max_model_len=64)
    for i in range(3):
        h.add(f"d{i}", [50 + i], max_tokens=20, ignore_eos=True)
    h.step()  # three 1-token prompts
    h.add("long", range(100, 140), max_tokens=2, ignore_eos=True)
    for _ in range(10):
        out = h.step()
        assert [s.request_id for s in out.scheduled[:3]] == ["d0", "d1", "d2"]
        assert all(s.is_decode for s in out.scheduled[:3])
        assert [(s.request_id, s.num_tokens) for s in out.scheduled[3:]] == [("long", 1)]
    h.run()


def test_decode_like_readmission_is_ordered_before_prefills():
    """A request whose prompt is all cached but the last token is a 1-token step: the batch puts
    it among the decodes, ahead of prefill chunks admitted before it."""
    h = Harness(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    prefix = list(range(100, 108))
    h.add("warm", prefix + [1], max_tokens=1, ignore_eos=True)
    h.run()
    h.add("p", range(200, 220), max_tokens=1, ignore_eos=True)
    h.add("c", prefix + [2], max_tokens=1, ignore_eos=True)
    out = h.step()
    assert [s.request_id for s in out.scheduled] == ["c", "p"]
    assert out.scheduled[0].is_decode and out.scheduled[0].start_position == 8
    assert h.all["c"].num_cached_tokens == 8
    h.run()


# ---- preemption ------------------------------------------------------------------------------
def test_recompute_preemption_newest_first_and_outputs_complete():
    h = Harness(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                max_model_len=32)
    for i in range(4):
        h.add(f"r{i}", [10 * i + j for j in range(6)], max_tokens=14, ignore_eos=True)
    h.run()
    preempted = [rid for out in h.outputs for rid in out.preempted_request_ids]
    assert preempted, "the pool is too small for all four: someone must be preempted"
    assert h.sched.num_preemptions == len(preempted)
    assert h.bm.stats.evicted_blocks["preemption"] > 0
    assert "r0" not in preempted  # the oldest always progresses
    for r in h.all.values():
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == 14
        assert r.output_token_ids == expected_output(r, 32)[0]
    assert sum(r.num_preemptions for r in h.all.values()) == len(preempted)
    # same outputs as a run with a pool big enough for everyone
    ref = Harness(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                  max_model_len=32)
    for i in range(4):
        ref.add(f"r{i}", [10 * i + j for j in range(6)], max_tokens=14, ignore_eos=True)
    ref.run()
    assert not any(out.preempted_request_ids for out in ref.outputs)
    for rid, r in h.all.items():
        assert r.output_token_ids == ref.all[rid].output_token_ids


def test_preempted_request_waits_at_the_front_and_recomputes_its_outputs():
    h = Harness(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                max_model_len=16, enable_prefix_caching=False)
    a = h.add("a", range(100, 107), max_tokens=8, ignore_eos=True)  # 7 tokens: 2 blocks
    b = h.add("b", range(200, 207), max_tokens=8, ignore_eos=True)
    h.add("c", range(300, 302), max_tokens=1, ignore_eos=True)
    h.step()  # a and b prefill, 4 blocks used; c cannot get a block
    assert [r.request_id for r in h.sched.running] == ["a", "b"]
    out = h.step()  # both decode to 8 tokens: still 2 blocks each
    assert not out.preempted_request_ids
    out = h.step()  # the 9th token needs a third block: b (newest) is preempted for a
    assert out.preempted_request_ids == ["b"]
    assert [s.request_id for s in out.scheduled] == ["a"]
    assert [r.request_id for r in h.sched.waiting] == ["b", "c"]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_tokens == 2
    h.run()
    assert b.num_output_tokens == 8 and b.num_preemptions >= 1
    assert a.output_token_ids == expected_output(a, 16)[0]
    assert b.output_token_ids == expected_output(b, 16)[0]


def test_preemption_of_the_request_itself_when_alone():
    """With one request running and no free block, the request preempts itself and is
    recomputed when its turn comes; it must not wedge the scheduler."""
    h = Harness(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                max_model_len=16)
    h.add("a", range(100, 110), max_tokens=6, ignore_eos=True)
    h.add("b", range(200, 204), max_tokens=4, ignore_eos=True)
    h.run(max_steps=200)
    for r in h.all.values():
        assert r.output_token_ids == expected_output(r, 16)[0]


# ---- abort -----------------------------------------------------------------------------------
def test_abort_running_and_waiting_frees_blocks():
    h = Harness(num_blocks=16, max_num_seqs=1, max_num_batched_tokens=64)
    a = h.add("a", range(100, 110), max_tokens=10, ignore_eos=True)
    b = h.add("b", range(200, 210), max_tokens=10, ignore_eos=True)
    h.step()
    assert a.status == RequestStatus.RUNNING and a.block_table
    assert b.status == RequestStatus.WAITING
    assert h.sched.abort("a") is a
    assert a.status == RequestStatus.FINISHED_ABORTED and a.block_table == []
    assert h.bm.num_free_blocks == h.bm.num_blocks
    h.sched.check_invariants()
    assert h.sched.abort("b") is b
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert not h.sched.waiting and not h.sched.running and not h.sched.has_unfinished
    assert h.sched.abort("b") is None and h.sched.abort("nope") is None
    assert h.sched.schedule().is_empty
    h.assert_all_free()


def test_abort_preempted_request():
    h = Harness(num_blocks=4, block_size=4, max_num_batched_tokens=32, max_model_len=16,
                enable_prefix_caching=False)
    h.add("a", range(100, 107), max_tokens=8, ignore_eos=True)
    b = h.add("b", range(200, 207), max_tokens=8, ignore_eos=True)
    while b.status != RequestStatus.PREEMPTED:
        h.step()
    assert h.sched.abort("b") is b and b.status == RequestStatus.FINISHED_ABORTED
    assert b not in h.sched.waiting
    h.sched.check_invariants()
    h.run()


def test_abort_between_schedule_and_update():
    h = Harness()
    a = h.add("a", range(100, 110), max_tokens=4, ignore_eos=True)
    h.add("b", range(200, 210), max_tokens=4, ignore_eos=True)
    out = h.sched.schedule()
    runner_out = h.runner(h.sched, out)
    h.sched.abort("a")
    progressed = h.sched.update_from_output(out, runner_out)
    assert [r.request_id for r in progressed] == ["b"]
    assert a.num_output_tokens == 0
    h.sched.check_invariants()
    h.run()


# ---- stop conditions -------------------------------------------------------------------------
def scripted(tokens):
    return lambda rid, i: tokens[i] if i < len(tokens) else 40 + i


@pytest.mark.parametrize("case", [
    # (params, eos ids, script, expected outputs, status, stop_reason)
    ({"max_tokens": 10}, (7,), [11, 12, 7, 13], [11, 12, 7], "stop", None),
    ({"max_tokens": 5, "ignore_eos": True}, (7,), [11, 7, 7, 7, 7, 7], [11, 7, 7, 7, 7],
     "length", None),
    ({"max_tokens": 10, "stop_token_ids": [9]}, (), [11, 9, 12], [11, 9], "stop", 9),
    ({"max_tokens": 10, "stop_token_ids": [9], "ignore_eos": True}, (9,), [11, 9], [11, 9], "stop",
     9),
    ({"max_tokens": 4}, (), [11, 12, 13, 14, 15, 16], [11, 12, 13, 14], "length", None),
    ({"max_tokens": 10, "min_tokens": 3}, (7,), [7, 7, 7, 7], [7, 7, 7], "stop", None),
    ({"max_tokens": 10, "min_tokens": 3, "stop_token_ids": [9]}, (), [9, 9, 11, 9], [9, 9, 11, 9],
     "stop", 9),
    ({"max_tokens": 3, "min_tokens": 3}, (7,), [7, 7, 7, 7], [7, 7, 7], "stop", None),
    ({"max_tokens": 1}, (7,), [11], [11], "length", None),
])
def test_stop_conditions(case):
    params, eos, script, expected, status, stop_reason = case
    h = Harness(script=scripted(script))
    r = h.add("r", [1, 2, 3], eos=eos, **params)
    h.run(max_steps=50)
    assert r.output_token_ids == expected
    assert r.status.value == status
    assert r.stop_reason == stop_reason


@pytest.mark.parametrize("params,eos,expected", [
    # (params, eos ids, what each of the first four sampled tokens may not be)
    ({"min_tokens": 2}, (7,), [(7,), (7,), (), ()]),
    ({"min_tokens": 3, "stop_token_ids": [9, 7]}, (7,), [(7, 9), (7, 9), (7, 9), ()]),
    ({"min_tokens": 2, "stop_token_ids": [9], "ignore_eos": True}, (7,), [(9,), (9,), (), ()]),
    ({"min_tokens": 0, "stop_token_ids": [9]}, (7,), [(), (), (), ()]),
])
def test_banned_tokens_before_min_tokens(params, eos, expected):
    """The scheduler tells the sampler what each output token may not be: EOS (unless
    ignore_eos) and stop_token_ids while fewer than min_tokens outputs exist."""
    h = Harness(script=scripted([11, 12, 13, 14, 15]))
    h.add("r", range(100, 110), eos=eos, max_tokens=5, **params)
    seen = []
    while h.sched.has_unfinished and len(seen) < 4:
        out = h.step()
        seen += [set(s.banned_token_ids[0]) if s.banned_token_ids else set()
                 for s in out.scheduled if s.sample]
    assert seen == [set(e) for e in expected]


def test_a_prompt_is_admitted_only_when_all_of_it_fits():
    """vLLM's rule: a waiting request starts when the free blocks hold its whole prompt (after
    prefix hits), not just its first chunk; otherwise it would be preempted and computed again.
    Brute force: it starts at the first step at which that is true, and nothing is preempted."""
    h = Harness(num_blocks=8, block_size=4, max_num_batched_tokens=4, max_model_len=64)
    r = h.add("r", range(100, 112), max_tokens=6, ignore_eos=True)  # 3 blocks, grows to 5
    h.step()
    big = h.add("big", range(200, 220), max_tokens=2, ignore_eos=True)  # 20 tokens: 5 blocks
    while big.status == RequestStatus.WAITING:
        free = h.bm.num_free_blocks
        h.step()
        if big.status == RequestStatus.RUNNING:
            assert free >= 5  # admitted only once all of its blocks were free
    assert h.sched.num_preemptions == 0
    h.run()
    assert r.status == big.status == RequestStatus.FINISHED_LENGTH
    assert h.sched.num_preemptions == 0


# ---- a KV-policy step waiting for blocks --------------------------------------------------------
def shared_in(h: Harness, request: Request, indexes) -> int:
    """Brute force: the request's blocks at `indexes` that another running request holds too."""
    others = [set(r.block_table) for r in h.sched.running if r is not request]
    return sum(1 for i in indexes if any(request.block_table[i] in t for t in others))


def test_a_compaction_waiting_for_copies_gets_free_blocks_from_newer_requests():
    """A request whose compaction found no free block for its copy-on-write (`policy_wait`)
    gets them at the next schedule: newer running requests are preempted until the blocks it
    still shares are free to copy. Brute force: the shared blocks counted from the tables."""
    h = Harness(num_blocks=7, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                max_model_len=32)
    prefix = list(range(100, 108))  # two full blocks, shared by prefix caching
    a = h.add("a", prefix + [1, 2, 3], max_tokens=8, ignore_eos=True)
    h.step()
    b = h.add("b", prefix + [4, 5, 6], max_tokens=8, ignore_eos=True)
    c = h.add("c", [7, 8, 9, 10, 11], max_tokens=8, ignore_eos=True)
    h.step()
    assert [r.request_id for r in h.sched.running] == ["a", "b", "c"]
    assert shared_in(h, a, range(3)) == 2 and h.bm.blocks_wanted(a) == 0
    a.policy_wait = PolicyBlockWait(private=range(0, 3))
    assert h.bm.blocks_wanted(a) == 2
    assert h.bm.num_free_blocks == 1  # 3 + 1 + 2 of 7 blocks held
    out = h.step()  # a's next slot takes the free block; c (newest) goes for the copies
    assert out.preempted_request_ids == ["c"]
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert h.bm.num_free_blocks >= shared_in(h, a, range(3)) == h.bm.blocks_wanted(a) == 2
    a.policy_wait = None  # the compaction ran
    h.run()
    for r in (a, b, c):
        assert r.output_token_ids == expected_output(r, 32)[0]


def test_a_compaction_with_spare_blocks_waits_only_for_the_copies_they_do_not_cover():
    """The request's own spare blocks (its unread tail: `PolicyBlockWait.spare`) take copies
    too: the scheduler keeps free only the copies beyond them, and preempts no one for those
    they cover; pool-pressure eviction is asked for those kept blocks too. Brute force: the
    shared blocks counted from the tables."""
    h = Harness(num_blocks=7, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                max_model_len=32)
    prefix = list(range(100, 108))
    a = h.add("a", prefix + [1, 2, 3], max_tokens=8, ignore_eos=True)
    h.step()
    h.add("b", prefix + [4, 5, 6], max_tokens=8, ignore_eos=True)
    h.add("c", [7, 8, 9, 10, 11], max_tokens=8, ignore_eos=True)
    h.step()
    assert shared_in(h, a, range(3)) == 2 and h.bm.num_free_blocks == 1
    a.policy_wait = PolicyBlockWait(private=range(0, 3), spare=2)
    assert h.bm.blocks_wanted(a) == 0
    out = h.step()  # a's next slot takes the free block: nothing left, and nothing needed
    assert out.preempted_request_ids == [] and h.bm.num_free_blocks == 0
    w = h.add("w", [40, 41, 42], max_tokens=2, ignore_eos=True)  # one block
    assert h.sched.blocks_to_admit() == 1  # what pool-pressure eviction would free for it
    a.policy_wait = PolicyBlockWait(private=range(0, 3), spare=1)
    assert h.bm.blocks_wanted(a) == 1 == shared_in(h, a, range(3)) - 1
    assert h.sched.blocks_to_admit() == 1 + 1  # and the block kept for a's copy
    out = h.step()
    assert out.preempted_request_ids == ["c"]  # the newest, for the one copy not covered
    assert h.bm.num_free_blocks >= 1 and w.status == RequestStatus.WAITING


def test_blocks_kept_for_a_waiting_policy_step_are_not_given_to_a_waiting_request():
    """Scratch blocks a policy step waits for stay free: a waiting request that would take them
    is not admitted, and a newer running request that needs one to grow is preempted instead."""
    h = Harness(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                max_model_len=32)
    a = h.add("a", range(100, 117), max_tokens=3, ignore_eos=True)  # 5 blocks throughout
    b = h.add("b", range(200, 203), max_tokens=6, ignore_eos=True)  # 1 block, then 2
    h.step()
    assert h.bm.num_free_blocks == 2
    a.policy_wait = PolicyBlockWait(scratch=2)  # the rest of the pool
    w = h.add("w", range(300, 303), max_tokens=2, ignore_eos=True)  # 1 block
    preempted = []
    for _ in range(2):
        preempted += h.step().preempted_request_ids
        assert w.status == RequestStatus.WAITING and h.bm.num_free_blocks >= 2
    assert preempted == ["b"]  # its fifth slot needed a third block: not one of a's
    a.policy_wait = None
    h.run()
    for r in (a, b, w):
        assert r.output_token_ids == expected_output(r, 32)[0]


def test_a_wait_the_pool_cannot_meet_preempts_no_one():
    """A need larger than the pool beside the request's own blocks cannot be met by preempting
    newer requests: they keep running (the request goes on without its policy step)."""
    h = Harness(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                max_model_len=32)
    a = h.add("a", range(100, 111), max_tokens=8, ignore_eos=True)  # 3 blocks
    h.step()
    b = h.add("b", range(200, 203), max_tokens=8, ignore_eos=True)
    h.step()
    a.policy_wait = PolicyBlockWait(scratch=8 - 3 + 1)  # one more than the rest of the pool
    for _ in range(3):
        out = h.step()
        assert not out.preempted_request_ids
        assert [r.request_id for r in h.sched.running] == ["a", "b"]
    a.policy_wait = PolicyBlockWait(scratch=8 - len(a.block_table))  # all the rest: b goes
    assert h.step().preempted_request_ids == ["b"]
    a.policy_wait = None
    h.run()
    assert b.output_token_ids == expected_output(b, 32)[0]


def test_copies_wanted_beyond_the_rest_of_the_pool_are_met_by_preempting_the_sharer():
    """A compaction wanting more copies than the pool holds beside its request is not beyond
    reach: preempting the newer request it shares the blocks with makes them its own."""
    h = Harness(num_blocks=5, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                max_model_len=20)
    prefix = list(range(100, 108))
    a = h.add("a", prefix + [1, 2, 3, 4, 5], max_tokens=3, ignore_eos=True)  # 4 blocks
    h.step()
    b = h.add("b", prefix + [6, 7], max_tokens=3, ignore_eos=True)  # a's two + 1 block
    h.step()
    assert h.bm.num_free_blocks == 0 and shared_in(h, a, range(4)) == 2
    a.policy_wait = PolicyBlockWait(private=range(0, 4))
    assert h.bm.blocks_wanted(a) == 2 > h.bm.num_blocks - len(a.block_table)
    assert h.step().preempted_request_ids == ["b"]
    assert h.bm.blocks_wanted(a) == 0
    a.policy_wait = None
    h.run()
    assert b.output_token_ids == expected_output(b, 20)[0]


def test_a_waiting_policy_step_never_preempts_its_own_request():
    """Alone, a request whose policy step wants more blocks than the pool has free keeps running
    (preempting itself would only bring it back to the same wait)."""
    h = Harness(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                max_model_len=16)
    a = h.add("a", range(100, 106), max_tokens=6, ignore_eos=True)
    h.step()
    a.policy_wait = PolicyBlockWait(scratch=100)
    h.run(max_steps=50)
    assert h.sched.num_preemptions == 0
    assert a.output_token_ids == expected_output(a, 16)[0]


def test_stop_at_max_model_len():
    h = Harness(max_model_len=16)
    r = h.add("r", range(100, 110), max_tokens=100, ignore_eos=True)
    h.run()
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.num_tokens == 16 and r.num_output_tokens == 6
    assert r.num_computed_tokens == 15  # the last token is never fed back


def test_longest_prompt_gets_one_token():
    h = Harness(max_model_len=16)
    r = h.add("r", range(100, 115), max_tokens=100, ignore_eos=True)
    h.run()
    assert r.num_output_tokens == 1 and r.status == RequestStatus.FINISHED_LENGTH


# ---- add_request validation ------------------------------------------------------------------
def test_add_request_rejects_without_allocating():
    h = Harness(num_blocks=8, block_size=4, max_model_len=16)
    for n in (16, 17, 40):
        with pytest.raises(ValueError, match="max_model_len"):
            h.sched.add_request(Request(f"long{n}", list(range(n)), SamplingParams()))
    assert not h.sched.waiting and not h.sched.requests
    a = h.add("a", range(15), max_tokens=1)  # max_model_len - 1 is fine
    with pytest.raises(ValueError, match="already in use"):
        h.sched.add_request(Request("a", [1, 2], SamplingParams()))
    assert list(h.sched.waiting) == [a]
    h.step()
    assert h.bm.num_used_blocks == 0  # a finished at max_model_len after one token
    b = h.add("b", range(10), max_tokens=4, ignore_eos=True)
    h.step()
    used = h.bm.num_used_blocks
    with pytest.raises(ValueError, match="already in use"):
        h.sched.add_request(Request("b", [1, 2], SamplingParams()))  # running duplicate
    assert h.bm.num_used_blocks == used and h.sched.running == [b]
    h.sched.check_invariants()
    h.run()
    h.add("a", [1, 2, 3], max_tokens=1)  # a finished id may be used again
    h.run()


def test_add_request_rejects_empty_prompt():
    """An empty prompt would be scheduled as a 0-token chunk with sample=True."""
    h = Harness()
    with pytest.raises(ValueError, match="empty"):
        h.sched.add_request(Request("e", [], SamplingParams()))
    assert not h.sched.requests and h.sched.schedule().is_empty
    h.sched.check_invariants()


def test_add_request_rejects_request_that_can_outgrow_the_pool():
    """A request whose prompt + max_tokens exceeds the whole pool would preempt itself forever
    once it outgrew it, and, at the head of the waiting queue, block everyone behind it."""
    h = Harness(num_blocks=4, block_size=4, max_model_len=64)  # 16 slots
    before = h.bm.num_free_blocks
    for prompt_len, max_tokens in ((8, 10), (17, 1), (10, 50)):
        with pytest.raises(ValueError, match="KV blocks"):
            h.sched.add_request(Request("big", list(range(prompt_len)),
                                        SamplingParams(max_tokens=max_tokens)))
    assert not h.sched.requests and h.bm.num_free_blocks == before
    # 16 slots hold prompt + max_tokens - 1 = 16 (the last sampled token is never computed)
    a = h.add("a", range(100, 110), max_tokens=7, ignore_eos=True)
    b = h.add("b", range(200, 215), max_tokens=1)
    h.run(max_steps=100)
    assert a.num_output_tokens == 7 and b.num_output_tokens == 1
    # the cap is max_model_len: a small max_model_len lets a large max_tokens in
    h = Harness(num_blocks=4, block_size=4, max_model_len=17)
    c = h.add("c", range(100, 110), max_tokens=1000, ignore_eos=True)
    h.run(max_steps=100)
    assert c.num_tokens == 17


# ---- stats -----------------------------------------------------------------------------------
def test_stats_snapshot():
    h = Harness(num_blocks=16, block_size=4)
    h.add("a", range(100, 109), max_tokens=5, ignore_eos=True)
    h.step()
    h.add("b", range(100, 109), max_tokens=5, ignore_eos=True)
    h.step()
    st = h.sched.stats()
    assert (st.num_running, st.num_waiting, st.num_total_blocks) == (2, 0, 16)
    assert st.num_free_blocks == h.bm.num_free_blocks
    assert st.prefix_cache_queries == 18 and st.prefix_cache_hits == 8
    assert h.all["b"].num_cached_tokens == 8
    # prefix caching off: nothing is looked up, so nothing is counted (the hit rate is then
    # undefined, not 0, and its alert stays silent; vLLM counts the same way)
    off = Harness(num_blocks=16, block_size=4, enable_prefix_caching=False)
    for rid in ("a", "b"):
        off.add(rid, range(100, 109), max_tokens=5, ignore_eos=True)
        off.step()
    st = off.sched.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (0, 0)
    assert off.all["b"].num_cached_tokens == 0
    h.run()


# ---- randomized soak -------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_soak_tiny_pool_random_aborts(seed):
    rng = random.Random(seed)
    vocab = 8
    eos = (0,)

    def script(rid, i):
        return random.Random(f"{seed}-{rid}-{i}").randrange(vocab)

    max_model_len = 40
    h = Harness(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                max_model_len=max_model_len, script=script,
                enable_chunked_prefill=rng.random() < 0.8)
    if not h.sched.enable_chunked_prefill:
        h.sched.max_num_batched_tokens = max_model_len
    bases = [[rng.randrange(1, vocab) for _ in range(12)] for _ in range(3)]
    aborted = set()
    pending = 150
    n = 0
    while pending or h.sched.has_unfinished:
        for _ in range(min(pending, rng.randint(0, 3))):
            base = rng.choice(bases)
            prompt = base[:rng.randint(0, 12)] + [rng.randrange(vocab)
                                                  for _ in range(rng.randint(1, 14))]
            max_tokens = rng.randint(1, 20)
            h.add(f"s{n}", prompt, eos=eos, salt=rng.choice([None, None, "t"]),
                  max_tokens=max_tokens, min_tokens=rng.randint(0, min(3, max_tokens)),
                  ignore_eos=rng.random() < 0.3,
                  stop_token_ids=rng.sample(range(1, vocab), rng.randint(0, 1)))
            n += 1
            pending -= 1
        if h.sched.requests and rng.random() < 0.05:
            rid = rng.choice(sorted(h.sched.requests))
            h.sched.abort(rid)
            aborted.add(rid)
            h.sched.check_invariants()
        h.step()
        assert h.steps < 5000
    h.assert_all_free()
    assert n == 150
    for rid, r in h.all.items():
        assert r.is_finished
        if rid in aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED
            continue
        out, status = expected_output(r, max_model_len, script)
        assert r.output_token_ids == out, rid
        assert r.status == status
    assert h.bm.stats.prefix_cache_hits > 0
