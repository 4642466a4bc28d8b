"""Greedy outputs and logits against Hugging Face transformers (float32), under prefix caching,
chunked prefill, forced preemption and different block sizes."""

import random

import pytest
import torch

import nanokv.layers.native_attention as native_attention
from nanokv import LLM, SamplingParams
from tiny_models import VOCAB, hf_greedy, load_hf

MAX_NEW = 12
_HF_CACHE: dict = {}


def make_prompts(shared_prefix: bool, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 17, 40, 33, 64, 25]
    prompts = [[rng.randrange(2, VOCAB - 10) for _ in range(n)] for n in lengths]
    if shared_prefix:
        prefix = [rng.randrange(2, VOCAB - 10) for _ in range(37)]
        prompts = [prefix + p for p in prompts]
    return prompts


def reference(model_dir: str, prompts: list[list[int]]):
    results = []
    hf = None
    for p in prompts:
        key = (model_dir, tuple(p))
        if key not in _HF_CACHE:
            hf = hf or load_hf(model_dir)
            _HF_CACHE[key] = hf_greedy(hf, p, MAX_NEW)
        results.append(_HF_CACHE[key])
    return results


class LogitRecorder:
    """Wraps the engine's sampler to keep each request's logits row per output index."""

    def __init__(self, engine) -> None:
        self.sampler = engine.runner.sampler
        self.rows: list[tuple[int, torch.Tensor]] = []
        engine.runner.sampler = self

    def sample(self, logits, params, output_indices, *args, **kwargs):
        for row, idx in enumerate(output_indices):
            self.rows.append((idx, logits[row].cpu()))  # the engine's device may be CUDA
        return self.sampler.sample(logits, params, output_indices, *args, **kwargs)


SCENARIOS = {
    "plain": dict(block_size=16),
    "prefix_cache": dict(block_size=16),
    "chunked_prefill": dict(block_size=16, max_num_batched_tokens=9),
    "preemption": dict(block_size=16, num_kv_blocks=9, max_model_len=128),
    "block_size_256": dict(block_size=256),
    # the dense layers' PyTorch ops (the path off CPU): plain F.linear, norms, RoPE, SiLU
    "torch_dense_layers": dict(block_size=16, linear_backend="torch"),
    # decode attention on the PyTorch reference path (the others use the C kernel on CPU)
    "torch_attention": dict(block_size=16, attention_backend="torch"),
    "torch_attention_preemption": dict(block_size=16, num_kv_blocks=9, max_model_len=128,
                                       attention_backend="torch"),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_hf(tiny_model, scenario):
    prompts = make_prompts(shared_prefix=scenario == "prefix_cache")
    expected = reference(tiny_model, prompts)
    options = {"max_model_len": 256, **SCENARIOS[scenario]}
    llm = LLM(tiny_model, **options)
    # on CPU the default decode path is the C kernel: it must have built here (needs `cc`);
    # elsewhere auto picks the device's own backend
    if llm.engine.device.type == "cpu":
        assert (llm.engine.attention_backend.name == "native") == (
            options.get("attention_backend") != "torch"), native_attention._error
    recorder = LogitRecorder(llm.engine)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    if scenario == "prefix_cache":
        # first batch: all prompts at once (shared prefix in the same step), then again (hits)
        outs = llm.generate(prompts, params)
        assert all(o.num_cached_tokens > 0 for o in outs[1:])
        outs = llm.generate(prompts, params)
        assert all(o.num_cached_tokens >= 32 for o in outs)
    else:
        outs = llm.generate(prompts, params)
    for out, (tokens, _) in zip(outs, expected):
        assert out.token_ids == tokens
        assert out.finish_reason == "length"
    engine = llm.engine
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if "preemption" in scenario:
        assert engine.scheduler.num_preemptions > 0
    # every recorded logits row matches HF's for that output index of some prompt
    hf_rows = [logits for _, logits in expected]
    for idx, row in recorder.rows:
        best = min(float((row - h[idx]).abs().max()) for h in hf_rows if idx < len(h))
        assert best < 2e-4, f"logits at output {idx} differ from HF by {best}"


def test_logits_per_step_single_request(tiny_model):
    prompt = make_prompts(False, seed=3)[4]
    tokens, hf_logits = reference(tiny_model, [prompt])[0]
    llm = LLM(tiny_model, block_size=16, max_model_len=256)
    recorder = LogitRecorder(llm.engine)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                ignore_eos=True))[0]
    assert out.token_ids == tokens
    ours = torch.stack([row for _, row in sorted(recorder.rows, key=lambda r: r[0])])
    torch.testing.assert_close(ours, hf_logits, atol=1e-4, rtol=1e-4)


def test_text_prompt_matches_hf_on_tokenized_input(tiny_llama):
    llm = LLM(tiny_llama, block_size=16, max_model_len=256)
    prompt = "def add(a, b):\n    return"
    ids = llm.tokenizer.encode(prompt)
    tokens, _ = reference(tiny_llama, [ids])[0]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                              ignore_eos=True))[0]
    assert out.prompt_token_ids == ids
    assert out.token_ids == tokens
    assert out.text == llm.tokenizer.decode(tokens, skip_special_tokens=True)


def test_prompt_logits_match_hf_forward(tiny_model):
    prompt = make_prompts(False, seed=5)[4]
    hf = load_hf(tiny_model)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()  # [n, vocab]
    llm = LLM(tiny_model, block_size=16, max_model_len=256, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=1, return_prompt_logits=True)
    llm.generate([prompt[:40]], SamplingParams(temperature=0, max_tokens=1))  # cache a prefix
    out = llm.generate([prompt], params)[0]
    assert out.num_cached_tokens == 0  # prompt logits need the whole prompt computed
    assert out.prompt_logits.shape == expected.shape
    torch.testing.assert_close(out.prompt_logits, expected, atol=1e-4, rtol=1e-4)
