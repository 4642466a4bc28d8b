"""Tensor parallelism on CPU (gloo, 2 ranks): the same greedy tokens as one process through
prefix hits, chunked prefill, preemption, KV policies (per request, pool pressure included),
biases, quantized KV (KVQuant with a calibration cut by head), int8 weights and speculative
drafts;
unsupported models rejected before any process starts; a killed rank ends the run with an error
naming it, within a time limit."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch
from schedule_spy import record_decode_rows
from tiny_models import build_tiny_model

from nanokv import LLM, SamplingParams
from nanokv.distributed.executor import TensorParallelError
from nanokv.policies.base import PolicyConfig

# small pool and step budget: long prompts are chunked, requests get preempted
OPTIONS = dict(block_size=16, max_model_len=256, num_kv_blocks=48, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def workload(seed: int, n: int) -> list[list[int]]:
    """n prompts sharing a 40-token prefix (prefix-cache hits), 45-140 tokens long."""
    rng = random.Random(seed)
    shared = [rng.randrange(300) for _ in range(40)]
    return [shared + [rng.randrange(300) for _ in range(rng.randrange(5, 100))]
            for _ in range(n)]


def run(llm: LLM, prompts, policies) -> list[list[int]]:
    requests = [llm.engine.make_request(p, GREEDY, kv_policy=policies[i % len(policies)])
                for i, p in enumerate(prompts)]
    return [o.outputs[0].token_ids for o in llm.generate_requests(requests, use_tqdm=False)]


def prefill(llm: LLM, prompt: list[int]):
    """Add the prompt and step until it is computed; its request."""
    rid = llm.engine.add_request(prompt, GREEDY)
    request = llm.engine.scheduler.requests[rid]
    while request.num_computed_tokens < len(prompt):
        llm.engine.step()
    return request


def compare(path: str, policies: list, min_same: int | None = None, **options):
    """Run the workload on 1 and 2 ranks; the 2-rank engine's policy stats. min_same: at least
    that many of the 14 requests' tokens the same, every first token the same (None: all; a
    4-bit cache can turn the ranks' different float rounding into a flipped near tie)."""
    prompts = workload(0, 14)
    options = {**OPTIONS, **options}
    one = LLM(path, **options)
    expected = run(one, prompts, policies)
    two = LLM(path, tensor_parallel_size=2, **options)
    try:
        got = run(two, prompts, policies)
        if min_same is None:
            assert got == expected
        else:
            assert [g[0] for g in got] == [e[0] for e in expected]
            assert sum(g == e for g, e in zip(got, expected)) >= min_same
        stats, ref = two.engine.stats(), one.engine.stats()
        assert stats == ref  # the same schedule: hits, preemptions, evictions
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        assert stats.evicted_blocks["policy"] > 0
        two.engine.check_invariants()
        return two.engine.policies.stats
    finally:
        two.engine.close()


def test_llama_float_pool_every_policy(tiny_llama):
    policies = [PolicyConfig("snapkv", budget=40, options={"window": 8}),
                PolicyConfig("paged_eviction", budget=48), PolicyConfig("h2o", budget=40),
                PolicyConfig("pyramidkv", budget=40), PolicyConfig("streaming", budget=40),
                PolicyConfig("paged_eviction"),  # no budget: evicts under pool pressure
                None]
    stats = compare(tiny_llama, policies)
    assert stats.pressure_evicted_blocks > 0 and stats.decode_evicted_blocks > 0


def test_qwen3_int8_kv(tiny_qwen3):
    policies = [PolicyConfig("snapkv", budget=40, options={"window": 8}),
                PolicyConfig("paged_eviction", budget=48), PolicyConfig("knorm",
                                                                        compression_ratio=0.5),
                None]
    compare(tiny_qwen3, policies, kv_cache_dtype="int8")


