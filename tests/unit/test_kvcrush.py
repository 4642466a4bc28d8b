"""KVCrush: signatures, anchors, distances, representatives and the selected set on hand-made
tensors; r = 0 equals the base scorer; the block-granular variant."""

from __future__ import annotations

import pytest
import torch

from nanokv.policies import LayerKV, make_policy, validate_kept, window_attention
from nanokv.policies.knorm import KeyNorm
from nanokv.policies.kvcrush import (hamming_to_anchor, make_anchor, pick_representatives,
                                     top_half_bits)


def kv_with_key_norms(norms):
    """[n, Hkv] key norms -> LayerKV (D = 2). knorm scores are -norm: small norm = important."""
    k = torch.tensor(norms, dtype=torch.float32)
    keys = torch.stack([k, torch.zeros_like(k)], -1)  # [n, Hkv, 2]
    return LayerKV(keys, torch.ones_like(keys))


def crush(budget, **options):
    options.setdefault("base", "knorm")
    options.setdefault("base_options", {"per_head": False})
    options.setdefault("signature_heads", "kv")
    return make_policy("kvcrush", budget=budget, **options)


# ---- building blocks -----------------------------------------------------------------------------
def test_top_half_bits_by_rank_with_ties_to_the_older_slot():
    assert top_half_bits(torch.tensor([[5.0, 1.0, 4.0, 2.0]])).int().tolist() == [[1, 0, 1, 0]]
    assert top_half_bits(torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])).int().tolist() == \
        [[1, 1, 0, 0, 0]]


def test_anchors():
    bits = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 0], [1, 0, 1, 0]], dtype=torch.bool)  # [H=3, m=4]
    assert make_anchor(bits, "alternate", 0).int().tolist() == [0, 1, 0]
    assert make_anchor(bits, "mean", 0).int().tolist() == [1, 0, 0]  # 0.75, 0.25, 0.5 (not > .5)
    a, b = make_anchor(bits, "random", 7), make_anchor(bits, "random", 7)
    assert torch.equal(a, b) and a.shape == (3,)
    many = torch.zeros(64, 1, dtype=torch.bool)
    assert not torch.equal(make_anchor(many, "random", 1), make_anchor(many, "random", 2))
    assert hamming_to_anchor(bits, torch.tensor([True, False, True])).tolist() == [0, 1, 1, 2]


def test_representatives_are_evenly_spaced_along_the_sorted_distances():
    cands = torch.tensor([10, 11, 12, 13, 14, 15])
    dist = torch.tensor([3, 0, 2, 0, 1, 2])
    # sorted (stable): 11, 13, 14, 12, 15, 10; step 6 // 3 = 2 -> positions 0, 2, 4
    assert pick_representatives(cands, dist, 3).tolist() == [11, 14, 15]
    assert pick_representatives(cands, dist, 0).tolist() == []


# ---- token variant on a hand-made cache ----------------------------------------------------------
# head 0 norms 1..8: top half (small norms) = slots 0-3; head 1: slots 1, 3, 5, 7
NORMS = [[1, 8], [2, 1], [3, 7], [4, 2], [5, 6], [6, 3], [7, 5], [8, 4]]
# mean norms 4.5, 1.5, 5, 3, 5.5, 4.5, 6, 6: the base keeps slots 1, 3 (then 0, 5)


def test_signatures_and_selection_with_the_alternate_anchor():
    kv = kv_with_key_norms(NORMS)
    p = crush(4, kvcrush_ratio=0.5, anchor="alternate")
    bits = p.token_signatures(kv, torch.arange(8))
    assert bits.int().tolist() == [[1, 1, 1, 1, 0, 0, 0, 0], [0, 1, 0, 1, 0, 1, 0, 1]]
    # anchor 01: distances of the dropped slots 0, 2, 4, 5, 6, 7 = 2, 2, 1, 0, 1, 0
    # sorted 5, 7, 4, 6, 0, 2; step 3 -> 5, 6
    assert p.select(kv, 4).tolist() == [1, 3, 5, 6]


def test_selection_with_the_mean_anchor():
    kv = kv_with_key_norms(NORMS)
    # both heads' bit means are 0.5 -> anchor 00; distances 1, 1, 0, 1, 0, 1 for 0, 2, 4, 5, 6, 7
    # sorted 4, 6, 0, 2, 5, 7; step 3 -> 4, 2
    assert crush(4, kvcrush_ratio=0.5, anchor="mean").select(kv, 4).tolist() == [1, 2, 3, 4]


