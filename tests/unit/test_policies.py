"""KV policies: registry and config, and each scorer's scores and kept set against slow dense
references (python loops) and hand-made tensors whose answer is known."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanokv.policies import (KVPolicy, LayerKV, PolicyConfig, available_policies, make_policy,
                             pyramid_budgets, register_policy, validate_kept, window_attention)
from nanokv.policies.scoring import gqa_mean, select_with_protected, top_k_indices
import itertools


def kv_of(n, hkv=2, d=4, attention=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return LayerKV(torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g),
                   torch.arange(n), attention)


def random_attention(n, w, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(w, hq, d, generator=g)
    k = torch.randn(n, hkv, d, generator=g)
    return k, window_attention(q, k, d ** -0.5)  # keys [n, Hkv, D], attention [Hq, W, n]


def attention_from_rows(rows):
    """rows: [Hq][W][n] nested lists -> [Hq, W, n] tensor."""
    return torch.tensor(rows, dtype=torch.float32)


# ---- slow references -----------------------------------------------------------------------------
def ref_topk_with_protected(scores, budget, protected):
    """scores: list of floats; protected: set. Best first, ties to the older slot; ascending."""
    free = [i for i in range(len(scores)) if i not in protected]
    free.sort(key=lambda i: (-scores[i], i))
    return sorted(list(protected) + free[:budget - len(protected)])


def ref_snapkv_scores(attn, kernel, pooling):
    """[Hq, W, n] -> list per head of pooled prefix scores (python loops)."""
    hq, w, n = attn.shape
    out = []
    for h in range(hq):
        raw = [sum(float(attn[h, j, i]) for j in range(w)) for i in range(n - w)]
        pooled = []
        for i in range(n - w):
            window = [raw[i + o] if 0 <= i + o < n - w else None
                      for o in range(-(kernel // 2), kernel // 2 + 1)]
            if pooling == "avg":
                pooled.append(sum(x for x in window if x is not None) / kernel)
            else:
                pooled.append(max(x for x in window if x is not None))
        out.append(pooled)
    return out


# ---- registry and config -------------------------------------------------------------------------
def test_registry_lists_builtin_policies_and_rejects_unknown_names_and_options():
    assert set(available_policies()) >= {"streaming", "h2o", "snapkv", "pyramidkv", "knorm",
                                         "paged_eviction", "kvcrush"}
    with pytest.raises(ValueError, match="available"):
        make_policy("nope", budget=8)
    with pytest.raises(ValueError, match="allowed"):
        make_policy("snapkv", budget=64, windw=8)


@pytest.mark.parametrize("name, options, match", [
    ("snapkv", {"budget": 64, "pooling": "mean"}, "pooling"),
    ("snapkv", {"budget": 64, "kernel_size": 4}, "odd"),
    ("snapkv", {"budget": 8, "window": 32}, "below"),
    ("snapkv", {"budget": 0}, "budget"),
    ("snapkv", {}, "needs budget"),
    ("snapkv", {"budget": 64, "compression_ratio": 0.5}, "not both"),
    ("snapkv", {"compression_ratio": 1.0}, r"\[0, 1\)"),
    ("h2o", {"budget": 64, "recent_fraction": 1.5}, "recent_fraction"),
    ("streaming", {"budget": 64, "n_sink": -1}, "n_sink"),
    ("streaming", {"budget": 64, "slide": "tokens"}, r"slide must be one of \['token', 'block'\]"),
    ("pyramidkv", {"budget": 64, "beta": 0.5}, "beta"),
    ("paged_eviction", {"budget": 64}, "block_size"),
    ("paged_eviction", {"budget": 64, "block_size": 16, "score": "l2"}, "score"),
    ("paged_eviction", {"budget": 64, "block_size": 16, "eviction_ratio": 2}, "eviction_ratio"),
    ("kvcrush", {"budget": 64, "kvcrush_ratio": 1.0}, "kvcrush_ratio"),
    ("kvcrush", {"budget": 64, "anchor": "zeros"}, "anchor"),
    ("kvcrush", {"budget": 64, "base": "streaming"}, "scored base"),
    ("kvcrush", {"budget": 64, "base": "h2o", "kvcrush_ratio": 0.5,
                 "base_options": {"recent_fraction": 0.8}}, "protected slots"),
])
def test_bad_options_raise_value_error_naming_what_is_allowed(name, options, match):
    with pytest.raises(ValueError, match=match):
        make_policy(name, **options)


def test_register_policy_rejects_a_second_class_under_a_taken_name():
    class Other(KVPolicy):
        def _select(self, kv, budget):
            return torch.arange(budget)

    with pytest.raises(ValueError, match="already registered"):
        register_policy("snapkv")(Other)


def test_policy_config_validates_and_builds():
    cfg = PolicyConfig("snapkv", compression_ratio=0.75, options={"window": 4})
    policy = cfg.build()
    assert policy.window == 4 and policy.resolve_budget(100) == 25
    assert policy.resolve_budget(10) == 4  # never below the window it always keeps
    assert policy.resolve_budget(3) == 3  # nor above the sequence
    assert PolicyConfig("paged_eviction", budget=64).build(block_size=16).block_size == 16
    with pytest.raises(ValueError, match="available"):
        PolicyConfig("nope", budget=4)
    with pytest.raises(ValueError, match="allowed"):
        PolicyConfig("snapkv", budget=64, options={"kernel": 3})
    with pytest.raises(ValueError, match="not options"):
        PolicyConfig("snapkv", budget=64, options={"budget": 3})
    with pytest.raises(ValueError, match="not both"):
        PolicyConfig("snapkv", budget=64, compression_ratio=0.5)


# ---- helpers -------------------------------------------------------------------------------------
def test_top_k_ties_go_to_the_older_slot_and_output_is_ascending():
    assert top_k_indices(torch.tensor([1.0, 3.0, 3.0, 0.0, 3.0]), 2).tolist() == [1, 2]
    assert top_k_indices(torch.tensor([[5.0, 1.0, 4.0], [0.0, 2.0, 1.0]]), 2).tolist() == \
        [[0, 2], [1, 2]]


def test_gqa_mean_averages_each_group_of_query_heads():
    s = torch.tensor([[1.0], [3.0], [10.0], [20.0]])  # [Hq=4, n=1]
    assert gqa_mean(s, 2).tolist() == [[2.0], [15.0]]


def test_protected_slots_always_kept_even_with_the_worst_scores():
    scores = torch.tensor([-5.0, 9.0, 8.0, 7.0, float("inf"), -9.0])
    protected = torch.tensor([True, False, False, False, False, True])
    assert select_with_protected(scores, 3, protected).tolist() == [0, 4, 5]
    with pytest.raises(ValueError, match="exceed the budget"):
        select_with_protected(scores, 1, protected)


# ---- StreamingLLM --------------------------------------------------------------------------------
def test_streaming_keeps_sinks_and_the_newest_tokens():
    p = make_policy("streaming", budget=6)
    assert p.select(kv_of(10), 6).tolist() == [0, 1, 2, 3, 8, 9]
    assert make_policy("streaming", budget=3, n_sink=1).select(kv_of(10), 3).tolist() == [0, 8, 9]
    assert p.should_evict_on_decode(12, 6) is False  # no block size given: never


@pytest.mark.parametrize("n_sink,first", [(0, 0), (4, 1), (16, 1), (17, 2)])
def test_streaming_block_slide_frees_the_oldest_block_after_the_sinks(n_sink, first):
    """slide="block": the oldest block after those holding the sinks, only when the newest block
    just filled and one block can go; never the newest block; no scores read."""
    p = make_policy("streaming", budget=48, block_size=16, n_sink=n_sink, slide="block")
    assert p.decode_mode == "evict_block" and not p.needs_block_scores
    assert make_policy("streaming", budget=48).decode_mode == "reselect"  # the default
    assert p.block_to_evict(None, 80, 48) == first  # 5 blocks, 64 >= 48 after one goes
    assert p.block_to_evict(None, 79, 48) is None  # the newest block is not full
    assert p.block_to_evict(None, 64, 64) is None  # losing a block would go under budget
    assert p.block_to_evict(None, 16 * (first + 1), 0) is None  # only sinks and the newest


# ---- H2O -----------------------------------------------------------------------------------------
def test_h2o_accumulates_attention_and_splits_heavy_and_recent():
    attn = attention_from_rows([[[0.5, 0.1, 0.1, 0.2, 0.1, 0.0],
                                 [0.4, 0.0, 0.3, 0.1, 0.1, 0.1]]])  # Hq=1, W=2, n=6
    kv = LayerKV(torch.ones(6, 1, 2), torch.ones(6, 1, 2), attention=attn)
    p = make_policy("h2o", budget=4)
    assert torch.allclose(p.head_scores(kv), torch.tensor([[0.9, 0.1, 0.4, 0.3, 0.2, 0.1]]))
    assert p.select(kv, 4).tolist() == [[0, 2, 4, 5]]  # heavy 0, 2 + recent 4, 5


def test_h2o_normalisation_by_observing_queries_removes_the_early_token_bias():
    attn = attention_from_rows([[[1.0, 0.0, 0.0, 0.0],
                                 [0.5, 0.5, 0.0, 0.0],
                                 [0.2, 0.1, 0.7, 0.0],
                                 [0.1, 0.1, 0.3, 0.5]]])  # full causal prompt, n = W = 4
    kv = LayerKV(torch.ones(4, 1, 2), torch.ones(4, 1, 2), attention=attn)
    plain = make_policy("h2o", budget=2, per_head=False)
    normed = make_policy("h2o", budget=2, per_head=False, normalize=True)
    assert torch.allclose(normed.head_scores(kv), torch.tensor([[1.8 / 4, 0.7 / 3, 1.0 / 2, 0.5]]))
    assert plain.select(kv, 2).tolist() == [0, 3]
    assert normed.select(kv, 2).tolist() == [2, 3]


def test_h2o_matches_a_loop_reference_with_gqa_per_head():
    keys, attn = random_attention(n=20, w=20, hq=4, hkv=2)
    kv = LayerKV(keys, keys.clone(), attention=attn)
    p = make_policy("h2o", budget=8, recent_fraction=0.25, n_sink=1)
    kept = p.select(kv, 8)
    for kvh in range(2):
        scores = [sum(float(attn[h, t, i]) for h in (2 * kvh, 2 * kvh + 1) for t in range(20)) / 2
                  for i in range(20)]
        assert kept[kvh].tolist() == ref_topk_with_protected(scores, 8, {0, 18, 19})


# ---- SnapKV --------------------------------------------------------------------------------------
HAND_ROW = [0.06, 0.40, 0.02, 0.05, 0.30, 0.00, 0.04, 0.13]  # W=1 window query over n=8 slots


@pytest.mark.parametrize("kernel, pooling, expected", [
    (1, "avg", [1, 4, 7]),   # raw scores: 0.40 and 0.30
    (3, "avg", [1, 2, 7]),   # (0.06+0.40+0.02)/3 and (0.40+0.02+0.05)/3 win
    (3, "max", [0, 1, 7]),   # max pool: slots 0, 1, 2 tie at 0.40 -> the two oldest
])
def test_snapkv_hand_made_window(kernel, pooling, expected):
    attn = attention_from_rows([[HAND_ROW]])
    kv = LayerKV(torch.ones(8, 1, 2), torch.ones(8, 1, 2), attention=attn)
    p = make_policy("snapkv", budget=3, window=1, kernel_size=kernel, pooling=pooling)
    assert p.select(kv, 3).tolist() == [expected]


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_snapkv_scores_and_selection_match_the_loop_reference(pooling):
    n, w, budget = 30, 6, 14
    keys, attn = random_attention(n, w, hq=4, hkv=2, seed=3)
    kv = LayerKV(keys, keys.clone(), attention=attn)
    p = make_policy("snapkv", budget=budget, window=w, kernel_size=5, pooling=pooling)
    ref = ref_snapkv_scores(attn, 5, pooling)
    got = p.head_scores(kv)
    assert torch.allclose(got[:, :n - w], torch.tensor(ref), atol=1e-6)
    kept = p.select(kv, budget)
    for kvh in range(2):
        group = [(ref[2 * kvh][i] + ref[2 * kvh + 1][i]) / 2 for i in range(n - w)]
        scores = group + [math.inf] * w
        assert kept[kvh].tolist() == ref_topk_with_protected(scores, budget, set(range(n - w, n)))
    shared = make_policy("snapkv", budget=budget, window=w, pooling=pooling, per_head=False)
    mean = [sum(ref[h][i] for h in range(4)) / 4 for i in range(n - w)] + [math.inf] * w
    assert shared.select(kv, budget).tolist() == ref_topk_with_protected(
        mean, budget, set(range(n - w, n)))


def test_snapkv_rejects_a_window_of_the_wrong_size():
    keys, attn = random_attention(20, 4)
    with pytest.raises(ValueError, match="last 8 queries"):
        make_policy("snapkv", budget=10, window=8).select(LayerKV(keys, keys, attention=attn), 10)
    with pytest.raises(ValueError, match="window attention"):
        make_policy("snapkv", budget=10, window=8).select(LayerKV(keys, keys), 10)


# ---- PyramidKV -----------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(budget=st.integers(1, 4000), layers=st.integers(1, 40), beta=st.floats(1, 50),
       reserved=st.integers(0, 64))
def test_pyramid_budgets_are_monotone_and_average_to_the_budget(budget, layers, beta, reserved):
    budget = max(budget, reserved)
    b = pyramid_budgets(budget, layers, beta, reserved)
    assert len(b) == layers and sum(b) == layers * budget
    assert all(x >= y for x, y in itertools.pairwise(b))
    assert min(b) >= reserved
    if layers > 1:  # each within one token of the paper's real-valued formula
        kbar = budget - reserved
        lo, hi = kbar / beta, 2 * kbar - kbar / beta
        for layer, x in enumerate(b):
            assert abs(x - reserved - (hi - layer * (hi - lo) / (layers - 1))) < 1 + 1e-6


def test_pyramid_budgets_hand_made():
    # kbar 100, beta 20: min 5, max 195, L 3 -> 195, 100, 5
    assert pyramid_budgets(100, 3, beta=20) == [195, 100, 5]
    assert pyramid_budgets(132, 3, beta=20, reserved=32) == [227, 132, 37]
    assert pyramid_budgets(50, 1) == [50]
    assert pyramid_budgets(100, 4, beta=1) == [100] * 4


def test_pyramidkv_layer_budgets_and_selection():
    p = make_policy("pyramidkv", budget=40, window=8)
    budgets = p.layer_budgets(400, 4)
    assert sum(budgets) == 4 * 40 and budgets[0] > budgets[-1] and min(budgets) >= 8
    keys, attn = random_attention(400, 8, seed=1)
    kv = LayerKV(keys, keys.clone(), attention=attn)
    for b in budgets:
        kept = p.select(kv, b)
        assert validate_kept(kept, 400, 2) == b
        # same scores as SnapKV at that budget
        assert torch.equal(kept, make_policy("snapkv", budget=b, window=8).select(kv, b))
    assert p.layer_budgets(30, 4) == [30] * 4  # budget >= sequence: keep everything


# ---- key norm ------------------------------------------------------------------------------------
def test_knorm_keeps_the_lowest_norm_keys_per_head_or_shared():
    norms = torch.tensor([[3.0, 1.0], [1.0, 2.0], [2.0, 3.0], [5.0, 4.0], [0.5, 5.0]])  # [n, Hkv]
    keys = torch.stack([norms, torch.zeros_like(norms)], dim=-1)  # [n, Hkv, 2]
    kv = LayerKV(keys, torch.ones_like(keys))
    assert make_policy("knorm", budget=2).select(kv, 2).tolist() == [[1, 4], [0, 1]]
    # mean norms 2, 1.5, 2.5, 4.5, 2.75
    assert make_policy("knorm", budget=2, per_head=False).select(kv, 2).tolist() == [0, 1]
    assert make_policy("knorm", budget=2, per_head=False, n_sink=1).select(kv, 2).tolist() == \
        [0, 1]
    assert make_policy("knorm", budget=3, n_sink=1).select(kv, 3).tolist() == [[0, 1, 4],
                                                                             [0, 1, 2]]


# ---- every policy --------------------------------------------------------------------------------
ALL = [
    ("streaming", {"n_sink": 2}),
    ("h2o", {}),
    ("snapkv", {"window": 4}),
    ("pyramidkv", {"window": 4}),
    ("knorm", {}),
    ("paged_eviction", {"block_size": 4}),
    ("kvcrush", {"base_options": {"window": 4}}),
    ("kvcrush", {"block_size": 4, "block_granular": True, "base_options": {"window": 4}}),
]


@pytest.mark.parametrize("name, options", ALL)
def test_budget_at_least_the_sequence_keeps_everything(name, options):
    keys, attn = random_attention(12, 4)
    kv = LayerKV(keys, keys.clone(), torch.arange(12), attn)
    p = make_policy(name, budget=12, **options)
    assert p.select(kv, 12).tolist() == list(range(12))
    assert p.select(kv, 50).tolist() == list(range(12))
    assert all(b == 12 for b in p.layer_budgets(12, 3))


@pytest.mark.parametrize("name, options", ALL)
def test_every_policy_honours_the_contract(name, options):
    n, budget = 40, 16
    keys, attn = random_attention(n, 4, seed=7)
    kv = LayerKV(keys, torch.randn_like(keys), torch.arange(n), attn)
    p = make_policy(name, budget=budget, **options)
    for layer_budget in p.layer_budgets(n, 3):
        kept = p.select(kv, layer_budget)
        c = validate_kept(kept, n, 2)
        if options.get("block_granular"):
            assert c <= layer_budget and c % 4 == n % 4  # whole blocks + the newest partial one
        else:
            assert c == layer_budget


@pytest.mark.parametrize("name", ["snapkv", "knorm", "streaming", "h2o"])
def test_compression_ratio_keeps_the_kept_fraction_rounded_down(name):
    """n (1 - r) rounded down, kvpress's rounding (the old n - floor(r n) kept one more whenever
    n (1 - r) is not whole), without float error. Oracle: exact rationals of r as written."""
    from fractions import Fraction

    for n in (50, 90, 100, 180, 197, 357, 411, 600, 2048):
        for r in (0.1, 0.25, 0.29, 0.3, 0.35, 0.5, 0.646, 0.75, 0.9):
            policy = make_policy(name, compression_ratio=r)
            expected = (n * (1 - Fraction(str(r)))).__floor__()
            assert policy.resolve_budget(n) == min(n, max(expected, policy.min_budget)), (n, r)
    assert make_policy("knorm", compression_ratio=0.29).resolve_budget(100) == 71
    assert make_policy("knorm", compression_ratio=0.5).resolve_budget(197) == 98