def calibration_file(path, num_layers: int, num_kv_heads: int, head_dim: int, seed: int) -> str:
    """A KVQuant calibration with random 4-bit codebooks per layer and key outlier thresholds
    that differ per head and channel (tight: many keys are outliers), 2 sink tokens."""
    from nanokv.quant.calibration_file import Calibration

    gen = torch.Generator().manual_seed(seed)

    def books():
        return tuple(tuple(sorted((2 * torch.rand(16, generator=gen) - 1).tolist()))
                     for _ in range(num_layers))

    lower = -0.2 - torch.rand(num_layers, num_kv_heads, head_dim, generator=gen)
    upper = 0.2 + torch.rand(num_layers, num_kv_heads, head_dim, generator=gen)
    Calibration(
        "random", num_layers, num_kv_heads, head_dim,
        dict(block_size=16, outlier_fraction=0.05, num_sink_tokens=2, per_channel_keys=True,
             nuq=True), {4: (books(), books())}, torch.stack([lower, upper], dim=1),
        1.0).save(path)
    return str(path)


def test_calibrated_kvquant_on_two_ranks(tiny_qwen3, tmp_path):
    """Everything KVQuant computes is per KV head: with each rank's share of the calibrated key
    thresholds, the 2 ranks hold one process's codes (the dequantized cache of a request equal,
    every head) and give its tokens and schedule through policies, prefix hits and
    preemption."""
    path = calibration_file(tmp_path / "calib.json", 2, 2, 32, seed=3)
    kv = dict(kv_cache_dtype="kvquant", kv_quant_config=path, kv_quant_bits=4)
    prompt = workload(2, 1)[0]

    one = LLM(tiny_qwen3, **OPTIONS, **kv)
    view_one = one.engine.kv_cache.policy_view(prefill(one, prompt))
    two = LLM(tiny_qwen3, tensor_parallel_size=2, **OPTIONS, **kv)
    try:
        view_two = two.engine.policies.kv_cache.policy_view(prefill(two, prompt))
        n = len(prompt)
        for layer in range(2):
            for got, ref in zip(view_two.layers[layer], view_one.layers[layer]):
                # the ranks' projections round differently from one process's: a statistic's
                # fp16 rounding may differ (~1e-5); another rank's thresholds move whole codes
                torch.testing.assert_close(got.flatten(0, 1)[:n], ref.flatten(0, 1)[:n],
                                           atol=2e-4, rtol=0)
    finally:
        two.engine.close()
    policies = [PolicyConfig("snapkv", budget=40, options={"window": 8}),
                PolicyConfig("paged_eviction", budget=48), None]
    compare(tiny_qwen3, policies, min_same=10, **kv)


@pytest.mark.parametrize("tied", [False, True])
def test_int8_weights_on_two_ranks(tmp_path, tiny_qwen3, tied):
    """Each rank quantizes its shard with the whole rows' scales (a row-parallel shard's row
    ranges max-reduced over the ranks): one process's codes, so its tokens and schedule, with
    biases (o and down's added once, after the sum), policies, prefix hits and preemption; each
    rank looks its vocabulary rows up in int8 codes of its own (untied) or its LM head's."""
    path = tiny_qwen3 if tied else build_tiny_model(str(tmp_path / "biased"), "llama",
                                                    attention_bias=True, mlp_bias=True)
    one = LLM(path, **OPTIONS, quantization="int8").engine.model
    two = LLM(path, tensor_parallel_size=2, **OPTIONS, quantization="int8")
    try:  # rank 0's shards of the row-parallel o and down: one process's scales and codes
        rank0 = two.engine.model
        for layer, mine in zip(one.layers, rank0.layers):
            for whole, shard in ((layer.self_attn.o_proj, mine.self_attn.o_proj),
                                 (layer.mlp.down_proj, mine.mlp.down_proj)):
                assert torch.equal(shard.scale, whole.scale)
                assert torch.equal(shard.panels, whole.panels[:, :shard.in_features])
        table = rank0.embed_tokens.int8
        assert (table.panels is rank0.lm_head.panels) == tied
        ids = torch.arange(rank0.embed_tokens.rows)  # rank 0's rows, the first of the vocabulary
        assert torch.equal(table(ids), one.embed_tokens(ids))
        assert rank0.embed_tokens.weight.numel() == 0
    finally:
        two.engine.close()
    policies = [PolicyConfig("paged_eviction", budget=48), PolicyConfig("h2o", budget=40), None]
    compare(path, policies, quantization="int8")


