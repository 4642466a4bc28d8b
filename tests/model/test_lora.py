"""LoRA adapters (`enable_lora`, `LoRARequest`). Oracles: PEFT's own LoRA layers on the Hugging
Face model (greedy tokens of each adapter, the adapters written by PEFT); the same engine with
room for every adapter at once (max_loras 1, an adapter LRU that reads adapters again, a small
pool with preemption, speculative decoding); brute-force block accounting after every step."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from nanokv import LLM, SamplingParams
from nanokv.lora import LoRARequest
from policy_oracles import prompt_of, run_checked
from lora_oracles import check_against_merged
from tiny_models import build_lora_adapter, edit_json, hf_greedy, load_hf, load_hf_lora

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [prompt_of(21, seed=1), prompt_of(40, seed=2)]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tiny_qwen3, tmp_path_factory) -> dict[str, list[str]]:
    """model path -> three PEFT adapters of it: every projection at rank 8; q, v and down
    at rank 4 with rsLoRA; the MLP only at rank 16 on layer 1."""
    out = {}
    for path in (tiny_llama, tiny_qwen3):
        root = tmp_path_factory.mktemp("lora")
        out[path] = [
            build_lora_adapter(path, str(root / "all"), seed=1),
            build_lora_adapter(path, str(root / "qvd"), rank=4, alpha=8, seed=2, std=0.15,
                               targets=("q_proj", "v_proj", "down_proj"), use_rslora=True),
            build_lora_adapter(path, str(root / "mlp"), rank=16, alpha=16, seed=3,
                               targets=("gate_proj", "up_proj", "down_proj"),
                               layers_to_transform=[1]),
        ]
    return out


def loras(paths: list[str]) -> list[LoRARequest]:
    return [LoRARequest(f"adapter{i}", i + 1, p) for i, p in enumerate(paths)]


@pytest.fixture(scope="module")
def peft_tokens(tiny_llama, tiny_qwen3, adapters) -> dict[str, dict[int, list[list[int]]]]:
    """model path -> adapter id (0: none) -> PEFT's greedy tokens of each of PROMPTS."""
    out = {}
    for path in (tiny_llama, tiny_qwen3):
        models = {0: load_hf(path)}
        models.update({i + 1: load_hf_lora(path, a) for i, a in enumerate(adapters[path])})
        out[path] = {i: [hf_greedy(m, p, MAX_TOKENS)[0] for p in PROMPTS]
                     for i, m in models.items()}
    return out


def engine_run(llm: LLM, requests: list[tuple[list[int], LoRARequest | None]],
               params: SamplingParams = GREEDY, check=None) -> list[list[int]]:
    """Each (prompt, adapter) run through the engine together, the block accounting checked
    after every step; their tokens in order."""
    engine = llm.engine
    ids = [engine.add_request(p, params, lora_request=lora) for p, lora in requests]
    outs = run_checked(engine, check)
    return [outs[i].outputs[0].token_ids for i in ids]


def mixed(path: str, adapters: dict) -> list[tuple[list[int], LoRARequest | None]]:
    """Every prompt under the base model and each adapter."""
    return [(p, lora) for p in PROMPTS for lora in [None, *loras(adapters[path])]]


def expected(peft_tokens, path) -> list[list[int]]:
    want = peft_tokens[path]
    return [want[i][j] for j in range(len(PROMPTS)) for i in range(len(want))]


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_adapters_in_one_batch_match_peft(model, tiny_llama, tiny_qwen3, adapters, peft_tokens):
    """The base model and three adapters (ranks 4-16, different projections and layers,
    rsLoRA) in the same steps: each request's tokens are PEFT's for its adapter."""
    path = tiny_llama if model == "llama" else tiny_qwen3
    assert len({str(t) for t in peft_tokens[path].values()}) == 4  # the adapters matter
    llm = LLM(path, enable_lora=True, max_loras=3, num_kv_blocks=64, block_size=16)
    steps = []
    got = engine_run(llm, mixed(path, adapters),
                     check=lambda running: steps.append({r.lora_int_id for r in running}))
    assert got == expected(peft_tokens, path)
    assert {0, 1, 2, 3} in steps  # they did share steps
    assert llm.engine.list_loras() == {1, 2, 3}