def test_ratio_zero_is_exactly_the_base_scorer():
    kv = kv_with_key_norms(NORMS)
    assert crush(4, kvcrush_ratio=0.0).select(kv, 4).tolist() == [0, 1, 3, 5]
    assert torch.equal(crush(4, kvcrush_ratio=0.0).select(kv, 4),
                       make_policy("knorm", budget=4, per_head=False).select(kv, 4))


@pytest.mark.parametrize("base, base_options", [
    ("snapkv", {"window": 4}),
    ("snapkv", {"window": 4, "per_head": False, "n_sink": 2, "pooling": "max"}),
    ("h2o", {"recent_fraction": 0.25, "normalize": True}),
    ("pyramidkv", {"window": 4}),
    ("knorm", {}),
])
def test_ratio_zero_equals_the_base_on_random_attention(base, base_options):
    g = torch.Generator().manual_seed(5)
    n, w = 48, 4
    keys = torch.randn(n, 2, 8, generator=g)
    attn = window_attention(torch.randn(w, 4, 8, generator=g), keys, 8 ** -0.5)
    kv = LayerKV(keys, torch.randn(n, 2, 8, generator=g), attention=attn)
    wrapped = make_policy("kvcrush", budget=20, base=base, base_options=base_options,
                          kvcrush_ratio=0.0)
    plain = make_policy(base, budget=20, **base_options)
    for b in wrapped.layer_budgets(n, 3):
        assert torch.equal(wrapped.select(kv, b), plain.select(kv, b))
    # r > 0 keeps the same count and the base's protected slots, replacing some important ones
    crushed = make_policy("kvcrush", budget=20, base=base, base_options=base_options,
                          kvcrush_ratio=0.25, signature_heads="query" if base != "knorm" else "kv")
    kept, base_kept = crushed.select(kv, 20), plain.select(kv, 20)
    assert validate_kept(kept, n, 2) == 20 and kept.dim() == base_kept.dim()
    protected = torch.nonzero(plain.protected_mask(n, 20)).squeeze(1)
    rows = kept if kept.dim() == 2 else kept[None]
    for row in rows:
        assert torch.isin(protected, row).all()
    assert not torch.equal(kept, base_kept)


def test_per_head_base_gets_per_head_representatives():
    kv = kv_with_key_norms(NORMS)
    p = crush(4, kvcrush_ratio=0.5, anchor="alternate", base_options={"per_head": True})
    kept = p.select(kv, 4)
    # base per head: head 0 keeps 0, 1; head 1 keeps 1, 3. Distances (anchor 01) of slots 0..7:
    # 2, 1, 2, 1, 1, 0, 1, 0. head 0 dropped 2..7 -> sorted 5, 7, 3, 4, 6, 2 -> 5, 4;
    # head 1 dropped 0, 2, 4, 5, 6, 7 -> sorted 5, 7, 4, 6, 0, 2 -> 5, 6
    assert kept.tolist() == [[0, 1, 4, 5], [1, 3, 5, 6]]


def test_signatures_use_query_heads_by_default():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(20, 2, 8, generator=g)
    attn = window_attention(torch.randn(4, 8, 8, generator=g), keys, 8 ** -0.5)  # Hq = 8
    kv = LayerKV(keys, keys, attention=attn)
    p = make_policy("kvcrush", budget=10, base_options={"window": 4})
    assert p.token_signatures(kv, torch.arange(16)).shape == (8, 16)
    assert p.observation_window == 4 and p.needs_attention
    with pytest.raises(ValueError, match="below"):  # 4 window slots / (1 - 0.75) > 10
        make_policy("kvcrush", budget=10, kvcrush_ratio=0.75, base_options={"window": 4})


# ---- block variant -------------------------------------------------------------------------------
# B = 2, n = 10: blocks 0..3 are middle, block 4 (slots 8, 9) is the newest and kept.
BLOCK_NORMS = [[1, 9], [1, 9], [2, 1], [2, 1], [8, 8], [8, 8], [9, 2], [9, 2], [3, 3], [3, 3]]
# head 0 top half of the 8 middle tokens: 0-3; head 1: 2, 3, 6, 7
# majority signatures: b0 (1, 0), b1 (1, 1), b2 (0, 0), b3 (0, 1)
# mean norms 5, 1.5, 8, 5.5 per middle block: the important middle block is b1