def test_speculative_drafts_on_two_ranks_beside_per_request_policies(tiny_llama):
    """n-gram drafts verified on 2 ranks give one process's tokens without drafts; requests
    with a KV policy decode without drafts beside them."""
    prompts = workload(1, 6) + [[5, 6, 7, 8] * 6, [9, 10, 11] * 8]
    policies = [None, PolicyConfig("snapkv", budget=40, options={"window": 8})]
    expected = run(LLM(tiny_llama, **OPTIONS), prompts, policies)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}
    two = LLM(tiny_llama, tensor_parallel_size=2, speculative_config=spec, **OPTIONS)
    try:
        assert run(two, prompts, policies) == expected
        assert two.engine.scheduler.spec_stats.num_accepted_tokens > 0
        two.engine.check_invariants()
    finally:
        two.engine.close()


def test_speculative_drafts_on_two_ranks_over_kivi(tiny_llama):
    """Over a store that quantizes full blocks (each rank's staging rewound where drafts were
    rejected, drafts before a block's last slot): one process's tokens without drafts."""
    prompts = workload(2, 4) + [[5, 6, 7, 8] * 6, [9, 10, 11] * 8]
    options = dict(OPTIONS, kv_cache_dtype="kivi", kv_quant_bits=2)
    expected = run(LLM(tiny_llama, **options), prompts, [None])
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}
    two = LLM(tiny_llama, tensor_parallel_size=2, speculative_config=spec, **options)
    try:
        assert run(two, prompts, [None]) == expected
        assert two.engine.scheduler.spec_stats.num_accepted_tokens > 0
        two.engine.check_invariants()
    finally:
        two.engine.close()


def test_decode_rows_on_two_ranks(tiny_qwen3, monkeypatch):
    """Short chunks after prefix hits as decode rows on 2 ranks (int8 codes): the tokens of one
    process that takes them by the prefill path."""
    import nanokv.scheduler.scheduler as scheduler_module

    rng = random.Random(3)
    shared = [rng.randrange(300) for _ in range(40)]
    prompts = [shared] + [shared + [rng.randrange(300) for _ in range(n)] for n in (1, 3, 6)]
    options = dict(OPTIONS, kv_cache_dtype="int8")
    monkeypatch.setattr(scheduler_module, "DECODE_ROW_CHUNK", 0)
    expected = run(LLM(tiny_qwen3, **options), prompts, [None])
    monkeypatch.setattr(scheduler_module, "DECODE_ROW_CHUNK", 8)
    two = LLM(tiny_qwen3, tensor_parallel_size=2, **options)
    routed = record_decode_rows(two.engine, monkeypatch)
    try:
        assert run(two, prompts, [None]) == expected
        assert routed
        two.engine.check_invariants()
    finally:
        two.engine.close()


def test_biases_of_q_k_v_o_and_the_mlp(tmp_path):
    """Column-parallel biases are split with their rows; row-parallel ones (o, down) are added
    once, after the all-reduce."""
    path = build_tiny_model(str(tmp_path / "biased"), "llama", attention_bias=True,
                            mlp_bias=True)
    prompts = workload(1, 4)
    expected = run(LLM(path, **OPTIONS), prompts, [None])
    two = LLM(path, tensor_parallel_size=2, **OPTIONS)
    try:
        assert run(two, prompts, [None]) == expected
    finally:
        two.engine.close()


def test_policy_views_gather_a_layer_when_read(tiny_qwen3, monkeypatch):
    """A 2-rank policy view sends nothing but GatherView when taken; reading a layer (or some
    of its blocks) gathers just that from both ranks, equal to one process's cache; a view is
    read only until the next one is taken."""
    prompt = workload(1, 1)[0]

    one = LLM(tiny_qwen3, **OPTIONS)
    expected = prefill(one, prompt)
    k_one, v_one = one.engine.kv_cache.layer(1)  # [num_blocks, B, Hkv, D]
    two = LLM(tiny_qwen3, tensor_parallel_size=2, **OPTIONS)
    try:
        request = prefill(two, prompt)
        kv = two.engine.policies.kv_cache
        sent = []
        send = kv.executor.send
        monkeypatch.setattr(kv.executor, "send",
                            lambda command: (sent.append(type(command).__name__), send(command)))
        view = kv.policy_view(request)
        assert sent == ["GatherView"]
        nb = len(view.block_table)
        k, v = view.layers[1]  # [nb, B, Hkv, D], all heads
        assert sent == ["GatherView", "GatherLayer"] and k.shape[0] == nb
        n = len(prompt)
        for got, ref in ((k, k_one), (v, v_one)):
            torch.testing.assert_close(got.flatten(0, 1)[:n],
                                       ref[expected.block_table].flatten(0, 1)[:n])
        k_last, _ = view.blocks(1, [nb - 1])
        torch.testing.assert_close(k_last, k[nb - 1:])
        assert sent[-1] == "GatherLayer" and len(sent) == 3
        kv.policy_view(request)
        with pytest.raises(RuntimeError, match="until the next policy_view"):
            view.layers[0]
    finally:
        two.engine.close()


