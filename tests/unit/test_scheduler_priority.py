"""The priority scheduling policy (vLLM's `--scheduling-policy priority`) without a model: the
order of admission and the victims of preemption, hand-computed for small cases and checked step
by step against a brute-force simulation of the rule; fcfs against the same simulation."""

from __future__ import annotations

import random

import pytest

from nanokv.cache.block_manager import BlockManager
from nanokv.request import Request, RequestStatus
from nanokv.sampling_params import SamplingParams
from nanokv.scheduler.output import RunnerOutput
from nanokv.scheduler.scheduler import Scheduler


def make_scheduler(policy, num_blocks=8, block_size=4, max_num_seqs=4, budget=32):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    return Scheduler(bm, max_num_seqs, budget, max_model_len=256, scheduling_policy=policy)


def add(sched, rid, prompt_len, priority, arrival, max_tokens=4) -> Request:
    request = Request(rid, [1 + i % 7 for i in range(prompt_len)],
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      arrival_time=arrival, priority=priority)
    sched.add_request(request)
    return request


def step(sched):
    """One step with a fake runner (every sampled token is 5); the scheduled tokens by request
    and the preempted ids."""
    out = sched.schedule()
    sched.check_invariants()
    sched.update_from_output(out, RunnerOutput({s.request_id: 5 for s in out.scheduled
                                                if s.sample}))
    sched.check_invariants()
    return {s.request_id: s.num_tokens for s in out.scheduled}, out.preempted_request_ids


def admission_order(sched, max_steps=500):
    order = []
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return order
        scheduled, _ = step(sched)
        order += [rid for rid in scheduled if rid not in order]
    raise AssertionError("no progress")


@pytest.mark.parametrize("policy,expected", [("fcfs", ["a", "b", "c", "d"]),
                                             ("priority", ["b", "d", "c", "a"])])
def test_one_at_a_time_admission_order(policy, expected):
    sched = make_scheduler(policy, max_num_seqs=1)
    for arrival, (rid, priority) in enumerate([("a", 2), ("b", 0), ("c", 1), ("d", 0)], 1):
        add(sched, rid, 6, priority, arrival)
    assert admission_order(sched) == expected


def test_victim_is_largest_priority_even_if_already_scheduled():
    """a (priority 1, older) and b (priority 0) decode in a pool that runs out: fcfs preempts b
    (the newest), priority preempts a, which was scheduled first in the step: its token goes
    back to the budget and b decodes alone."""
    results = {}
    for policy in ("fcfs", "priority"):
        sched = make_scheduler(policy, num_blocks=4, block_size=4)
        add(sched, "a", 4, 1, 1.0, max_tokens=8)
        add(sched, "b", 4, 0, 2.0, max_tokens=8)
        steps = [step(sched) for _ in range(6)]
        results[policy] = [p for _, p in steps if p]
        first = next(i for i, (_, p) in enumerate(steps) if p)
        results[policy + " step"] = steps[first][0]
    assert results["fcfs"][0] == ["b"] and results["fcfs step"] == {"a": 1}
    assert results["priority"][0] == ["a"] and results["priority step"] == {"b": 1}


def test_preempted_request_keeps_its_priority_place():
    """a (priority 1) is preempted for b (priority 0); c (priority 1, arrived after a) waits:
    a goes back ahead of c, as vLLM's priority queue orders it (fcfs: at the front anyway)."""
    sched = make_scheduler("priority", num_blocks=4, block_size=4, max_num_seqs=2)
    add(sched, "a", 4, 1, 1.0, max_tokens=8)
    add(sched, "b", 4, 0, 2.0, max_tokens=8)
    add(sched, "c", 4, 1, 3.0, max_tokens=2)
    add(sched, "d", 4, 2, 0.5, max_tokens=2)
    while not sched.num_preemptions:
        step(sched)
    assert [r.request_id for r in sched.waiting] == ["a", "c", "d"]
    assert sched.requests["a"].status == RequestStatus.PREEMPTED


def test_waiting_request_never_preempts():
    """A waiting request of priority -5 waits for a running one of priority 5 to finish."""
    sched = make_scheduler("priority", max_num_seqs=1)
    add(sched, "low", 4, 5, 1.0, max_tokens=3)
    step(sched)
    add(sched, "urgent", 4, -5, 2.0)
    assert admission_order(sched) == ["low", "urgent"]
    assert sched.num_preemptions == 0