def test_one_adapter_slot_and_an_lru_that_reads_again(tiny_llama, adapters, peft_tokens):
    """max_loras 1: no step holds two adapters, requests of the base model and of the running
    adapter go ahead of those waiting for the slot; max_cpu_loras 1 reads an adapter from
    disk again after another took its place. The tokens stay PEFT's."""
    llm = LLM(tiny_llama, enable_lora=True, max_loras=1, max_cpu_loras=1, num_kv_blocks=64,
              block_size=16)
    distinct = []
    got = engine_run(llm, mixed(tiny_llama, adapters), check=lambda running: distinct.append(
        len({r.lora_int_id for r in running} - {0})))
    assert got == expected(peft_tokens, tiny_llama)
    assert max(distinct) == 1
    # the first step admitted both prompts' base requests and the first adapter's, not the
    # others (waiting for the slot)
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY, lora_request=lora) for p, lora in mixed(tiny_llama,
                                                                                adapters)]
    engine.step()
    running = {r.request_id for r in engine.scheduler.running}
    assert running == {ids[0], ids[1], ids[4], ids[5]}
    stats = engine.stats()  # what /metrics' lora_requests_info shows
    assert (stats.max_loras, stats.running_lora_adapters, stats.waiting_lora_adapters) == (
        1, ("adapter0",), ("adapter1", "adapter2"))
    assert engine.scheduler.blocks_to_admit() == 0  # every waiting one waits for the slot
    run_checked(engine)


def test_prefix_cache_is_keyed_by_adapter(tiny_qwen3, adapters, peft_tokens):
    """A prompt's blocks computed under one adapter are hits for that adapter only: the base
    model's blocks are no hit for an adapter, an adapter's are for its next request (whose
    tokens stay PEFT's)."""
    llm = LLM(tiny_qwen3, enable_lora=True, max_loras=2, num_kv_blocks=64, block_size=16)
    first, second = loras(adapters[tiny_qwen3])[:2]
    prompt = PROMPTS[1]  # 40 tokens: two full blocks
    want = peft_tokens[tiny_qwen3]
    cached = []
    for lora, adapter_id in ((None, 0), (first, 1), (first, 1), (second, 2), (None, 0)):
        out = llm.generate([prompt], GREEDY, lora_request=lora, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want[adapter_id][1]
        cached.append(out.num_cached_tokens)
    assert cached == [0, 0, 32, 0, 32]


def test_preemption_and_chunked_prefill_under_adapters(tiny_llama, adapters):
    """A pool too small for the batch (preemption, recompute) and prefill chunks of 16 tokens
    give every request the tokens it gets with room to spare."""
    requests = [(prompt_of(30 + 7 * i, seed=10 + i), lora)
                for i, lora in enumerate([None, *loras(adapters[tiny_llama])] * 2)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = engine_run(LLM(tiny_llama, enable_lora=True, max_loras=3, num_kv_blocks=128,
                           block_size=16), requests, params)
    tight = LLM(tiny_llama, enable_lora=True, max_loras=2, num_kv_blocks=8, block_size=16,
                max_num_batched_tokens=16)
    assert engine_run(tight, requests, params) == roomy
    assert tight.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("speculative", ["ngram", "draft_model"])
def test_speculative_decoding_under_adapters(speculative, tiny_qwen3, adapters, peft_tokens):
    """Drafts (n-grams, or the base model drafting for its adapters) verified under each
    request's adapter: the tokens are PEFT's."""
    config = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
               "prompt_lookup_min": 1} if speculative == "ngram"
              else {"model": tiny_qwen3, "num_speculative_tokens": 3})
    llm = LLM(tiny_qwen3, enable_lora=True, max_loras=3, num_kv_blocks=96, block_size=16,
              speculative_config=config)
    assert engine_run(llm, mixed(tiny_qwen3, adapters)) == expected(peft_tokens, tiny_qwen3)
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0