def test_unsupported_combinations_are_rejected_before_starting(tmp_path, tiny_qwen3):
    gqa = build_tiny_model(str(tmp_path / "gqa3"), "llama", tokenizer=False,
                           num_attention_heads=6, num_key_value_heads=3, hidden_size=96)
    with pytest.raises(ValueError, match=r"does not divide the model's 3 KV heads.*\[1, 3\]"):
        LLM(gqa, tensor_parallel_size=2, skip_tokenizer_init=True)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            LLM(tiny_qwen3, tensor_parallel_size=bad)


def test_killed_rank_fails_the_run_within_a_time_limit(tmp_path):
    # an odd vocabulary: the last rank's share of the embedding and LM head is padded
    path = build_tiny_model(str(tmp_path / "odd-vocab"), "qwen3", seed=2, tokenizer=False,
                            vocab_size=321)
    prompts = workload(1, 4)
    # a start that fails after the ranks were spawned stops them and leaves the group
    with pytest.raises(ValueError, match="cannot hold one request"):
        LLM(path, skip_tokenizer_init=True, tensor_parallel_size=2,
            **{**OPTIONS, "num_kv_blocks": 2})
    one = LLM(path, skip_tokenizer_init=True, **OPTIONS)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(path, skip_tokenizer_init=True, tensor_parallel_size=2, **OPTIONS)
    engine = llm.engine
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == expected
        for p in prompts:
            engine.add_request(p, GREEDY)
        for _ in range(3):
            engine.step()
        pid = engine.executor.workers[0].pid
        os.kill(pid, signal.SIGKILL)
        outcome: list[BaseException] = []

        def drive() -> None:
            try:
                while engine.has_unfinished_requests():
                    engine.step()
            except BaseException as e:  # noqa: BLE001 - handed to the test thread
                outcome.append(e)

        start = time.monotonic()
        thread = threading.Thread(target=drive, daemon=True)
        thread.start()
        thread.join(30)
        assert not thread.is_alive(), "the engine hung after a rank died"
        assert time.monotonic() - start < 30
        assert len(outcome) == 1 and isinstance(outcome[0], TensorParallelError), outcome
        message = str(outcome[0])
        assert f"rank 1 (pid {pid}) was killed by SIGKILL" in message
        with pytest.raises(TensorParallelError, match="SIGKILL"):  # and it stays failed
            llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    finally:
        engine.close()


def test_an_interrupt_in_a_step_ends_the_group_with_an_error_that_says_so(tiny_llama):
    """Ctrl-C while rank 0 runs its share of a step (the other rank waits in its collectives):
    the interrupt goes up, the ranks stop, and later calls say the group was interrupted
    (before, the next call's collectives paired up wrongly and rank 1 died of SIGABRT)."""
    llm = LLM(tiny_llama, tensor_parallel_size=2, **OPTIONS)
    engine = llm.engine
    try:
        local = engine.runner.local
        real, calls = local.execute, []

        def interrupted(sched):
            calls.append(sched)
            if len(calls) == 3:  # the other rank got this step and waits in it
                raise KeyboardInterrupt
            return real(sched)

        local.execute = interrupted
        with pytest.raises(KeyboardInterrupt):
            llm.generate(workload(2, 4), GREEDY, use_tqdm=False)
        assert not any(p.is_alive() for p in engine.executor.workers)
        with pytest.raises(TensorParallelError, match=r"rank 0 was interrupted \(KeyboardInterrupt"
                                                      r"\) in the middle of a step"):
            llm.generate(workload(2, 1), GREEDY, use_tqdm=False)
    finally:
        engine.close()
