"""Weight-only int8 (`quantization="int8"`): the engine against Hugging Face transformers with
every linear weight and the input embedding replaced by their dequantized int8 copies (code *
scale, the same rule computed here: `int8_weights.quantize_rows`), prompt logits and greedy
tokens, for an untied Llama with biases, a tied Qwen3 (its embedding read from the LM head's
codes) and a Qwen3-MoE (its router stays float), through batching, chunked prefill and prefix
hits; a draft model quantized the same way (the model as its own draft: every draft accepted);
what it holds (int8 codes, no float weight, the embedding's lookups from codes); loading a
layer at a time; the refusals."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import build_tiny_model, hf_greedy, load_hf

from nanokv import LLM, SamplingParams
from nanokv.layers import int8_weights, native_linear
from nanokv.layers.linear import Linear
from nanokv.worker import loader
from nanokv.worker.loader import check_quantization

ARCHS = {  # name: (architecture, config flags)
    "llama_biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "qwen3_tied": ("qwen3", dict()),
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1])),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8")
    return {name: build_tiny_model(str(root / name), arch, seed=i, tokenizer=False, **flags)
            for i, (name, (arch, flags)) in enumerate(ARCHS.items())}


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    return int8_weights.dequantize(*int8_weights.quantize_rows(weight))


def hf_dequantized(path: str):
    """HF's model with each linear weight (the LM head's too, untied from the embedding) and the
    input embedding set to its int8 codes times their scales, row by row: nn.Linear weights and
    each expert's slice of a MoE's stacked [experts, out, in] projections; its router (not an
    nn.Linear) left as it is."""
    hf = load_hf(path)
    with torch.no_grad():
        embedding = hf.get_input_embeddings()
        embedding.weight = torch.nn.Parameter(dequantized(embedding.weight))
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight = torch.nn.Parameter(dequantized(module.weight))
            for param in module.parameters(recurse=False):
                if param.dim() == 3:  # [experts, out, in]
                    param.copy_(torch.stack([dequantized(w) for w in param]))
    return hf


def prompts(seed: int, n: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 255) for _ in range(shared)]
    return [prefix + [rng.randrange(1, 255) for _ in range(rng.randrange(5, 120))]
            for _ in range(n)]


@pytest.mark.parametrize("name", list(ARCHS))
def test_logits_and_tokens_equal_hf_over_the_dequantized_weights(models, name):
    path = models[name]
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=256, block_size=16,
              max_num_batched_tokens=48, quantization="int8")
    hf = hf_dequantized(path)
    batch = prompts(len(name), 4, shared=20)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                            return_prompt_logits=True)
    outs = llm.generate(batch, params, use_tqdm=False)
    for prompt, out in zip(batch, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0]  # [n, vocab]
        torch.testing.assert_close(out.prompt_logits, logits, atol=1e-4, rtol=1e-4)
        assert out.token_ids == hf_greedy(hf, prompt, 10)[0]
    # again, over the prefix cache (no prompt logits asked: hits allowed)
    again = llm.generate(batch, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)
    assert [o.token_ids for o in again] == [hf_greedy(hf, p, 10)[0] for p in batch]
    assert llm.engine.stats().prefix_cache_hits > 0
    # int8 matters: the float weights' logits differ
    with torch.no_grad():
        plain = load_hf(path)(torch.tensor([batch[0]])).logits[0]
    assert not torch.allclose(plain, outs[0].prompt_logits, atol=1e-3)


def test_the_layers_hold_int8_codes_only(models):
    model = LLM(models["qwen3_moe"], skip_tokenizer_init=True, max_model_len=64, block_size=16,
                quantization="int8").engine.model
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    routers = {n for n in linears if n.endswith("mlp.gate")}
    assert len(routers) == 2  # the sparse layers 0 and 2
    for name, module in linears.items():
        if name in routers:
            assert module.scale is None and module.weight.dtype == torch.float32
            continue
        assert module.panels.dtype == torch.int8 and module.scale.shape == (module.out_features,)
        assert module.weight.numel() == 0 and module.packed is None
    # the tied embedding's lookups read the LM head's codes: no float [vocab, hidden] matrix
    assert isinstance(model.embed_tokens, int8_weights.Int8Embedding)
    assert model.embed_tokens.panels is model.lm_head.panels
    vocab_matrix = model.config.vocab_size * model.config.hidden_size
    assert sum(p.numel() for p in model.parameters() if p.is_floating_point()) < vocab_matrix


def test_an_untied_embedding_gets_codes_of_its_own(models):
    model = LLM(models["llama_biases"], skip_tokenizer_init=True, max_model_len=64,
                block_size=16, quantization="int8").engine.model
    table, head = model.embed_tokens, model.lm_head
    assert isinstance(table, int8_weights.Int8Embedding) and table.panels is not head.panels
    embedding = load_hf(models["llama_biases"]).get_input_embeddings().weight.detach()
    ids = torch.tensor([0, 1, 31, 32, 33, embedding.shape[0] - 1, 5, 5])
    assert torch.equal(table(ids), dequantized(embedding)[ids])
    assert not torch.equal(table(ids), embedding[ids])  # quantized, not the float rows


def test_a_quantized_draft_model_is_the_quantized_model(models):
    """The model as its own draft: both quantized alike, every draft is accepted and the tokens
    are HF's over the dequantized weights."""
    path = models["qwen3_tied"]
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=256, block_size=16,
              quantization="int8", speculative_config={"model": path,
                                                       "num_speculative_tokens": 3})
    batch = prompts(4, 2)
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    hf = hf_dequantized(path)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 12)[0] for p in batch]
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.mark.parametrize("name", ["llama_4_layers", "qwen3_moe"])
def test_each_weight_is_quantized_as_soon_as_it_is_loaded(models, tmp_path, monkeypatch, name):
    """Loading holds about one layer's float weights at a time, not the model's: each linear
    weight is allocated as its first tensor is read and quantized once its last one (of a
    packed q/k/v or gate/up) is in; the codes and scales are those of the whole float model."""
    path = (build_tiny_model(str(tmp_path / name), "llama", seed=7, tokenizer=False,
                             num_hidden_layers=4) if name == "llama_4_layers" else models[name])
    built, held = [], []  # the model being loaded; float bytes held at each quantization
    original_materialize, original_quantize = loader.materialize, Linear.quantize_int8

    def materialize(*args, **kwargs):
        built.append(original_materialize(*args, **kwargs))
        return built[-1]

    def quantize_int8(self):
        held.append(sum(m.weight.numel() * 4 for m in built[0].modules()
                        if isinstance(m, Linear) and not m.keep_float and m.scale is None
                        and not m.weight.is_meta
                        and m.weight is not getattr(built[0].embed_tokens, "weight", None)))
        original_quantize(self)

    monkeypatch.setattr(loader, "materialize", materialize)
    monkeypatch.setattr(Linear, "quantize_int8", quantize_int8)
    model = loader.load_model(path, skip_tokenizer_init=True, linear_backend="torch",
                              quantization="int8").model
    monkeypatch.undo()
    reference = loader.load_model(path, skip_tokenizer_init=True, linear_backend="torch").model

    def float_bytes(module) -> int:
        return sum(m.weight.numel() * 4 for m in module.modules()
                   if isinstance(m, Linear) and not m.keep_float)

    largest = max(float_bytes(unit) for unit in [*reference.layers, reference.lm_head])
    assert len(held) == len(model.int8_layers()) and max(held) <= largest
    assert max(held) < float_bytes(reference) / 2  # the old way: every layer at once
    float_layers = dict(reference.named_modules())
    for layer_name, layer in model.named_modules():
        if isinstance(layer, Linear) and not layer.keep_float:
            codes, scale = int8_weights.quantize_rows(float_layers[layer_name].weight)
            assert torch.equal(layer.panels, native_linear.panels_of(codes)), layer_name
            assert torch.equal(layer.scale, scale), layer_name


@pytest.mark.parametrize("options,match", [
    (dict(quantization="int4"), r"quantization must be one of \['int8'\], got 'int4'"),
    (dict(quantization="int8", dtype="bfloat16"),
     r"computes in float32 .* dtype must be auto or float32, got 'bfloat16'"),
])
def test_what_int8_weights_do_not_run_with_is_refused(models, options, match):
    with pytest.raises(ValueError, match=match):
        LLM(models["llama_biases"], skip_tokenizer_init=True, max_model_len=64, **options)


def test_int8_weights_run_on_cpu_only():
    with pytest.raises(ValueError, match=r"runs on CPU .* device is cuda"):
        check_quantization("int8", "auto", torch.device("cuda"))
