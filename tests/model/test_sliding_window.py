"""Sliding-window attention (Mistral's `sliding_window` on every layer; Qwen2 / Qwen3's
`use_sliding_window` layers from max_window_layers on): nanokv's prompt logits and greedy tokens
against Hugging Face's forward over the whole sequence (its sliding-window mask, teacher-forced:
HF's own generate can disagree with its forward on these windows), through chunked prefill, both
CPU attention paths, prefix hits, preemption, n-gram speculation, beam search and two
tensor-parallel ranks; the blocks behind every layer's window freed after each step (brute force
over each step's tables), not counted as evictions, so a pool smaller than one max_model_len
request serves it; what nanokv does not run with a window refused before loading."""

import random

import pytest
import torch
from beam_reference import reference_beam_search
from tiny_models import build_tiny_model, check_teacher_forced, load_hf

from nanokv import LLM, BeamSearchParams, SamplingParams
from nanokv.utils import cdiv

MAX_NEW = 24
MODELS = {  # name: (architecture, config flags, the window)
    "mistral": ("mistral", dict(sliding_window=12), 12),
    "qwen2_hybrid": ("qwen2", dict(use_sliding_window=True, sliding_window=10,
                                   max_window_layers=1), 10),  # layer 0 full, layer 1 windowed
    "qwen3": ("qwen3", dict(use_sliding_window=True, sliding_window=20, max_window_layers=0), 20),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sliding")
    return {name: build_tiny_model(str(root / name), arch, seed=i, tokenizer=False,
                                   max_position_embeddings=256, **flags)
            for i, (name, (arch, flags, _)) in enumerate(MODELS.items())}


def prompts(seed: int, lengths=(7, 40, 90)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 200) for _ in range(n)] for n in lengths]


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """Hugging Face's forward over the whole sequence: [len, vocab]."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def run_by_steps(engine, batch, params, after_step) -> dict:
    """Run the prompts through the engine step by step, `after_step(engine)` after each step;
    the finished outputs by request id (the prompt's index)."""
    for i, prompt in enumerate(batch):
        engine.add_request(prompt, params, request_id=str(i))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        after_step(engine)
        engine.check_invariants()
    return outputs


def check_window_tables(engine, window: int, bs: int) -> int:
    """Brute force over the running requests: each table starts at the block holding its next
    token's first visible slot (the next token, position p, sees [p + 1 - W, p]: the blocks of
    positions wholly before them gone) and holds its slots, slot by slot. Returns the longest
    table."""
    longest = 0
    for request in engine.scheduler.running:
        p = request.num_computed_tokens
        assert request.num_evicted_tokens == max(0, p + 1 - window) // bs * bs
        assert len(request.block_table) == cdiv(request.num_cached_slots, bs)
        longest = max(longest, len(request.block_table))
    return longest


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                        return_prompt_logits=True)


@pytest.mark.parametrize("chunk", [512, 16])
@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("name", list(MODELS))
def test_sliding_window_matches_hf(models, name, backend, chunk):
    llm = LLM(models[name], skip_tokenizer_init=True, max_model_len=256, block_size=16,
              attention_backend=backend, max_num_batched_tokens=chunk)
    batch = prompts(len(name))
    hf = load_hf(models[name])
    for prompt, out in zip(batch, llm.generate(batch, GREEDY, use_tqdm=False)):
        check_teacher_forced(hf, prompt, out)
    # the window matters here: the same weights with a window past the prompt differ
    hf.config.sliding_window = 10**6
    for layer in hf.model.layers:
        if getattr(layer.self_attn, "sliding_window", None) is not None:
            layer.self_attn.sliding_window = 10**6
    long = batch[-1]
    assert not torch.allclose(hf_logits(hf, long), llm.generate(
        [long], GREEDY, use_tqdm=False)[0].prompt_logits, atol=1e-3)
    # the blocks the window left were freed, not evicted
    assert not any(llm.engine.stats().evicted_blocks.values())