def test_generate_chat_and_beam_search_take_lora_request(tiny_qwen3, adapters, peft_tokens):
    """LLM.generate's lora_request per prompt; beam search of width 1 under an adapter is its
    greedy decoding."""
    from nanokv import BeamSearchParams

    llm = LLM(tiny_qwen3, enable_lora=True, max_loras=2, num_kv_blocks=64, block_size=16)
    first, second = loras(adapters[tiny_qwen3])[:2]
    want = peft_tokens[tiny_qwen3]
    outs = llm.generate(PROMPTS, GREEDY, lora_request=[second, None], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want[2][0], want[0][1]]
    beams = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS,
                                                           ignore_eos=True), lora_request=first)
    assert beams[0].sequences[0].tokens[len(PROMPTS[0]):] == want[1][0]
    with pytest.raises(ValueError, match="2 LoRA requests for 1 prompts"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=[first, second])


def _copy(src: str, dst: str, **config_changes) -> str:
    shutil.copytree(src, dst)
    edit_json(os.path.join(dst, "adapter_config.json"), **config_changes)
    return dst


def test_bad_adapters_are_refused_with_nothing_allocated(tiny_llama, adapters, tmp_path):
    good = adapters[tiny_llama][0]
    llm = LLM(tiny_llama, enable_lora=True, max_lora_rank=8, num_kv_blocks=32, block_size=16)
    engine = llm.engine
    head = build_lora_adapter(tiny_llama, str(tmp_path / "head"), targets=("lm_head",))
    wide = adapters[tiny_llama][2]  # rank 16
    os.makedirs(tmp_path / "empty")
    pickle = _copy(good, str(tmp_path / "pickle"))
    os.rename(os.path.join(pickle, "adapter_model.safetensors"),
              os.path.join(pickle, "adapter_model.bin"))
    cases = [
        (LoRARequest("wide", 1, wide), "rank 16, more than max_lora_rank 8"),
        (LoRARequest("x", 1, str(tmp_path / "missing")), "is not a directory"),
        (LoRARequest("x", 1, str(tmp_path / "empty")), "no adapter_config.json"),
        (LoRARequest("x", 1, pickle), "adapter_model.bin, a pickle, is not read"),
        (LoRARequest("x", 1, head), "tensors nanokv cannot apply.*lm_head"),
        (LoRARequest("x", 1, _copy(good, str(tmp_path / "dora"), use_dora=True)),
         "DoRA"),
        (LoRARequest("x", 1, _copy(good, str(tmp_path / "save"),
                                   modules_to_save=["lm_head"])), "modules_to_save"),
        (LoRARequest("x", 1, _copy(good, str(tmp_path / "ia3"), peft_type="IA3")),
         "IA3 adapter"),
        (LoRARequest("x", 1, _copy(good, str(tmp_path / "rank"), r=4)),
         r"lora_A \[8, \d+\] and lora_B \[\d+, 8\]; the model needs \[4, \d+\]"),
    ]
    for lora, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.add_request(PROMPTS[0], GREEDY, lora_request=lora)
    engine.add_request(PROMPTS[0], GREEDY, lora_request=LoRARequest("good", 1, good))
    with pytest.raises(ValueError, match="lora_int_id 1 is already the adapter 'good'"):
        engine.add_request(PROMPTS[0], GREEDY, lora_request=LoRARequest("other", 1, wide))
    with pytest.raises(ValueError, match="lora_name 'good' is already the adapter of "
                                         "lora_int_id 1"):
        engine.add_request(PROMPTS[0], GREEDY, lora_request=LoRARequest("good", 2, good))
    with pytest.raises(ValueError, match="must be a nanokv.lora.LoRARequest"):
        engine.add_request(PROMPTS[0], GREEDY, lora_request=("good", 1, good))
    # only the good request was queued; it runs, and everything is given back
    assert len(engine.scheduler.waiting) == 1
    run_checked(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_lora_options_are_checked(tiny_llama, adapters):
    good = LoRARequest("good", 1, adapters[tiny_llama][0])
    llm = LLM(tiny_llama, num_kv_blocks=16, block_size=16)
    with pytest.raises(ValueError, match="lora_request needs an engine started with "
                                         "enable_lora=True"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=good, use_tqdm=False)
    assert llm.engine.scheduler.waiting == type(llm.engine.scheduler.waiting)()
    for options, message in (
            ({"max_loras": 0}, "max_loras must be an integer >= 1"),
            ({"max_lora_rank": "16"}, "max_lora_rank must be an integer >= 1"),
            ({"max_loras": 3, "max_cpu_loras": 2}, r"max_cpu_loras \(2\) must be >= max_loras"),
            ({"enable_lora": "yes"}, "enable_lora must be true or false"),
            ({"enable_lora": True, "tensor_parallel_size": 2},
             "enable_lora runs with tensor_parallel_size 1 only")):
        with pytest.raises(ValueError, match=message):
            LLM(tiny_llama, num_kv_blocks=16, block_size=16, **options)
    for args, message in ((("", 1, "p"), "lora_name must be a non-empty string"),
                          (("a", 0, "p"), "lora_int_id must be an integer >= 1"),
                          (("a", True, "p"), "lora_int_id must be an integer >= 1"),
                          (("a", 1, ""), "lora_path must be the path")):
        with pytest.raises(ValueError, match=message):
            LoRARequest(*args)


@pytest.mark.parametrize("options", [{}, {"kv_cache_dtype": "int8"},
                                     {"kv_policy": "streaming", "kv_budget": 24}],
                         ids=["float", "int8", "streaming"])
def test_adapters_match_merged_weights(tiny_model, tmp_path, options):
    """Adapters written without PEFT against the merged weights (the CUDA test's check), over
    the float pool, an int8 cache and a KV policy (each the same in both engines)."""
    check_against_merged(tiny_model, tmp_path, **options)


def test_generate_cli_runs_prompts_under_an_adapter(tiny_llama, adapters, peft_tokens, capsys):
    """`nanokv generate --lora-path DIR`: PEFT's tokens; a bad adapter exits 2 naming it."""
    from nanokv.cli import main

    prompt = ",".join(map(str, PROMPTS[0]))
    common = ["generate", "--model", tiny_llama, "--prompt-token-ids", prompt, "--json",
              "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--num-kv-blocks", "32",
              "--block-size", "16"]
    assert main([*common, "--lora-path", adapters[tiny_llama][1]]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["token_ids"] == peft_tokens[tiny_llama][2][0]
    assert main([*common, "--lora-path", adapters[tiny_llama][2], "--max-lora-rank", "8"]) == 2
    assert "rank 16, more than max_lora_rank 8" in capsys.readouterr().err


def test_removed_adapter_frees_its_name_and_its_queued_requests_finish(tiny_llama, adapters,
                                                                       peft_tokens):
    """remove_lora (vLLM's): the name may then name another id; a request queued under the
    removed adapter still runs with it (PEFT's tokens), its weights read again if need be."""
    llm = LLM(tiny_llama, enable_lora=True, max_loras=1, max_cpu_loras=1, num_kv_blocks=64,
              block_size=16)
    engine = llm.engine
    first, second, _ = loras(adapters[tiny_llama])
    queued = engine.add_request(PROMPTS[0], GREEDY, lora_request=first)
    other = engine.add_request(PROMPTS[0], GREEDY, lora_request=second)
    assert engine.remove_lora(1) and not engine.remove_lora(1) and not engine.remove_lora(7)
    assert engine.list_loras() == {2}
    renamed = engine.add_request(PROMPTS[1], GREEDY, lora_request=LoRARequest(
        "adapter0", 9, adapters[tiny_llama][1]))
    with pytest.raises(ValueError, match="lora_int_id 1 is already the adapter 'adapter0'"):
        engine.add_request(PROMPTS[1], GREEDY, lora_request=LoRARequest(
            "adapter0", 1, adapters[tiny_llama][2]))
    outs = run_checked(engine)
    want = peft_tokens[tiny_llama]
    assert outs[queued].outputs[0].token_ids == want[1][0]
    assert outs[other].outputs[0].token_ids == want[2][0]
    assert outs[renamed].outputs[0].token_ids == want[2][1]