def block_crush(anchor, signature="majority"):
    return make_policy("kvcrush", budget=6, block_size=2, block_granular=True, base="knorm",
                       signature_heads="kv", kvcrush_ratio=0.34, anchor=anchor,
                       block_signature=signature)


def test_block_variant_selects_whole_blocks():
    kv = kv_with_key_norms(BLOCK_NORMS)
    # K = (6 - 2) // 2 + 1 = 3 blocks, 1 representative; anchor 01: b0 2, b2 1, b3 0 -> b3
    p = block_crush("alternate")
    assert p.block_signatures(kv, torch.arange(4)).int().tolist() == [[1, 1, 0, 0], [0, 1, 0, 1]]
    assert p.select(kv, 6).tolist() == [2, 3, 6, 7, 8, 9]
    # mean anchor over the middle blocks: 00 -> b2 is closest
    assert block_crush("mean").select(kv, 6).tolist() == [2, 3, 4, 5, 8, 9]
    # OpenVINO signature: B bits per block from the head-averaged ranking: b0 11, b2 00, b3 00;
    # anchor 01: all at distance 1 -> the oldest, b0
    assert block_crush("alternate", "token_bits").select(kv, 6).tolist() == [0, 1, 2, 3, 8, 9]
    # r = 0: the base's best blocks
    r0 = make_policy("kvcrush", budget=6, block_size=2, block_granular=True, base="knorm",
                     kvcrush_ratio=0.0)
    assert r0.select(kv, 6).tolist() == [0, 1, 2, 3, 8, 9]


def test_block_variant_keeps_the_partial_newest_block_and_fits_the_budget():
    kv = kv_with_key_norms(BLOCK_NORMS[:9])  # n = 9: the newest block holds one slot
    kept = block_crush("alternate").select(kv, 6)
    assert kept[-1] == 8 and len(kept) == 5  # K = (6 - 1) // 2 + 1 = 3 blocks = 2 + 2 + 1
    with pytest.raises(ValueError, match="per_head"):
        make_policy("kvcrush", budget=6, block_size=2, block_granular=True,
                    base_options={"per_head": True})
    with pytest.raises(ValueError, match="block_size"):
        make_policy("kvcrush", budget=6, block_granular=True)
    with pytest.raises(ValueError, match="base_options must be a dict"):
        make_policy("kvcrush", budget=32, base="snapkv", base_options=[1])
    with pytest.raises(ValueError, match=r"base_options cannot set \['budget'\]"):
        make_policy("kvcrush", budget=32, base="knorm", base_options={"budget": 10})


@pytest.mark.parametrize("bs,base,base_options,ratio", [
    (4, "knorm", {"n_sink": 1}, 0.25),
    (4, "snapkv", {"window": 3}, 0.25),
    (8, "snapkv", {"window": 8, "n_sink": 2}, 0.5),
    (4, "h2o", {"recent_fraction": 0.25}, 0.25),
    (16, "snapkv", {"window": 8}, 0.25),
    (4, "gapped", {}, 0.25),
])
def test_block_variant_budgets_brute_force(bs, base, base_options, ratio, monkeypatch):
    """Every budget the block variant accepts selects for every longer prompt (brute force over
    prompt lengths); every one it refuses fails for some prompt length or is below the block
    size; min_budget is the smallest accepted; a ratio's budget is raised to one that selects.
    "gapped": a base whose protected slots from the end are not one window (the sink, the
    newest slot and the one 6 slots back)."""
    if base == "gapped":
        def gapped(self, n, budget):
            mask = torch.zeros(n, dtype=torch.bool)
            mask[[0, n - 1, n - 6]] = True
            return mask

        monkeypatch.setattr(KeyNorm, "protected_mask", gapped)
        base = "knorm"
    def make(**kw):
        return make_policy("kvcrush", block_size=bs, block_granular=True, base=base,
                           base_options=dict(base_options), kvcrush_ratio=ratio, anchor="mean",
                           **kw)

    def layer_kv(n, policy):
        window = min(policy.observation_window or n, n)  # the queries the runner would pass
        return LayerKV(torch.randn(n, 1, 4, generator=gen), torch.randn(n, 1, 4, generator=gen),
                       attention=torch.rand(2, window, n, generator=gen))

    def selects_always(budget, policy):
        for n in range(budget + 1, budget + 4 * bs + 12):
            kv = layer_kv(n, policy)
            try:
                kept = policy._select_blocks(kv, budget)  # the selection itself, no pre-checks
            except ValueError:
                return False
            validate_kept(kept, n, budget)
        return True

    gen = torch.Generator().manual_seed(bs)
    accepted = []
    for budget in range(1, 8 * bs):
        try:
            policy = make(budget=budget)
        except ValueError as e:
            assert "block" in str(e) or "budget" in str(e)
            probe = make(budget=None, compression_ratio=0.5)
            assert budget < bs or not selects_always(budget, probe), budget
            continue
        assert selects_always(budget, policy), budget
        accepted.append(budget)
    assert accepted and make(compression_ratio=0.5).min_budget == accepted[0]
    ratio_policy = make(compression_ratio=0.9)
    for n in range(1, 6 * bs):
        budget = ratio_policy.resolve_budget(n)
        assert budget >= min(n, accepted[0])
        if budget < n:
            validate_kept(ratio_policy.select(layer_kv(n, ratio_policy), budget), n, budget)


