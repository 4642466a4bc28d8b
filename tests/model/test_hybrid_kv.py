"""The hybrid KV cache manager: a model whose layers mix sliding windows and full attention
(Gemma 3's five windowed layers to one full) gives its windowed layers' slices behind their
windows to its full layers' new tokens when a request runs short of blocks. Against Hugging Face
transformers' forward (prompt logits, each greedy token teacher-forced), on pools that hold the
requests only so, on each CPU attention backend and Triton's (interpreter), with preemption,
prefix hits, two tensor-parallel ranks; what keeps every block (the option, quantized caches)."""

from __future__ import annotations

import random

import pytest
from tiny_models import (build_tiny_model, check_teacher_forced, check_two_ranks, load_hf,
                         record_slicing)

from nanokv import LLM, SamplingParams

WINDOW = 24
LAYER_TYPES = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 3


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("hybrid") / "m"), "gemma3", seed=3,
                            tokenizer=False, num_hidden_layers=6, layer_types=LAYER_TYPES,
                            sliding_window=WINDOW)


@pytest.fixture
def sliced(monkeypatch):
    """The requests sliced (`BlockManager.slice_for_windows`), with their cached slots then."""
    return record_slicing(monkeypatch)


def long_prompts(seed: int, lengths, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 250) for _ in range(shared)]
    return [prefix + [rng.randrange(1, 250) for _ in range(n)] for n in lengths]


OPTIONS = dict(skip_tokenizer_init=True, block_size=16, max_num_batched_tokens=48)


@pytest.mark.parametrize("backend", ["native", "torch", "triton"])
def test_requests_a_pool_holds_only_sliced_keep_hf_outputs(gemma, sliced, backend):
    """12 blocks (192 slots) serve two requests of 290-340 tokens (22 blocks each unsliced):
    prompt logits and greedy tokens equal HF's; the full layer reads the whole context."""
    if backend == "triton":
        from triton_device import triton_ready

        if not triton_ready():
            pytest.skip("the Triton backend runs on CPU only under TRITON_INTERPRET=1")
    batch = long_prompts(2, (300, 250))
    steps = 40
    if backend == "triton":  # the interpreter runs each kernel call in Python: one request
        batch, steps = batch[:1], 20
    llm = LLM(gemma, max_model_len=512, num_kv_blocks=12, attention_backend=backend,
              **OPTIONS)
    assert llm.engine.kv_cache_plan.blocks_per_request == 11  # (32 + 5 * 6) slices / 6 layers
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True,
                            return_prompt_logits=True)
    outs = llm.generate(batch, params, use_tqdm=False)
    assert {rid for rid, _ in sliced} == {str(i) for i in range(len(batch))}
    hf = load_hf(gemma)
    for prompt, out in zip(batch, outs):
        check_teacher_forced(hf, prompt, out, atol=1e-3 if backend == "triton" else 1e-4)
    llm.engine.check_invariants()
    assert llm.engine.block_manager.num_free_blocks == 12


def test_preemption_and_prefix_hits_keep_hf_tokens(gemma, sliced):
    """Eight requests sharing a 64-token prefix over a pool that cannot hold them all, sliced
    ones among them (their shared blocks never take their tokens), preemption, then the same
    prompts again over the prefix cache; block accounting checked after every step."""
    batch = long_prompts(4, (40, 150, 90, 200, 60, 120, 180, 30), shared=64)
    llm = LLM(gemma, max_model_len=512, num_kv_blocks=40, **OPTIONS)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine = llm.engine
    for i, prompt in enumerate(batch):
        engine.add_request(prompt, params, request_id=str(i))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
    assert sliced and engine.stats().num_preemptions > 0
    hf = load_hf(gemma)
    for i, prompt in enumerate(batch):
        check_teacher_forced(hf, prompt, done[str(i)])
    hits = engine.stats().prefix_cache_hits
    again = llm.generate(batch, params, use_tqdm=False)
    assert [o.token_ids for o in again] == [done[str(i)].token_ids for i in range(len(batch))]
    assert engine.stats().prefix_cache_hits > hits
    engine.check_invariants()


def test_what_the_pool_must_hold_for_one_request(gemma, caplog):
    """A max_model_len the pool holds only sliced is accepted; unset, it is lowered to the
    longest the pool holds sliced; with disable_hybrid_kv_cache_manager every layer keeps every
    block, and the same pool refuses it."""
    with caplog.at_level("INFO", logger="nanokv"):
        llm = LLM(gemma, num_kv_blocks=12, **OPTIONS)
    # 42 blocks of slots: 42 full-layer slices + 5 windowed layers x 6 = 72 = 12 blocks x 6
    assert llm.engine.config.max_model_len == 42 * 16
    assert "hybrid KV cache manager" in caplog.text
    with pytest.raises(ValueError, match=r"cannot hold one request of max_model_len 512 \(32 "):
        LLM(gemma, max_model_len=512, num_kv_blocks=12, disable_hybrid_kv_cache_manager=True,
            **OPTIONS)
    with pytest.raises(ValueError, match="disable_hybrid_kv_cache_manager must be true or false"):
        LLM(gemma, disable_hybrid_kv_cache_manager="yes", **OPTIONS)


def test_every_block_is_kept_without_it(gemma, sliced):
    """The option, and a quantized cache (no per-layer tables), keep every layer's blocks:
    nothing is sliced, the tokens are the same."""
    batch = long_prompts(5, (200, 150))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = LLM(gemma, max_model_len=256, num_kv_blocks=40, **OPTIONS)
    want = [o.token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    for options in (dict(disable_hybrid_kv_cache_manager=True), dict(kv_cache_dtype="int8")):
        sliced.clear()
        llm = LLM(gemma, max_model_len=256, num_kv_blocks=16, **OPTIONS, **options)
        outs = llm.generate(batch, params, use_tqdm=False)
        assert not sliced
        if "kv_cache_dtype" not in options:
            assert [o.token_ids for o in outs] == want


def test_two_tensor_parallel_ranks_slice_as_one_process(gemma, sliced):
    """Two ranks (each its half of the KV heads) follow one process's schedule, sliced
    requests and preemptions included, with its tokens."""
    check_two_ranks(gemma, long_prompts(6, (10, 45, 60, 15, 50, 20, 55, 44), shared=20),
                    max_model_len=128, num_kv_blocks=8, **OPTIONS)
    assert sliced


def test_sliced_requests_make_room_for_more(gemma):
    """Six requests of 210-260 tokens over 30 blocks (14-17 each unsliced): every layer
    keeping every block runs 2 at once (and preempts); slicing running requests to admit
    waiting ones runs all 6 at once, in under half the steps, with the same tokens."""
    rng = random.Random(3)
    batch = [[rng.randrange(1, 250) for _ in range(rng.randint(150, 200))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    runs = {}
    for disable in (False, True):
        llm = LLM(gemma, max_model_len=288, num_kv_blocks=30, **{**OPTIONS,
                  "max_num_batched_tokens": 64, "disable_hybrid_kv_cache_manager": disable})
        engine = llm.engine
        for i, prompt in enumerate(batch):
            engine.add_request(prompt, params, request_id=str(i))
        peak = steps = 0
        tokens = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.token_ids
            steps += 1
            peak = max(peak, len(engine.scheduler.running))
            engine.check_invariants()
        runs[disable] = (peak, steps, tokens)
    (peak, steps, tokens), (peak_kept, steps_kept, tokens_kept) = runs[False], runs[True]
    assert (peak, peak_kept) == (6, 2) and steps < steps_kept / 2
    assert tokens == tokens_kept
