"""The priority scheduling policy on a real model: admission follows (priority, arrival), the
victims of preemption are the largest (priority, arrival) running, and no order changes a token:
every output equals Hugging Face greedy; the block accounting holds."""

import pytest

from nanokv import LLM, SamplingParams
from tiny_models import hf_greedy, load_hf

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[3 + (7 * i + j) % 90 for j in range(10 + 9 * i)] for i in range(6)]
PRIORITIES = [3, 0, 2, -1, 0, 1]


@pytest.fixture(scope="module")
def hf_tokens(tiny_llama):
    hf = load_hf(tiny_llama)
    return [hf_greedy(hf, p, MAX_TOKENS)[0] for p in PROMPTS]


def record_steps(llm):
    """Wrap the scheduler's step: (scheduled ids, preempted ids, priority of each running
    request before the step) per step."""
    sched, steps = llm.engine.scheduler, []
    schedule = sched.schedule

    def recording():
        running = {r.request_id: r.priority for r in sched.running}
        out = schedule()
        steps.append(([s.request_id for s in out.scheduled], out.preempted_request_ids, running))
        return out

    sched.schedule = recording
    return steps


def test_admission_order_follows_priority(tiny_llama, hf_tokens):
    llm = LLM(tiny_llama, block_size=16, max_model_len=128, max_num_seqs=1,
              scheduling_policy="priority")
    steps = record_steps(llm)
    outs = llm.generate(PROMPTS, GREEDY, priority=PRIORITIES, use_tqdm=False)
    order = []
    for scheduled, _, _ in steps:
        order += [rid for rid in scheduled if rid not in order]
    ids = [o.request_id for o in outs]
    expected = sorted(range(len(PROMPTS)), key=lambda i: (PRIORITIES[i], i))
    assert order == [ids[i] for i in expected]
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens


def test_preemption_victims_and_tokens(tiny_llama, hf_tokens):
    """A pool too small for all: requests are preempted, always one of the largest priority
    value among those running, and every output still equals HF greedy."""
    llm = LLM(tiny_llama, block_size=16, max_model_len=96, max_num_seqs=4, num_kv_blocks=7,
              scheduling_policy="priority")
    steps = record_steps(llm)
    outs = llm.generate(PROMPTS, GREEDY, priority=PRIORITIES, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    victims = [(p, running) for _, preempted, running in steps for p in preempted]
    assert victims, "the pool was meant to force preemption"
    for victim, running in victims:  # victims of one step leave it one after the other
        assert running[victim] == max(running.values())
        running.pop(victim)
    engine = llm.engine
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_priority_arguments(tiny_llama):
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of \['fcfs', "
                                         r"'priority'\], got 'lifo'"):
        LLM(tiny_llama, block_size=16, max_model_len=128, scheduling_policy="lifo")
    llm = LLM(tiny_llama, block_size=16, max_model_len=128, scheduling_policy="priority")
    with pytest.raises(ValueError, match="got 2 priorities for 3 prompts"):
        llm.generate(PROMPTS[:3], GREEDY, priority=[0, 1], use_tqdm=False)
    for bad in ("high", 1.5, True):
        with pytest.raises(ValueError, match="priority must be an integer"):
            llm.generate(PROMPTS[:2], GREEDY, priority=bad, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    rid = llm.engine.add_request(PROMPTS[0], GREEDY, priority=-3)
    assert llm.engine.scheduler.requests[rid].priority == -3
    llm.engine.abort(rid)


def test_fcfs_ignores_priority(tiny_llama):
    """As vLLM 0.32's engine: under fcfs a priority is accepted and changes nothing."""
    llm = LLM(tiny_llama, block_size=16, max_model_len=128, max_num_seqs=1)
    steps = record_steps(llm)
    outs = llm.generate(PROMPTS[:4], GREEDY, priority=PRIORITIES[:4], use_tqdm=False)
    order = []
    for scheduled, _, _ in steps:
        order += [rid for rid in scheduled if rid not in order]
    assert order == [o.request_id for o in outs]