def test_blocks_behind_the_window_are_freed_after_every_step(models):
    """Brute force, after every step: each running request's table starts at the block holding
    its next token's first visible slot (nothing freeable kept, nothing needed freed) and covers
    its slots; the freed ones are counted in num_evicted_tokens; the accounting holds."""
    window, bs = MODELS["mistral"][2], 16
    llm = LLM(models["mistral"], skip_tokenizer_init=True, max_model_len=256, block_size=bs,
              max_num_batched_tokens=24, enable_prefix_caching=False)
    engine = llm.engine
    batch = prompts(5, (3, 30, 61, 100))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                            return_prompt_logits=True)
    peak = 0

    def check_tables(engine) -> None:
        nonlocal peak
        peak = max(peak, check_window_tables(engine, window, bs))

    outputs = run_by_steps(engine, batch, params, check_tables)
    # at most the window's slots before the next token, from a block start
    assert peak <= cdiv(window - 1 + bs - 1, bs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    hf = load_hf(models["mistral"])
    for i, prompt in enumerate(batch):
        check_teacher_forced(hf, prompt, outputs[str(i)])


def test_prefix_hits_after_the_window_freed_blocks(models):
    """A prompt computed in chunks whose window freed its first blocks while it was being
    prefilled: its full blocks were all registered (those registered after the first freeing
    by their token block, not their table index), so the same prompt again hits all of them
    and gives the same tokens."""
    llm = LLM(models["mistral"], skip_tokenizer_init=True, max_model_len=256, block_size=16,
              max_num_batched_tokens=16)
    prompt = prompts(9, (90,))[0]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert again.token_ids == first.token_ids
    check_teacher_forced(load_hf(models["mistral"]), prompt, again)


def test_ngram_speculation_with_a_window(models):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}
    options = dict(skip_tokenizer_init=True, max_model_len=256, block_size=16)
    rng = random.Random(4)
    motif = [rng.randrange(1, 200) for _ in range(6)]
    batch = [motif * 8, prompts(4, (50,))[0]]  # repetitive: drafts accepted
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    plain = LLM(models["qwen3"], **options).generate(batch, params, use_tqdm=False)
    llm = LLM(models["qwen3"], speculative_config=spec, **options)
    assert [o.token_ids for o in llm.generate(batch, params, use_tqdm=False)] == \
        [o.token_ids for o in plain]
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    llm.engine.check_invariants()


def test_beam_search_with_a_window(models):
    """Beam search's steps take their earlier blocks from the prefix cache, the hits behind the
    window left out: the beams are those of vLLM's rules over HF's full forward passes."""
    llm = LLM(models["mistral"], skip_tokenizer_init=True, max_model_len=256, block_size=16)
    hf = load_hf(models["mistral"])
    width, steps = 3, 10
    batch = prompts(13, (40, 21))
    outs = llm.beam_search(batch, BeamSearchParams(beam_width=width, max_tokens=steps,
                                                   ignore_eos=True))
    for prompt, out in zip(batch, outs):
        want = reference_beam_search(hf, prompt, width, steps, set(), True, 1.0)
        assert [s.tokens for s in out.sequences] == [w[0] for w in want]
    assert llm.engine.stats().prefix_cache_hits > 0
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("options,match", [
    (dict(kv_policy="paged_eviction", kv_budget=64), r"sliding window \(12 tokens\).*without a KV "
                                                     r"policy"),
    (dict(kv_cache_dtype="int8", kv_policy="snapkv", kv_budget=64), r"without a KV policy"),
])
def test_what_a_window_does_not_run_with_is_refused(models, options, match):
    with pytest.raises(ValueError, match=match):
        LLM(models["mistral"], skip_tokenizer_init=True, max_model_len=256, **options)


def test_a_draft_model_is_refused_with_a_window(models, tmp_path):
    draft = build_tiny_model(str(tmp_path / "draft"), "mistral", tokenizer=False,
                             max_position_embeddings=256, num_hidden_layers=1)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"draft model is not supported"):
        LLM(models["mistral"], skip_tokenizer_init=True, max_model_len=256,
            speculative_config=spec)
    # a draft model with a window of its own, for a model without one
    windowed = build_tiny_model(str(tmp_path / "windowed"), "mistral", tokenizer=False,
                                max_position_embeddings=256, sliding_window=8)
    target = build_tiny_model(str(tmp_path / "target"), "mistral", tokenizer=False,
                              max_position_embeddings=256)
    with pytest.raises(ValueError, match=r"attends over a sliding window"):
        LLM(target, skip_tokenizer_init=True, max_model_len=256,
            speculative_config={**spec, "model": windowed})


def test_tensor_parallel_ranks_apply_the_window(models):
    """Two ranks (gloo), each holding one of the two KV heads: every rank's cache takes rank 0's
    windows; the greedy tokens are HF's."""
    llm = LLM(models["qwen3"], skip_tokenizer_init=True, max_model_len=256, block_size=16,
              max_num_batched_tokens=32, tensor_parallel_size=2)
    try:
        batch = prompts(6)
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        hf = load_hf(models["qwen3"])
        for prompt, out in zip(batch, llm.generate(batch, params, use_tqdm=False)):
            check_teacher_forced(hf, prompt, out)
        llm.engine.check_invariants()
    finally:
        llm.engine.close()


