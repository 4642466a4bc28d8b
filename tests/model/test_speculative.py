"""Speculative decoding (n-gram drafts): the outputs are the ones decoding alone gives. Oracles:
Hugging Face transformers' greedy tokens, and the same engine without speculative_config
(greedy and seeded sampling token for token, penalties, logprobs, stop strings, min_tokens,
max_tokens, max_model_len, under prefix hits, chunked prefill, preemption, and the int8 / fp8
caches); every run asserts that drafts were accepted (else it would test nothing), and the
block accounting after every step."""

from __future__ import annotations

import random

import pytest

from nanokv import LLM, SamplingParams
from policy_oracles import run_checked
from tiny_models import VOCAB, hf_greedy, load_hf

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}


def looping_prompts(seed: int = 0, count: int = 6) -> list[list[int]]:
    """Prompts of a short random segment repeated: n-grams to draft from."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        segment = [rng.randrange(2, VOCAB - 10) for _ in range(rng.randint(3, 9))]
        prompts.append(segment * rng.randint(2, 4) + segment[:rng.randint(0, 2)])
    return prompts


def run(llm: LLM, prompts, params) -> list:
    """Every prompt through the engine step by step, the block accounting checked after each
    step; the outputs in prompt order."""
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    done = run_checked(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [done[i].outputs[0] for i in ids]


def accepted(llm: LLM) -> int:
    return llm.engine.scheduler.spec_stats.num_accepted_tokens


def test_greedy_drafts_give_hf_greedy_tokens(tiny_model):
    prompts = looping_prompts()
    hf = load_hf(tiny_model)
    expected = [hf_greedy(hf, p, 24)[0] for p in prompts]
    llm = LLM(tiny_model, block_size=16, max_model_len=256, speculative_config=SPEC)
    assert "speculative decoding: ngram, up to 4 draft tokens a step from n-grams of 1-3 " \
           "tokens" in llm.engine.startup_lines
    outs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    stats = llm.engine.scheduler.spec_stats
    assert accepted(llm) > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens


SCENARIOS = {
    "plain": dict(block_size=16, max_model_len=256),
    "prefix_hits": dict(block_size=16, max_model_len=256),
    "chunked_prefill": dict(block_size=16, max_model_len=256, max_num_batched_tokens=12),
    "preemption": dict(block_size=16, num_kv_blocks=12, max_model_len=128, max_num_seqs=6),
    "int8": dict(block_size=16, max_model_len=256, kv_cache_dtype="int8"),
    "fp8_preemption": dict(block_size=16, num_kv_blocks=12, max_model_len=128,
                           kv_cache_dtype="fp8"),
    # stores that quantize a block when it fills: drafts stop before a block's last slot
    "kvquant": dict(block_size=16, max_model_len=256, kv_cache_dtype="kvquant",
                    kv_quant_bits=2),
    "kvquant_preemption": dict(block_size=16, num_kv_blocks=12, max_model_len=128,
                               kv_cache_dtype="kvquant", kv_quant_bits=4),
    "kivi": dict(block_size=16, max_model_len=256, kv_cache_dtype="kivi", kv_quant_bits=2),
}
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.6, top_k=8, top_p=0.9, seed=5, max_tokens=30,
                             ignore_eos=True),
    "penalties": SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                repetition_penalty=1.2, frequency_penalty=0.1),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("kind", list(PARAMS))
def test_outputs_are_decoding_alone(tiny_llama, scenario, kind):
    options = SCENARIOS[scenario]
    prompts = looping_prompts(seed=1)
    params = PARAMS[kind]
    plain = LLM(tiny_llama, **options)
    spec = LLM(tiny_llama, speculative_config=SPEC, **options)
    engine, bs = spec.engine, options["block_size"]
    execute = engine.runner.execute
    last_slot_drafts = []

    def checking(sched):  # drafts on a block's last slot (none where the cache fills blocks)
        last_slot_drafts.extend(s.start_slot + 1 + j for s in sched.scheduled
                                for j in range(len(s.draft_token_ids))
                                if (s.start_slot + 1 + j) % bs == bs - 1)
        return execute(sched)

    engine.runner.execute = checking
    rounds = 2 if scenario == "prefix_hits" else 1
    for _ in range(rounds):
        want = run(plain, prompts, params)
        got = run(spec, prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.text for o in got] == [o.text for o in want]
    if kind != "penalties":  # a penalty can break every loop the drafts would follow
        assert accepted(spec) > 0
    if "preemption" in scenario:
        assert spec.engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.quantizes_full_blocks == (scenario.split("_")[0] in ("kvquant",
                                                                                "kivi"))
    if engine.kv_cache.quantizes_full_blocks:
        assert not last_slot_drafts
    elif kind == "greedy":  # elsewhere drafts take any slot
        assert last_slot_drafts


def test_logprobs_of_accepted_drafts_are_their_rows(tiny_llama):
    prompts = looping_prompts(seed=2)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    want = run(LLM(tiny_llama, block_size=16, max_model_len=256), prompts, params)
    spec = LLM(tiny_llama, block_size=16, max_model_len=256, speculative_config=SPEC)
    got = run(spec, prompts, params)
    assert accepted(spec) > 0
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(w.logprobs) == 20
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.token_id == b.token_id and a.rank == b.rank
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


@pytest.mark.parametrize("case", ["stop_string", "stop_token", "min_tokens", "max_tokens",
                                  "max_model_len"])
def test_stops_and_limits_end_where_decoding_alone_does(tiny_llama, case):
    prompts = looping_prompts(seed=3)
    options = dict(block_size=16, max_model_len=256)
    plain = LLM(tiny_llama, **options)
    text = run(plain, prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    if case == "stop_string":  # a stop that ends a few tokens in, for each prompt
        params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                 stop=[t.text[len(t.text) // 2:len(t.text) // 2 + 2]])
                  for t in text]
    elif case == "stop_token":
        params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                 stop_token_ids=[t.token_ids[7]]) for t in text]
    elif case == "min_tokens":  # the stop token banned (no drafts) until 9 outputs
        params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, min_tokens=9,
                                 stop_token_ids=[t.token_ids[2]]) for t in text]
    elif case == "max_tokens":
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                  for n in (1, 2, 3, 5, 8, 13)]
    else:
        options["max_model_len"] = max(len(p) for p in prompts) + 6
        params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * len(prompts)
        plain = LLM(tiny_llama, **options)
    spec = LLM(tiny_llama, speculative_config=SPEC, **options)
    for p, param in zip(prompts, params):
        want, = run(plain, [p], param)
        got, = run(spec, [p], param)
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason)
    assert accepted(spec) > 0


def test_a_stop_string_completed_inside_accepted_drafts_ends_the_output_there(tiny_llama):
    """The stop string is the text of an output's first a + 1 tokens, where token a is the first
    of several one step gave: decoding alone stops at token a, so must the speculative run (the
    accepted tokens after it are no outputs)."""
    options = dict(block_size=16, max_model_len=256)
    plain = LLM(tiny_llama, **options)
    spec = LLM(tiny_llama, speculative_config=SPEC, **options)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    checked = 0
    for prompt in looping_prompts(seed=5, count=10):
        request_id = spec.engine.add_request(prompt, params)
        groups, count = [], 0
        while spec.engine.has_unfinished_requests():
            for out in spec.engine.step():
                if out.request_id == request_id and out.new_token_ids:
                    groups.append((count, len(out.new_token_ids)))
                    count += len(out.new_token_ids)
        starts = [a for a, n in groups if n > 1 and a > 0]
        if not starts:
            continue
        head, = run(plain, [prompt], SamplingParams(temperature=0, max_tokens=starts[0] + 1,
                                                    ignore_eos=True))
        if not head.text or "\ufffd" in head.text:
            continue
        stop = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[head.text])
        want, = run(plain, [prompt], stop)
        if len(want.token_ids) != starts[0] + 1:  # token a added no text: it stopped before
            continue
        got, = run(spec, [prompt], stop)
        assert want.finish_reason == "stop"
        assert (got.token_ids, got.text, got.stop_reason) == (want.token_ids, want.text,
                                                              want.stop_reason)
        checked += 1
    assert checked >= 3


def test_drafts_never_cross_the_step_budget_or_preempt(tiny_llama):
    """Each step's batch stays within max_num_batched_tokens; drafts that find no free block
    are dropped rather than preempting (preemptions as without drafts or fewer)."""
    options = dict(block_size=16, num_kv_blocks=10, max_model_len=128, max_num_seqs=6,
                   max_num_batched_tokens=8)
    prompts = looping_prompts(seed=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    spec = LLM(tiny_llama, speculative_config=SPEC, **options)
    engine = spec.engine
    execute = engine.runner.execute
    sizes = []

    def counting(sched):
        sizes.append(sched.num_batched_tokens)
        return execute(sched)

    engine.runner.execute = counting
    got = run(spec, prompts, params)
    plain = LLM(tiny_llama, **options)
    assert [o.token_ids for o in got] == [o.token_ids for o in run(plain, prompts, params)]
    assert max(sizes) <= 8 and accepted(spec) > 0


def test_what_speculation_does_not_serve_is_refused(tiny_llama):
    from nanokv.cache.kv_cache import KVCache
    from nanokv.config import EngineConfig
    from nanokv.engine.assembly import check_speculation

    class Unwritable(KVCache):  # a kind that does not declare supports_speculation
        pass

    config = EngineConfig.from_kwargs(tiny_llama, speculative_config=SPEC)
    with pytest.raises(ValueError, match="kv_cache_dtype one of"):
        check_speculation(config, config.speculative, Unwritable, None)
    with pytest.raises(ValueError, match="does not go with a KV policy"):
        LLM(tiny_llama, kv_policy="h2o", kv_budget=64, speculative_config=SPEC)


def test_drafts_by_batch_size_keep_the_outputs(tiny_llama):
    """vLLM's num_speculative_tokens_per_batch_size: no drafts while 3 or more run, 4 a step
    alone; the outputs are decoding alone's, and drafts came only once few requests ran."""
    schedule = {**SPEC, "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 64, 0]]}
    options = dict(block_size=16, max_model_len=256)
    prompts = looping_prompts(seed=6)
    params = [SamplingParams(temperature=0, max_tokens=6 + 6 * i, ignore_eos=True)
              for i in range(len(prompts))]
    spec = LLM(tiny_llama, speculative_config=schedule, **options)
    assert ("up to 4 draft tokens a step (by batch size: 1-2: 4, 3-64: 0)"
            in "\n".join(spec.engine.startup_lines))
    engine = spec.engine
    execute = engine.runner.execute
    drafted_at = []

    def recording(sched):
        if any(s.draft_token_ids for s in sched.scheduled):
            drafted_at.append(len(sched.scheduled))
        return execute(sched)

    engine.runner.execute = recording
    want = LLM(tiny_llama, **options).generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert drafted_at and max(drafted_at) <= 2 and accepted(spec) > 0
