"""KV policies over a quantized KV cache: the kept tokens, re-written through the store, read
back as the float cache's kept tokens (within the store's rounding), with keys at their true
positions; block-wise eviction and pool accounting unchanged."""

import pytest
import torch

from nanokv import LLM, SamplingParams
from nanokv.quant.attention import rope_from_rotary
from policy_oracles import prompt_of as tokens
from policy_oracles import run_checked, spy_plans

BS = 16


def run_prompt(llm, prompt) -> object:
    """Add one request with 2 outputs and step until its prompt is computed and compressed."""
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2,
                                                    ignore_eos=True))
    request = engine.scheduler.requests[rid]
    while request.num_computed_tokens < len(prompt):
        engine.step()
    return request


def float_prompt_kv(model, prompt) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's K/V of the prompt from a full float cache: each [n, Hkv, D], keys after
    RoPE."""
    llm = LLM(model, skip_tokenizer_init=True, block_size=BS, max_model_len=256)
    request = run_prompt(llm, prompt)
    table = request.block_table
    out = []
    for layer in range(llm.engine.layout.num_layers):
        k, v = llm.engine.kv_cache.layer(layer)
        h, d = k.shape[2], k.shape[3]
        out.append((k[table].reshape(-1, h, d)[:len(prompt)].clone(),
                    v[table].reshape(-1, h, d)[:len(prompt)].clone()))
    return out


def take(x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """x [n, Hkv, D] at kept [C] or per head [Hkv, C] -> [C, Hkv, D]."""
    if kept.dim() == 1:
        return x[kept]
    heads = torch.arange(kept.shape[0], device=kept.device)[:, None]
    return x[kept, heads].transpose(0, 1)


# (kv_cache_dtype, options, relative error bound of one rounding, twice)
STORES = [
    ("int8", {}, 0.03),
    ("fp8", {}, 0.15),
    ("kvquant", {"kv_quant_bits": 4}, 0.6),
]


@pytest.mark.parametrize("dtype,store_options,bound", STORES)
@pytest.mark.parametrize("policy,options", [
    ("knorm", {}), ("snapkv", {"window": 8, "per_head": True}), ("streaming", {"n_sink": 4}),
])
def test_kept_tokens_read_back_from_the_store(tiny_qwen3, monkeypatch, dtype, store_options,
                                             bound, policy, options):
    prompt = tokens(90, 7)
    plans = spy_plans(monkeypatch)
    llm = LLM(tiny_qwen3, skip_tokenizer_init=True, block_size=BS, max_model_len=256,
              kv_cache_dtype=dtype, kv_policy=policy, kv_budget=40, kv_policy_options=options,
              **store_options)
    check_kept_read_back(llm, tiny_qwen3, prompt, plans, bound)


def check_kept_read_back(llm, model, prompt, plans, bound, budget=40):
    """Run the prompt, then every layer's cache holds the last plan's kept tokens of the float
    cache's K/V (keys at their true positions) within `bound` of relative error."""
    request = run_prompt(llm, prompt)
    assert request.compressed and request.num_cached_slots == budget
    assert len(request.block_table) == -(-budget // BS)  # the tail went back to the pool
    kept = plans[-1].kept
    reference = float_prompt_kv(model, prompt)
    store = llm.engine.kv_cache
    rope = rope_from_rotary(llm.engine.model.rotary) if store.pre_rope_keys else None
    for layer, ((k_ref, v_ref), layer_kept) in enumerate(zip(reference, kept)):
        k, v = store.read(layer, request.block_table, budget, rope)  # keys rotated back
        for got, ref in ((k, take(k_ref, layer_kept)), (v, take(v_ref, layer_kept))):
            err = (got - ref).abs().max() / ref.abs().max()
            assert err < bound, (layer, float(err))
    llm.engine.check_invariants()


@pytest.mark.parametrize("dtype,store_options,bound", [
    ("kvquant", {"kv_quant_bits": 4}, 0.6), ("kivi", {"kv_quant_bits": 4}, 0.6),
])
@pytest.mark.parametrize("policy,options", [
    ("snapkv", {"window": 8, "per_head": True}), ("streaming", {"n_sink": 4}),
])
def test_compaction_with_one_staging_row(tiny_qwen3, monkeypatch, dtype, store_options, bound,
                                         policy, options):
    """max_num_seqs=1: the store has one staging row, held by the prompt's partial last block
    (90 = 5 * 16 + 10 tokens). The compaction's new partial block (40 = 2 * 16 + 8) needs it
    while the old one is still in the request's table (it is freed after the plan is written):
    the store hands the old block's row over, and the kept tokens read back."""
    plans = spy_plans(monkeypatch)
    llm = LLM(tiny_qwen3, skip_tokenizer_init=True, block_size=BS, max_model_len=256,
              max_num_seqs=1, kv_cache_dtype=dtype, kv_policy=policy, kv_budget=40,
              kv_policy_options=options, **store_options)
    assert llm.engine.kv_cache.staging.num_rows == 1
    check_kept_read_back(llm, tiny_qwen3, tokens(90, 7), plans, bound)
    assert llm.engine.kv_cache.staging.num_free_rows == 0  # the new partial block holds it


def test_a_wrong_position_would_be_caught(tiny_qwen3, monkeypatch):
    """Control: kept keys compared at shifted positions are far outside the bound above."""
    prompt = tokens(90, 7)
    plans = spy_plans(monkeypatch)
    llm = LLM(tiny_qwen3, skip_tokenizer_init=True, block_size=BS, max_model_len=256,
              kv_cache_dtype="int8", kv_policy="knorm", kv_budget=40)
    request = run_prompt(llm, prompt)
    k_ref = float_prompt_kv(tiny_qwen3, prompt)[0][0]
    k, _ = llm.engine.kv_cache.read(0, request.block_table, 40)
    shifted = (plans[-1].kept[0] + 1).clamp(max=89)
    assert (k - take(k_ref, shifted)).abs().max() / k_ref.abs().max() > 0.1


@pytest.mark.parametrize("dtype,store_options", [("int8", {}), ("kvquant", {"kv_quant_bits": 4})])
def test_paged_eviction_over_a_quantized_cache(tiny_qwen3, dtype, store_options):
    """Block-wise decode eviction with a quantized store: cache length in [C, C + B - 1], at most
    ceil(C / B) + 1 blocks, block 0 kept, no leak, as many evictions as over the float pool."""
    prompts = [tokens(70 + 10 * i, 20 + i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    opts = dict(skip_tokenizer_init=True, block_size=BS, max_model_len=256,
                kv_policy="paged_eviction", kv_budget=48)
    llm = LLM(tiny_qwen3, kv_cache_dtype=dtype, **opts, **store_options)
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    first_blocks = {}

    def bounded(running):
        for r in running:
            if r.compressed:
                first_blocks.setdefault(r.request_id, r.block_table[0])
                assert r.block_table[0] == first_blocks[r.request_id]
                assert 48 <= r.num_cached_slots <= 48 + BS - 1 or r.num_output_tokens == 0
                assert len(r.block_table) <= -(-48 // BS) + 1

    outs = run_checked(engine, bounded)
    assert engine.policies.stats.decode_evicted_blocks > 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert sorted(outs) == sorted(ids)
    # the eviction schedule depends on lengths only: the same as over the float pool
    ref = LLM(tiny_qwen3, **opts)
    ref.generate(prompts, params)
    assert (engine.policies.stats.decode_evicted_blocks
            == ref.engine.policies.stats.decode_evicted_blocks)


@pytest.mark.parametrize("dtype,store_options", [("kvquant", {"kv_quant_bits": 4}),
                                                 ("kivi", {})])
@pytest.mark.parametrize("policy,options", [("snapkv", {"window": 8, "per_head": True}),
                                            ("paged_eviction", {})])
def test_policy_views_through_the_backends_reader(tiny_qwen3, monkeypatch, dtype, store_options,
                                                  policy, options):
    """The C backend installs its block reader on the store: policies choose the same tokens
    (plans, decode evictions) and greedy decoding gives the same tokens as with the store's own
    `read_blocks` (the reference reader)."""
    from nanokv.layers.native_quant_attention import load_quant_kernels

    load_quant_kernels()  # a build failure fails here, not as a silent PyTorch fallback
    prompts = [tokens(90, 7), tokens(75, 8)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plans = spy_plans(monkeypatch)

    def run(reference: bool):
        llm = LLM(tiny_qwen3, skip_tokenizer_init=True, block_size=BS, max_model_len=256,
                  kv_cache_dtype=dtype, kv_policy=policy, kv_budget=40,
                  kv_policy_options=options, device="cpu", **store_options)
        store = llm.engine.kv_cache
        assert llm.engine.attention_backend.name == "native" and store.block_reader is not None
        if reference:
            store.use_block_reader(None)
        del plans[:]
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.policies.stats
        return ([o.token_ids for o in outs], [p.kept for p in plans],
                stats.compressions, stats.decode_evicted_blocks)

    fast, ref = run(False), run(True)
    assert fast[2] + fast[3] > 0  # the policy acted
    assert fast[0] == ref[0] and fast[2:] == ref[2:]
    assert len(fast[1]) == len(ref[1])
    for kept, kept_ref in zip(fast[1], ref[1]):
        assert all(torch.equal(a, b) for a, b in zip(kept, kept_ref))


@pytest.mark.parametrize("dtype,store_options", [("auto", {}), ("kvquant", {"kv_quant_bits": 4}),
                                                 ("kivi", {"kv_quant_bits": 4})])
def test_streaming_block_slide_moves_nothing(tiny_qwen3, dtype, store_options):
    """StreamingLLM with slide="block": after the prompt's compaction the window slides by
    freeing the oldest block after the sinks' block, in place. The blocks that stay hold the
    same bytes from slide to slide (nothing re-written, so nothing rounded again), the cache
    stays within [C, C + B - 1] slots, the sinks' block stays, and nothing leaks."""
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    llm = LLM(tiny_qwen3, skip_tokenizer_init=True, block_size=BS, max_model_len=256,
              kv_cache_dtype=dtype, kv_policy="streaming", kv_budget=48,
              kv_policy_options={"n_sink": 4, "slide": "block"}, **store_options)
    engine = llm.engine
    rid = engine.add_request(tokens(90, 7), params)
    request = engine.scheduler.requests[rid]
    cache = engine.kv_cache
    buffers = (cache.buffers if dtype != "auto"
               else {"k": cache.kv[0].transpose(0, 1), "v": cache.kv[1].transpose(0, 1)})

    def block_bytes(block: int) -> list[torch.Tensor]:  # every per-block buffer of the block
        return [b[block].clone() for name, b in buffers.items()
                if not name.startswith("staging") and b.dim() and b.shape[0] == cache.num_blocks]

    seen, slides, sink_block = {}, 0, None
    while not request.is_finished:
        before = len(request.block_table)
        engine.step()
        if not request.compressed or request.is_finished:
            continue
        sink_block = sink_block if sink_block is not None else request.block_table[0]
        assert request.block_table[0] == sink_block
        assert 48 <= request.num_cached_slots <= 48 + BS - 1
        slides += len(request.block_table) < before
        seen = {b: v for b, v in seen.items() if b in request.block_table}  # freed: re-used
        for block in request.block_table[:request.num_cached_slots // BS]:  # full blocks
            now = block_bytes(block)
            if block in seen:
                assert all(torch.equal(a, b) for a, b in zip(seen[block], now)), block
            seen[block] = now
    stats = engine.policies.stats
    assert slides >= 5 and stats.decode_evicted_blocks == slides and stats.compressions == 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