def test_a_pool_smaller_than_one_request_runs_with_a_window(models):
    """Every layer windowed: a request holds at most cdiv(W - 1 + T, B) + 1 blocks (T the step's
    token budget), so a pool of 6 blocks (96 tokens) serves max_model_len 256 and prompts of
    100-150 tokens, several at once (and preempted, recomputed), with HF's tokens. The same pool
    without a window on every layer is refused."""
    window, bs, budget = MODELS["mistral"][2], 16, 16
    cap = cdiv(window - 1 + budget, bs) + 1
    options = dict(skip_tokenizer_init=True, max_model_len=256, block_size=bs,
                   max_num_batched_tokens=budget, num_kv_blocks=6)
    llm = LLM(models["mistral"], **options)
    assert llm.engine.kv_cache_plan.blocks_per_request == cap
    engine = llm.engine
    batch = prompts(11, (100, 150, 120))
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    most_running = 0

    def check_cap(engine) -> None:
        nonlocal most_running
        assert all(len(r.block_table) <= cap for r in engine.scheduler.running)
        most_running = max(most_running, len(engine.scheduler.running))

    outputs = run_by_steps(engine, batch, params, check_cap)
    assert most_running >= 2
    assert engine.stats().num_preemptions > 0  # recomputed requests start their window anew
    hf = load_hf(models["mistral"])
    for i, prompt in enumerate(batch):
        check_teacher_forced(hf, prompt, outputs[str(i)])
    # the other models keep every block: the pool must hold a whole request
    with pytest.raises(ValueError, match=r"cannot hold one request of max_model_len 256"):
        LLM(models["qwen2_hybrid"], **options)


def test_a_prefix_hit_takes_only_the_blocks_in_its_window(models):
    """A prompt of 100 tokens cached whole (7 blocks, 6 full): the same prompt again counts
    all 96 full-block tokens as computed but holds only the hits inside its first new token's
    window (token 96 sees 85..96: hit block 5 and the new block 6), and gives the same
    tokens."""
    window, bs = MODELS["mistral"][2], 16
    llm = LLM(models["mistral"], skip_tokenizer_init=True, max_model_len=256, block_size=bs,
              max_num_batched_tokens=16)
    engine = llm.engine
    prompt = prompts(12, (100,))[0]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    engine.add_request(prompt, params, request_id="again")
    engine.step()
    request = engine.scheduler.requests["again"]
    assert request.num_cached_tokens == 96
    assert request.num_evicted_tokens == (96 + 1 - window) // bs * bs == 80
    # of the 6 hits only block 5 (tokens 80..95) taken, and block 6 for the chunk's 96..99:
    # never more at once
    assert len(request.block_table) == request.peak_blocks == 2
    engine.check_invariants()
    while engine.has_unfinished_requests():
        for out in engine.step():
            again = out
    assert again.token_ids == first.token_ids
    check_teacher_forced(load_hf(models["mistral"]), prompt, again)


def test_auto_block_size_follows_a_window_on_every_layer(tmp_path):
    """block_size "auto" by the context a request holds: max_model_len, or with a window on
    every layer the window's length (a 512-token window: 128-token blocks where 4k of context
    takes 256); a hybrid model keeps every block (max_model_len decides)."""
    from nanokv.config import auto_block_size

    assert (auto_block_size(4096), auto_block_size(4096, 512)) == (256, 128)
    assert (auto_block_size(200_000), auto_block_size(200_000, 4096)) == (1024, 256)
    assert auto_block_size(1000, 4096) == 128  # the window covers max_model_len
    options = dict(skip_tokenizer_init=True, max_model_len=4096, num_kv_blocks=64)
    for name, arch, flags, want in (
            ("mistral", "mistral", dict(sliding_window=512), 128),
            ("hybrid", "qwen2", dict(use_sliding_window=True, sliding_window=512,
                                     max_window_layers=1), 256),
            ("full", "mistral", dict(sliding_window=None), 256)):
        model = build_tiny_model(str(tmp_path / name), arch, tokenizer=False,
                                 max_position_embeddings=4096, **flags)
        assert LLM(model, **options).engine.config.block_size == want, name
        assert LLM(model, block_size=64, **options).engine.config.block_size == 64
