"""Draft-model speculative decoding (`speculative_config={"model": DIR, ...}`). Oracles: Hugging
Face transformers' greedy tokens of the model; the same engine without speculative_config
(seeded sampling, penalties, int8 / fp8 caches); every draft against the draft model's own
greedy continuation in transformers (so the draft model's K/V in the shared pool follows the
model's: under prefix-cache hits, chunked prefill and preemption too); the model as its own
draft model, whose every draft is accepted; the block accounting after every step."""

from __future__ import annotations

import pytest
import torch

from nanokv import LLM, SamplingParams, StructuredOutputsParams
from nanokv.spec.config import SpeculativeConfig
from policy_oracles import run_checked
from test_speculative import looping_prompts, run
from tiny_models import VOCAB, build_noisy_copy, build_tiny_model, hf_greedy, load_hf

DRAFT_NOISE = 0.005  # the noisy copy's weights: about half its drafts accepted


@pytest.fixture(scope="module")
def drafts(tiny_llama, tiny_qwen3, tmp_path_factory) -> dict[str, str]:
    """model path -> a noisy copy of it (the draft model)."""
    return {path: build_noisy_copy(path, str(tmp_path_factory.mktemp("draft")), DRAFT_NOISE)
            for path in (tiny_llama, tiny_qwen3)}


def spec(draft: str, k: int = 4) -> dict:
    return {"model": draft, "num_speculative_tokens": k}


def record_drafts(engine) -> list[tuple[str, list[int], list[int]]]:
    """(request id, its tokens, the drafts the draft model proposed) for each drafting request
    of each step."""
    records = []
    propose = engine.drafter.propose

    def recording(sched, requests):
        drafts = propose(sched, requests)
        records.extend((request_id, requests[request_id].all_token_ids, list(d))
                       for request_id, d in drafts.items())
        return drafts

    engine.drafter.propose = recording
    return records


