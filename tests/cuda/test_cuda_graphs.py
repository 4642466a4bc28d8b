"""On a CUDA GPU (skipped elsewhere): decode through CUDA graphs gives Hugging Face's greedy
tokens and the eager engine's, with batch sizes between the captured buckets and under
preemption; sampling on the device equals the per-row host reference for seeded requests."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from nanokv import LLM, SamplingParams
from nanokv.layers.sampler import Sampler
from tiny_models import VOCAB, hf_greedy, load_hf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BLOCK, MAX_LEN = 16, 128


def workload(seed: int, n: int, longest: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, VOCAB - 10) for _ in range(rng.randrange(3, 40))]
               for _ in range(n)]
    lengths = [rng.randrange(2, longest) for _ in range(n)]  # requests leave at different steps
    return prompts, lengths


def engine(model: str, enforce_eager: bool, **options) -> LLM:
    return LLM(model, device="cuda", dtype="float32", block_size=BLOCK, max_model_len=MAX_LEN,
               max_num_seqs=20, skip_tokenizer_init=True, enforce_eager=enforce_eager,
               **options)


def graphs_of(llm: LLM):
    graphs = llm.engine.runner.graphs
    if graphs is None:
        pytest.skip(f"attention backend {llm.engine.attention_backend.name!r} does not "
                    f"support CUDA graphs")
    return graphs


@pytest.mark.parametrize("options,seed,longest", [
    (dict(), 0, 14), (dict(num_kv_blocks=8), 1, 40)], ids=["buckets", "preemption"])
def test_greedy_with_graphs_equals_hf_and_eager(tiny_model, options, seed, longest):
    prompts, lengths = workload(seed, 5, longest)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    hf = load_hf(tiny_model)
    expected = [hf_greedy(hf, p, n)[0] for p, n in zip(prompts, lengths)]
    llm = engine(tiny_model, enforce_eager=False, **options)
    graphs = graphs_of(llm)
    assert graphs.batch_sizes == [1, 2, 4, 8, 16, 20] and len(graphs.graphs) == 6
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    eager_llm = engine(tiny_model, enforce_eager=True, **options)
    assert eager_llm.engine.runner.graphs is None
    eager = [o.token_ids for o in eager_llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert eager == expected
    # 5, 4, 3 ... running requests: replays of the 8-, 4-, 2-row graphs with padding
    assert graphs.num_graph_steps > 0 and graphs.padded_rows > 0
    if options:
        assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.check_invariants()


def test_seeded_sampling_with_graphs_equals_eager(tiny_llama):
    prompts, _ = workload(2, 6, 8)
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=100 + i, max_tokens=8,
                             ignore_eos=True) for i in range(6)]
    llm = engine(tiny_llama, enforce_eager=False)
    graphs_of(llm)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    eager = engine(tiny_llama, enforce_eager=True)
    assert got == [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]


def test_a_graph_decode_step_synchronises_once(tiny_llama):
    """A decode step through a graph, sampled with seeds, top-k and top-p: the only host
    synchronisation is the sampled tokens' transfer (CUDA's sync debug mode reports each)."""
    llm = engine(tiny_llama, enforce_eager=False)
    graphs = graphs_of(llm)
    eng = llm.engine
    prompts, _ = workload(3, 5, 8)
    for i, p in enumerate(prompts):
        eng.add_request(p, SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=i,
                                          max_tokens=30, ignore_eos=True))
    for _ in range(10):  # prefill, then warm decode steps
        if graphs.num_graph_steps >= 2:
            break
        eng.step()
    assert graphs.num_graph_steps >= 2
    before = graphs.num_graph_steps
    syncs = synchronisations_of_one_step(eng)
    assert graphs.num_graph_steps == before + 1
    assert len(syncs) <= 1, syncs


def synchronisations_of_one_step(eng) -> list[str]:
    """The host synchronisations one engine step makes, as CUDA's sync debug mode reports them:
    each synchronising call warns "called a synchronizing CUDA operation" (the mode's own notice,
    "... a prototype feature and does not yet detect all synchronizing operations", is not
    one)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            eng.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]


