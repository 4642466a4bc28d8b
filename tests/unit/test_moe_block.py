"""The mixture-of-experts block against its dense formula (every expert on every token,
weighted by a [T, E] routing matrix that is zero off each token's top k), the router against a
per-token brute force, and the configs' expert shapes (`moe_shape`) with the parameter counts
the simulator derives from them against the published sizes of Qwen3-30B-A3B and
Mixtral-8x7B."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nanokv.models.moe import SparseMoeBlock, route
from nanokv.models.moe_shape import MoEShape, mlp_token_width, mlp_widths, moe_shape
from nanokv.sim.step_model import ModelShape


def block(num_experts: int, top_k: int, normalize: bool, shared: int = 0,
          seed: int = 0) -> SparseMoeBlock:
    cfg = SimpleNamespace(hidden_size=24, intermediate_size=40, hidden_act="silu")
    moe = MoEShape(num_experts, top_k, 16, shared, normalize, (True,))
    torch.manual_seed(seed)
    b = SparseMoeBlock(cfg, moe)
    with torch.no_grad():
        for p in b.parameters():
            p.normal_(0, 0.3)
    return b


@pytest.mark.parametrize("num_experts,top_k,normalize,shared", [
    (8, 2, True, 0), (8, 2, False, 0), (6, 1, False, 0), (4, 4, True, 0), (6, 2, False, 32),
    (16, 3, True, 8)])
@pytest.mark.parametrize("num_tokens", [1, 3, 37])
def test_block_equals_its_dense_formula(num_experts, top_k, normalize, shared, num_tokens):
    b = block(num_experts, top_k, normalize, shared, seed=num_tokens)
    x = torch.randn(num_tokens, 24, generator=torch.Generator().manual_seed(num_tokens))
    with torch.no_grad():
        torch.testing.assert_close(b(x), b.reference(x), atol=1e-5, rtol=1e-5)


def test_experts_no_token_picks_are_not_run():
    """One token, top 1 of 8: one expert runs (the others' weights are never read)."""
    b = block(8, 1, False)
    calls = []
    for index, expert in enumerate(b.experts):
        expert.register_forward_hook(lambda m, i, o, index=index: calls.append(index))
    with torch.no_grad():
        b(torch.randn(1, 24))
    assert len(calls) == 1


def test_route_picks_each_tokens_largest_probabilities():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(50, 7, generator=gen)
    for normalize in (False, True):
        weights, experts = route(logits, 3, normalize, torch.float32)
        for t in range(50):
            probs = torch.softmax(logits[t].double(), dim=0)
            best = sorted(range(7), key=lambda e: -probs[e].item())[:3]
            assert experts[t].tolist() == best
            expected = probs[best] / (probs[best].sum() if normalize else 1)
            torch.testing.assert_close(weights[t].double(), expected, atol=1e-6, rtol=1e-6)


QWEN3_30B_A3B = dict(  # Qwen/Qwen3-30B-A3B's config.json (the fields these tests read)
    model_type="qwen3_moe", num_hidden_layers=48, hidden_size=2048, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False)
MIXTRAL_8X7B = dict(  # mistralai/Mixtral-8x7B-v0.1's config.json
    model_type="mixtral", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
    num_key_value_heads=8, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
    vocab_size=32000, tie_word_embeddings=False)


def test_published_total_and_active_parameters():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B activated; Mixtral-8x7B: 46.7B, 12.9B (their
    model cards); the simulator's counts leave out the norms."""
    qwen = ModelShape.from_hf_config(QWEN3_30B_A3B)
    assert qwen.num_params == pytest.approx(30.5e9, rel=0.01)
    active = qwen.matmul_params + qwen.vocab_size * qwen.hidden_size  # + the input embedding
    assert active == pytest.approx(3.3e9, rel=0.02)
    mixtral = ModelShape.from_hf_config(MIXTRAL_8X7B)
    assert mixtral.num_params == pytest.approx(46.7e9, rel=0.01)
    active = mixtral.matmul_params + mixtral.vocab_size * mixtral.hidden_size
    assert active == pytest.approx(12.9e9, rel=0.01)


def test_a_step_reads_the_experts_its_tokens_can_pick():
    qwen = ModelShape.from_hf_config(QWEN3_30B_A3B)
    reads = [qwen.params_read(n) for n in (1, 8, 64, 4096)]
    assert reads == sorted(reads) and reads[-1] == pytest.approx(qwen.num_params)
    expert = 3 * 2048 * 768
    # one token: its 8 experts of each of 48 layers, and none of the other 120
    assert reads[0] == pytest.approx(qwen.num_params - 48 * 120 * expert)
    dense = ModelShape.from_hf_config({**QWEN3_30B_A3B, "model_type": "qwen3",
                                       "num_experts": 0})
    assert dense.params_read(1) == dense.num_params


def test_moe_shapes_of_the_configs():
    qwen = moe_shape({**QWEN3_30B_A3B, "mlp_only_layers": [0, 5], "decoder_sparse_step": 2})
    assert [i for i, s in enumerate(qwen.sparse_layers) if not s][:4] == [0, 2, 4, 5]
    assert sum(qwen.sparse_layers) == 23 and qwen.dense_layers == 25
    assert mlp_widths({**QWEN3_30B_A3B, "decoder_sparse_step": 2}) == [768, 6144]
    assert mlp_widths(QWEN3_30B_A3B) == [768]
    mixtral = moe_shape(MIXTRAL_8X7B)
    assert (mixtral.expert_width, mixtral.top_k, mixtral.normalize) == (14336, 2, True)
    shared = dict(QWEN3_30B_A3B, model_type="qwen2_moe", shared_expert_intermediate_size=5632)
    assert mlp_widths(shared) == [768, 5632]
    assert mlp_token_width(shared) == 8 * 768 + 5632
    assert moe_shape(dict(model_type="llama", num_hidden_layers=2, intermediate_size=8)) is None
    assert mlp_token_width(dict(model_type="llama", intermediate_size=8)) == 8


@pytest.mark.parametrize("field,value,match", [
    ("num_experts_per_tok", 0, r"num_experts_per_tok must be an integer >= 1, got 0"),
    ("num_experts_per_tok", 200, r"num_experts_per_tok 200 is more than the 128 experts"),
    ("decoder_sparse_step", 0, r"decoder_sparse_step must be an integer >= 1, got 0"),
    ("num_experts", 2.5, r"num_experts must be an integer >= 1, got 2.5"),
])
def test_bad_expert_fields_are_refused(field, value, match):
    with pytest.raises(ValueError, match=match):
        moe_shape({**QWEN3_30B_A3B, field: value})


def test_activation_estimate_counts_a_tokens_experts():
    """The KV budget leaves room for a sparse layer's widest activations: a token's top_k
    experts and the shared expert, as wide as a dense MLP of their summed width."""
    from nanokv.engine.kv_cache_plan import estimate_activation_bytes

    common = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100)
    moe = SimpleNamespace(model_type="qwen2_moe", intermediate_size=32, num_experts=8,
                          num_experts_per_tok=3, moe_intermediate_size=40,
                          shared_expert_intermediate_size=24, **common)
    dense = SimpleNamespace(model_type="qwen2", intermediate_size=3 * 40 + 24, **common)
    for tokens in (1, 512):
        assert (estimate_activation_bytes(moe, tokens, 4, torch.float32)
                == estimate_activation_bytes(dense, tokens, 4, torch.float32))


def test_a_saved_config_without_its_defaults_keeps_its_experts(tmp_path):
    """transformers 5 writes only the fields that differ from the config class's defaults: the
    simulator fills them in as transformers does (Qwen3-MoE's 128 experts, 8 a token)."""
    import json

    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(num_hidden_layers=2).save_pretrained(tmp_path)
    assert "num_experts" not in json.loads((tmp_path / "config.json").read_text())
    shape = ModelShape.load(str(tmp_path))
    assert (shape.num_experts, shape.top_k, shape.sparse_layers) == (128, 8, 2)