# ---- against a loop reference on random attention -----------------------------------------------
def ref_kvcrush(sig, imp_rows, protected, budget, ratio, anchor_mode):
    """Plain-python KVCrush: sig [H][n] signature scores, imp_rows [R][n] importance rows."""
    n = len(sig[0])
    num_rep = int(ratio * budget)
    middle = [t for t in range(n) if t not in protected]
    top = [set(sorted(middle, key=lambda t, h=h: (-sig[h][t], t))[:len(middle) // 2])
           for h in range(len(sig))]
    bits = {t: [int(t in top[h]) for h in range(len(sig))] for t in middle}
    if anchor_mode == "alternate":
        anchor = [h % 2 for h in range(len(sig))]
    else:
        anchor = [int(sum(bits[t][h] for t in middle) / len(middle) > 0.5)
                  for h in range(len(sig))]
    dist = {t: sum(b != a for b, a in zip(bits[t], anchor, strict=True)) for t in middle}
    out = []
    for row in imp_rows:
        free = sorted(middle, key=lambda t, row=row: (-row[t], t))
        important = sorted(protected) + free[:budget - num_rep - len(protected)]
        dropped = sorted((t for t in middle if t not in important), key=lambda t: (dist[t], t))
        step = len(dropped) // num_rep
        out.append(sorted(important + [dropped[i * step] for i in range(num_rep)]))
    return out


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("anchor", ["alternate", "mean"])
def test_token_kvcrush_matches_the_loop_reference(per_head, anchor):
    g = torch.Generator().manual_seed(11)
    n, w, budget = 40, 4, 16
    keys = torch.randn(n, 2, 8, generator=g)
    attn = window_attention(torch.randn(w, 4, 8, generator=g), keys, 8 ** -0.5)
    kv = LayerKV(keys, keys, attention=attn)
    p = make_policy("kvcrush", budget=budget, kvcrush_ratio=0.25, anchor=anchor,
                    base_options={"window": w, "per_head": per_head, "n_sink": 2})
    sig = p.base.head_scores(kv).tolist()  # [Hq][n]
    imp = p.base.token_scores(kv)  # [Hkv, n]
    rows = imp.tolist() if per_head else [imp.mean(0).tolist()]
    protected = {0, 1} | set(range(n - w, n))
    want = ref_kvcrush(sig, rows, protected, budget, 0.25, anchor)
    got = p.select(kv, budget)
    assert (got.tolist() if per_head else [got.tolist()]) == want


def test_a_pyramid_layer_too_small_for_representatives_uses_the_base_alone():
    """PyramidKV's top layers may get budgets below what the base's window plus representatives
    need: those layers keep the base's selection (r = 0 there); larger layers still crush."""
    g = torch.Generator().manual_seed(7)
    n = 200
    keys = torch.randn(n, 2, 8, generator=g)
    attn = window_attention(torch.randn(8, 4, 8, generator=g), keys, 8 ** -0.5)
    kv = LayerKV(keys, torch.randn(n, 2, 8, generator=g), attention=attn)
    crushed = make_policy("kvcrush", budget=40, base="pyramidkv", base_options={"window": 8},
                          kvcrush_ratio=0.25)
    plain = make_policy("pyramidkv", budget=40, window=8)
    budgets = crushed.layer_budgets(n, 4)
    assert min(budgets) < crushed.min_budget <= max(budgets)
    for b in budgets:
        kept = crushed.select(kv, b)
        assert validate_kept(kept, n, 2) == b
        if b < crushed.min_budget:
            assert torch.equal(kept, plain.select(kv, b))
    assert not torch.equal(crushed.select(kv, max(budgets)), plain.select(kv, max(budgets)))