def greedy_continuation(hf_model, tokens: list[int], k: int) -> list[int]:
    """The k tokens a model's argmax gives after `tokens`, one full forward pass each."""
    ids = torch.tensor([tokens])
    out = []
    with torch.no_grad():
        for _ in range(k):
            token = int(hf_model(ids).logits[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def assert_drafts_are_the_draft_models(records, draft_path: str) -> None:
    hf = load_hf(draft_path)
    assert records
    for _, tokens, drafted in records:
        assert drafted == greedy_continuation(hf, tokens, len(drafted))


def test_greedy_outputs_are_hf_greedy_and_drafts_the_draft_models(tiny_model, drafts):
    prompts = looping_prompts(seed=11, count=4) + [[3 + i % 50 for i in range(70)]]
    expected = [hf_greedy(load_hf(tiny_model), p, 24)[0] for p in prompts]
    llm = LLM(tiny_model, block_size=16, max_model_len=256,
              speculative_config=spec(drafts[tiny_model]))
    assert (f"speculative decoding: draft_model, up to 4 draft tokens a step from the draft "
            f"model {drafts[tiny_model]}") in llm.engine.startup_lines
    records = record_drafts(llm.engine)
    outs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    stats = llm.engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some taken, some not
    assert_drafts_are_the_draft_models(records, drafts[tiny_model])


SCENARIOS = {
    "prefix_hits": dict(block_size=16, max_model_len=256),
    "chunked_prefill": dict(block_size=16, max_model_len=256, max_num_batched_tokens=12),
    "preemption": dict(block_size=16, num_kv_blocks=12, max_model_len=128, max_num_seqs=6),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_draft_kv_follows_the_models_through_the_scheduler(tiny_llama, drafts, scenario):
    """Each draft is the draft model's greedy continuation of the request's tokens: its K/V
    of every slot is right, whichever step or request wrote it (a prefix hit's blocks, a chunk
    after a budget cut, a request recomputed after preemption)."""
    options = SCENARIOS[scenario]
    prompts = looping_prompts(seed=12)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLM(tiny_llama, **options)
    llm = LLM(tiny_llama, speculative_config=spec(drafts[tiny_llama]), **options)
    records = record_drafts(llm.engine)
    rounds = 2 if scenario == "prefix_hits" else 1
    for _ in range(rounds):
        want = run(plain, prompts, params)
        got = run(llm, prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    if scenario == "prefix_hits":
        assert llm.engine.block_manager.stats.prefix_cache_hits > 0
    if scenario == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert_drafts_are_the_draft_models(records, drafts[tiny_llama])


@pytest.mark.parametrize("kind", ["seeded", "penalties", "int8", "fp8"])
def test_outputs_are_decoding_alone(tiny_llama, drafts, kind):
    options = dict(block_size=16, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    if kind == "seeded":
        params = SamplingParams(temperature=0.6, top_k=8, seed=5, max_tokens=30,
                                ignore_eos=True)
    elif kind == "penalties":
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                repetition_penalty=1.2, frequency_penalty=0.1)
    else:
        options["kv_cache_dtype"] = kind
    prompts = looping_prompts(seed=13)
    want = run(LLM(tiny_llama, **options), prompts, params)
    llm = LLM(tiny_llama, speculative_config=spec(drafts[tiny_llama], k=3), **options)
    got = run(llm, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_the_model_as_its_own_draft_model_has_every_draft_accepted(tiny_qwen3):
    prompts = looping_prompts(seed=14, count=3)
    llm = LLM(tiny_qwen3, block_size=16, max_model_len=256, speculative_config=spec(tiny_qwen3))
    outs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    hf = load_hf(tiny_qwen3)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 20)[0] for p in prompts]
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_the_pool_holds_the_draft_models_layers(tiny_llama, tmp_path):
    draft = build_tiny_model(str(tmp_path / "d"), "llama", seed=4, tokenizer=False,
                             num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                             intermediate_size=64)
    options = dict(block_size=16, max_model_len=256, kv_cache_memory="1MiB")
    plain = LLM(tiny_llama, **options).engine
    engine = LLM(tiny_llama, speculative_config=spec(draft, k=2), **options).engine
    assert (plain.layout.num_layers, engine.layout.num_layers) == (2, 3)
    # one more layer's K/V a block (the slots' positions are counted once)
    assert engine.kv_bytes_per_block - plain.kv_bytes_per_block == 2 * 16 * 2 * 16 * 4
    assert engine.kv_cache_plan.num_blocks == 2**20 // engine.kv_bytes_per_block
    assert plain.kv_cache_plan.num_blocks == 2**20 // plain.kv_bytes_per_block


CONSTRAINED = {
    "regex": dict(structured_outputs=StructuredOutputsParams(regex=r"(ab|cd|ef|[0-9])+")),
    "json": dict(structured_outputs=StructuredOutputsParams(
        json={"type": "array", "items": {"type": "integer"}}, disable_any_whitespace=True)),
    "grammar": dict(structured_outputs=StructuredOutputsParams(
        grammar='root ::= ("ab" | "ba" | "is ")+')),
    # per prompt, from its unconstrained greedy output (so that they bite): a bad word of its
    # 4th-5th tokens' text; a stop token it gives 3rd, banned until 9 outputs
    "bad_words": lambda free: dict(bad_words=[free.text[len(free.text) // 3:][:3]]),
    "min_tokens": lambda free: dict(min_tokens=9, stop_token_ids=[free.token_ids[2]]),
}


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "seeded"])
def test_constrained_requests_draft_and_decode_as_alone(tiny_llama, temperature):
    """Structured outputs, bad words and min_tokens with a draft model's drafts: each row
    constrained as if the drafts before it were outputs (the drafts cut before the first the
    grammar refuses: `Scheduler.fill_drafts`), so the outputs are decoding alone's. The model
    is its own draft model and each draft is its greedy token under the row's constraints
    (`Scheduler.draft_constraints`), so greedy, every draft is accepted; seeded, some are."""
    options = dict(block_size=16, max_model_len=256)
    plain = LLM(tiny_llama, **options)
    llm = LLM(tiny_llama, speculative_config=spec(tiny_llama), **options)
    records = record_drafts(llm.engine)
    prompts = ["The grass is", "def add(a, b):", "import os\n", "The sky is blue. The sky is"]
    stats = llm.engine.scheduler.spec_stats
    free = [o.outputs[0] for o in plain.generate(prompts, SamplingParams(
        temperature=temperature, seed=3, max_tokens=24, ignore_eos=True), use_tqdm=False)]
    for name, constraint in CONSTRAINED.items():
        params = [SamplingParams(temperature=temperature, seed=3, max_tokens=24,
                                 **(constraint(f) if callable(constraint) else constraint))
                  for f in free]
        want = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
        if callable(constraint):  # it bites: the output is not the free one
            assert [o.token_ids for o in want] != [f.token_ids for f in free], name
        before, records[:] = stats.copy(), []
        got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert [o.token_ids for o in got] == [o.token_ids for o in want], name
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want], name
        step = stats.since(before)
        assert records and step.num_draft_tokens > 0, name
        if temperature == 0:
            assert step.num_accepted_tokens == step.num_draft_tokens, name
        llm.engine.check_invariants()
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert stats.num_accepted_tokens > 0


def test_what_a_draft_model_does_not_serve_is_refused(tiny_llama, drafts, tmp_path):
    draft = drafts[tiny_llama]
    kv_heads = build_tiny_model(str(tmp_path / "kv"), "llama", tokenizer=False,
                                num_key_value_heads=4)
    vocab = build_tiny_model(str(tmp_path / "vocab"), "llama", tokenizer=False,
                             vocab_size=VOCAB + 16)
    short = build_tiny_model(str(tmp_path / "short"), "llama", tokenizer=False,
                             max_position_embeddings=128)
    cases = [
        (dict(kv_cache_dtype="kvquant"), spec(draft), "kv_cache_dtype one of"),
        (dict(kv_cache_dtype="kivi"), spec(draft), "kv_cache_dtype one of"),
        (dict(kv_policy="streaming", kv_budget=64), spec(draft), "KV policy"),
        (dict(tensor_parallel_size=2), spec(draft), "tensor_parallel_size 1 only"),
        ({}, spec(kv_heads), "4 KV heads of 16 channels, the model 2 of 16"),
        ({}, spec(vocab), f"vocabulary of {VOCAB + 16} tokens, the model {VOCAB}"),
        ({}, spec(short), "covers 128 positions"),
        ({}, spec(str(tmp_path / "missing")), "is not a directory"),
        ({}, {"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
        ({}, {**spec(draft), "prompt_lookup_max": 3}, "apply to method \"ngram\" only"),
        ({}, {**spec(draft), "draft_tensor_parallel_size": 2}, "must be 1"),
        ({}, {**spec(draft), "method": "ngram"}, "apply to method \"draft_model\" only"),
        ({}, {**spec(draft), "method": "eagle"}, "method must be one of"),
    ]
    for options, config, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            LLM(tiny_llama, block_size=16, max_model_len=256, speculative_config=config,
                **options)


def test_the_method_follows_the_model_key():
    given = SpeculativeConfig.from_dict({"model": "/some/dir", "num_speculative_tokens": 3})
    assert (given.method, given.model, given.num_speculative_tokens) == ("draft_model",
                                                                          "/some/dir", 3)
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 3}).method == "ngram"


class SlotLedger:
    """The engine step in which the model and the draft model last wrote each pool slot
    (block id, offset), from the steps' own slot mappings: brute-force bookkeeping of which
    K/V each model holds."""

    def __init__(self, engine) -> None:
        self.engine, self.step = engine, 0
        self.target: dict[tuple[int, int], int] = {}
        self.draft: dict[tuple[int, int], int] = {}
        execute, forward = engine.runner.execute, engine.drafter._forward

        def executing(sched):
            self._record(self.target, sched.scheduled)
            return execute(sched)

        def drafting(scheduled, rows):
            self._record(self.draft, scheduled)
            return forward(scheduled, rows)

        engine.runner.execute, engine.drafter._forward = executing, drafting

    def _record(self, ledger: dict, scheduled) -> None:
        bs = self.engine.block_manager.block_size
        for s in scheduled:
            for slot in range(s.start_slot, s.start_slot + s.num_tokens):
                ledger[(s.block_table[slot // bs], slot % bs)] = self.step

    def check_cached(self, block_ids) -> None:
        """Every slot of those of the blocks registered for prefix hits holds the draft
        model's K/V of the token the model's K/V there is of (written in the same step or
        after it)."""
        bm = self.engine.block_manager
        for block_id in block_ids:
            if bm.blocks[block_id].block_hash is None:
                continue
            for offset in range(bm.block_size):
                key = (block_id, offset)
                assert self.draft.get(key, -1) >= self.target.get(key, -1), key

    def end_step(self) -> None:
        """After a step: `check_cached` of every block."""
        self.check_cached(range(self.engine.block_manager.num_blocks))
        self.step += 1


def test_no_block_is_shared_before_the_draft_model_wrote_it(tiny_llama, monkeypatch):
    """The one slot the draft model writes a step late (a request's last draft, when all were
    accepted: the model as its own draft model accepts every one) is never in a prefix-cache
    block without the draft model's K/V, also when the priority policy preempts a request it
    had scheduled (and allocated, registering that block) earlier in the same step."""
    import nanokv.scheduler.scheduler as scheduler_module

    lagging = []  # preemptions of a request whose lagging slot's block was registered
    preempt = scheduler_module.Scheduler._preempt
    ledger = None

    def preempting(self, request):
        end, bs, table = request.draft_kv_end, self.block_manager.block_size, \
            list(request.block_table)
        if end is not None and end < request.num_computed_tokens \
                and self.block_manager.blocks[table[end // bs]].block_hash is not None:
            lagging.append(request.request_id)
        preempt(self, request)
        ledger.check_cached(table)  # what it leaves in the prefix cache

    monkeypatch.setattr(scheduler_module.Scheduler, "_preempt", preempting)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for low in range(12, 28):  # the low-priority request's prompt length moves its block ends
        llm = LLM(tiny_llama, block_size=16, num_kv_blocks=9, max_model_len=128,
                  scheduling_policy="priority", speculative_config=spec(tiny_llama, k=3))
        engine = llm.engine
        ledger = SlotLedger(engine)  # read by preempting too
        engine.add_request([5 + i % 40 for i in range(low)], params, priority=5)
        for step in range(24):
            if step in (3, 5, 7):  # urgent requests that take the pool from it
                engine.add_request([90 + (i * step) % 50 for i in range(40)], params,
                                   priority=0)
            engine.step()
            engine.check_invariants()
            ledger.end_step()
        run_checked(engine)
    assert lagging  # the case happened