def test_bad_policy():
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of \['fcfs', "
                                         r"'priority'\], got 'lifo'"):
        make_scheduler("lifo")


class Oracle:
    """The rule, brute force: a step schedules the running requests in order, each its remaining
    known tokens within the budget, preempting for the blocks it lacks the newest running
    request (fcfs) or the one with the largest (priority, arrival) (priority), unscheduling it if
    it came earlier; with no preemption, admits waiting requests from the front of the queue
    (fcfs: arrival, preempted ones at the front; priority: (priority, arrival)) while their
    whole known sequence fits the free blocks."""

    def __init__(self, policy, num_blocks, block_size, max_num_seqs, budget):
        self.policy, self.free, self.bs = policy, num_blocks, block_size
        self.max_num_seqs, self.budget = max_num_seqs, budget
        self.running, self.waiting = [], []

    def add(self, rid, prompt_len, priority, arrival, max_tokens):
        self.waiting.append(dict(rid=rid, tokens=prompt_len, out=0, max_tokens=max_tokens,
                                 computed=0, blocks=0, key=(priority, arrival)))
        if self.policy == "priority":
            self.waiting.sort(key=lambda r: r["key"])

    def blocks(self, tokens):
        return -(-tokens // self.bs)

    def step(self):
        budget, scheduled, preempted, i = self.budget, {}, [], 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = min(r["tokens"] - r["computed"], budget)
            while self.blocks(r["computed"] + n) - r["blocks"] > self.free:
                if self.policy == "fcfs":
                    v = len(self.running) - 1
                else:
                    v = max(range(len(self.running)), key=lambda k: self.running[k]["key"])
                victim = self.running.pop(v)
                self.free += victim["blocks"]
                victim["blocks"] = victim["computed"] = 0
                preempted.append(victim["rid"])
                if self.policy == "fcfs":
                    self.waiting.insert(0, victim)
                else:
                    self.waiting = sorted(self.waiting + [victim], key=lambda q: q["key"])
                if victim is r:
                    break
                if v < i:
                    i -= 1
                    budget += scheduled.pop(victim["rid"])
            if r["rid"] in preempted:
                break
            self.take(r, n)
            scheduled[r["rid"]] = n
            budget -= n
            i += 1
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            r = self.waiting[0]
            if self.blocks(r["tokens"]) > self.free:
                break
            n = min(r["tokens"], budget)
            self.take(r, n)
            self.running.append(self.waiting.pop(0))
            scheduled[r["rid"]] = n
            budget -= n
        for r in list(self.running):
            if r["rid"] in scheduled:
                r["computed"] += scheduled[r["rid"]]
                if r["computed"] == r["tokens"]:
                    r["tokens"] += 1
                    r["out"] += 1
                    if r["out"] == r["max_tokens"]:
                        self.running.remove(r)
                        self.free += r["blocks"]
        return scheduled, preempted

    def take(self, r, n):
        need = self.blocks(r["computed"] + n) - r["blocks"]
        self.free -= need
        r["blocks"] += need


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", range(12))
def test_against_brute_force_oracle(policy, seed):
    rng = random.Random(seed)
    shape = dict(num_blocks=rng.randint(6, 12), block_size=4, max_num_seqs=rng.randint(2, 5),
                 budget=rng.choice([8, 16, 32]))
    sched, oracle = make_scheduler(policy, **shape), Oracle(policy, **shape)
    pending = []
    for k in range(rng.randint(4, 10)):
        prompt_len, max_tokens = rng.randint(1, 12), rng.randint(1, 12)
        pending.append((f"r{k}", prompt_len, rng.randint(-2, 2), float(k + 1), max_tokens))
    steps = 0
    while pending or sched.has_unfinished:
        for _ in range(rng.randint(0, 3) if steps else len(pending) // 2):  # bursts
            if pending:
                rid, prompt_len, priority, arrival, max_tokens = pending.pop(0)
                add(sched, rid, prompt_len, priority, arrival, max_tokens)
                oracle.add(rid, prompt_len, priority, arrival, max_tokens)
        got, want = step(sched), oracle.step()
        assert got == want, f"step {steps}"
        steps += 1
        assert steps < 1000
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not sched.waiting and not sched.running