@pytest.mark.parametrize("seed", range(4))
def test_device_sampling_equals_the_host_reference(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    vocab = 2000
    logits = torch.randn(32, vocab) * 3  # [N, vocab]
    params, histories = [], []
    for i in range(32):
        params.append(SamplingParams(
            temperature=rng.choice([0, 0.5, 1.0]), top_k=rng.choice([-1, 1, 50]),
            top_p=rng.choice([1.0, 0.8]), min_p=rng.choice([0.0, 0.05]),
            repetition_penalty=rng.choice([1.0, 1.2]), frequency_penalty=rng.choice([0, 0.3]),
            seed=rng.choice([None, 1000 + i]), logprobs=rng.choice([None, 2])))
        histories.append(([rng.randrange(vocab) for _ in range(20)],
                          [rng.randrange(vocab) for _ in range(10)]))
    indices = [rng.randrange(30) for _ in range(32)]
    got = Sampler(7).sample(logits.cuda(), params, indices, histories)
    want = Sampler(7).sample_reference(logits, params, indices, histories)
    assert got.token_ids == want
    for p, lp in zip(params, got.logprobs):
        assert (lp is None) == (p.logprobs is None)


@pytest.mark.parametrize("with_penalties", [False, True])
def test_device_sampling_of_banned_tokens_equals_the_host_reference(with_penalties):
    """min_tokens' banned tokens masked on the device (`ban_tokens`: one upload of (row, token)
    pairs; a masked copy when no penalty made one, the penalised copy otherwise): the host
    reference's tokens, no banned token picked, and the raw log-probabilities untouched."""
    rng = random.Random(5)
    torch.manual_seed(5)
    vocab = 2000
    logits = torch.randn(24, vocab) * 3  # [N, vocab]
    params = [SamplingParams(temperature=rng.choice([0, 0.7]), top_k=rng.choice([-1, 2]),
                             repetition_penalty=1.2 if with_penalties else 1.0,
                             seed=1000 + i, logprobs=2) for i in range(24)]
    histories = [([rng.randrange(vocab) for _ in range(20)], [rng.randrange(vocab)])
                 for _ in range(24)] if with_penalties else None
    banned = [tuple(logits[i].topk(rng.randint(1, 3)).indices.tolist()) if i % 3 else ()
              for i in range(24)]
    indices = list(range(24))
    device_logits = logits.cuda()
    got = Sampler(7).sample(device_logits, params, indices, histories, banned)
    assert got.token_ids == Sampler(7).sample_reference(logits, params, indices, histories,
                                                        banned)
    assert all(t not in b for t, b in zip(got.token_ids, banned))
    assert torch.equal(device_logits.cpu(), logits)  # the raw logits were not masked
    raw = Sampler(7).sample(logits, params, indices, histories)
    for lp, ref in zip(got.logprobs, raw.logprobs):
        assert [t for t, _ in lp.top] == [t for t, _ in ref.top]
        assert [v for _, v in lp.top] == pytest.approx([v for _, v in ref.top], abs=1e-5)


@pytest.mark.parametrize("options", [dict(kv_cache_dtype="kvquant", kv_quant_bits=4),
                                     dict(kv_cache_dtype="kivi", kv_quant_bits=2)])
def test_quantized_decode_through_graphs_equals_eager(tiny_llama, options):
    """The kvquant and kivi stores' decode steps replayed from graphs (their Triton writes and
    decode over static, padded plans): the eager engine's greedy tokens, under preemption too;
    and a graph step synchronises once (the sampled tokens), its write plan copied without a
    wait."""
    prompts, lengths = workload(4, 5, 40)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    got, eager = {}, {}
    for blocks in (8, None):  # a preemption (1 on a CPU), then room for all
        llm = engine(tiny_llama, enforce_eager=False, num_kv_blocks=blocks, **options)
        graphs = graphs_of(llm)
        got[blocks] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        reference = engine(tiny_llama, enforce_eager=True, num_kv_blocks=blocks, **options)
        eager[blocks] = [o.token_ids for o in reference.generate(prompts, params,
                                                                 use_tqdm=False)]
        assert graphs.num_graph_steps > 0 and graphs.padded_rows > 0
        assert (llm.engine.scheduler.num_preemptions > 0) == (blocks is not None)
        llm.engine.check_invariants()
    assert got == eager
    eng = llm.engine  # room for all: after the prefill every step is a decode through a graph
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    before = graphs.num_graph_steps
    while graphs.num_graph_steps < before + 2:
        eng.step()
    syncs = synchronisations_of_one_step(eng)
    assert graphs.num_graph_steps == before + 3
    assert len(syncs) <= 1, syncs
