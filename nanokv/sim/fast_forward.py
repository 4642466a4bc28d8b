"""Runs of pure decode steps applied at once (exact: the same blocks, hashes and step times).

After a step of decodes only (every running request, nobody preempted) with no admission
possible (nobody waiting, or max_num_seqs running), the next steps are the same decodes until a
request finishes, a request arrives (unless max_num_seqs run: it only queues), a client aborts
one, or the blocks they need run short (preemption) or cross the pool-pressure limit; with
recorded admission, until the step a request is added or aborted before. Those steps are
applied in one go: each request's tokens are appended and `allocate_slots` gives it the blocks
of all of them in one call (the same blocks taken from the free queue and the same prefix-cache
entries registered, only in another order between requests). Not with a sliding window on
every layer: its decode steps free blocks as they go (each step runs on its own).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from nanokv.scheduler.scheduler import Scheduler
from nanokv.sim.policy_effects import pressure_limit
from nanokv.sim.step_clock import StepClock
from nanokv.sim.step_model import StepFeatures


def fast_forward(sched: Scheduler, clock: StepClock, tokens: dict[str, list[int]], now: float,
                 next_arrival: float, steps: int, max_steps: float = math.inf,
                 eviction_ratio: float | None = None,
                 on_step: Callable[[list, StepFeatures], None] | None = None,
                 next_abort: float = math.inf, max_abort_steps: float = math.inf,
                 arrivals_take_time: bool = False) -> tuple[int, float]:
    """Apply the decode steps that can run unchanged from simulated time `now` (the replay's
    step `steps` next), stopping before the step that starts at or after `next_arrival` or
    `next_abort`, and after at most `max_steps` (the next admission, recorded) and
    `max_abort_steps` (the next abort, recorded) steps; returns (steps applied, seconds they
    took). `on_step(decisions, features)` sees each of them (tests against the engine).
    `arrivals_take_time`: adding a request costs the turn time even when it only queues (a
    fitted server overhead), so arrivals stop the run even while max_num_seqs run."""
    bm = sched.block_manager
    bs = bm.block_size
    running = sched.running
    if not running or (sched.waiting and len(running) < sched.max_num_seqs) \
            or sched.sliding_window is not None or sched.layer_windows is not None:
        return 0, 0.0
    k = min(min(r.params.max_tokens - r.num_output_tokens - 1,
                sched.max_model_len - r.num_tokens - 1) for r in running)
    if k <= 0:
        return 0, 0.0
    spare = bm.num_free_blocks
    if eviction_ratio is not None:
        spare = min(spare, pressure_limit(bm, eviction_ratio) - bm.num_used_blocks)
    new_blocks = [0] * (k + 1)  # new_blocks[j]: blocks first needed by step j
    ctx = 0
    for r in running:
        cs = r.num_cached_slots
        ctx += cs + 1
        for j in range(len(r.block_table) * bs - cs + 1, k + 1, bs):
            new_blocks[j] += 1
    nrun = len(running)
    if nrun >= sched.max_num_seqs and not arrivals_take_time:
        next_arrival = max_steps = math.inf  # arrivals only queue: no admission is attempted
    k = int(min(k, max_steps, max_abort_steps))
    next_event = min(next_arrival, next_abort)
    elapsed, j, need = 0.0, 0, 0
    while j < k and now + elapsed < next_event:
        if need + new_blocks[j + 1] > spare:
            break
        need += new_blocks[j + 1]
        f = StepFeatures(nrun, nrun, nrun, ctx + j * nrun, 0, 0)
        elapsed += clock.step_time(f, steps + j, now + elapsed)
        j += 1
        if on_step is not None:
            on_step([(r.request_id, 1) for r in running], f)
    if j == 0:
        return 0, 0.0
    for r in running:
        t = tokens[r.request_id]
        n = r.num_tokens
        r.output_token_ids.extend(t[n:n + j])  # first: the blocks filled are hashed
        if not bm.allocate_slots(r, j):
            raise RuntimeError(f"fast-forward: {r} lacks blocks it was counted to have")
        r.num_computed_tokens += j
    return j, elapsed
