"""A quantized store's policy view reads one layer at a time, when the policy asks for it, and
`apply_plan` reads only the blocks holding the kept tokens it re-writes: a compaction's transient
memory is one layer of the request, not all of them. The kept tokens read back as the dense
view's (dequantize-everything reference) within the store's second rounding."""

import weakref
from types import SimpleNamespace

import pytest
import torch

from nanokv.cache.kv_cache import KVView
from nanokv.policies.apply import plan_compression
from nanokv.policies.base import PolicyConfig
from quant_stores import fill, make_store

LAYERS, BS, N, BUDGET = 6, 16, 150, 60


class CountingReader:
    """The store's own `read_blocks`, recording each read (layer, block ids) and how many
    earlier reads' key tensors were still alive when it ran."""

    def __init__(self, store) -> None:
        self.store = store
        self.reads: list[tuple[int, list[int]]] = []
        self.alive_at_read: list[int] = []
        self._earlier: list[weakref.ref] = []

    def __call__(self, layer: int, ids: torch.Tensor):
        self.alive_at_read.append(sum(r() is not None for r in self._earlier))
        self.reads.append((layer, ids.tolist()))
        k, v = self.store.read_blocks(layer, ids, self.store.rope)
        self._earlier.append(weakref.ref(k))
        return k, v


def take(x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """x [n, Hkv, D] at kept [C] or per KV head [Hkv, C] -> [C, Hkv, D]."""
    if kept.dim() == 1:
        return x[kept]
    return x[kept, torch.arange(kept.shape[0])[:, None]].transpose(0, 1)


@pytest.mark.parametrize("kind,bound", [("kvquant:4bit", 0.5), ("kivi:4", 0.5), ("int8", 0.03)])
@pytest.mark.parametrize("policy,options", [
    ("knorm", {"per_head": True}), ("knorm", {"per_head": False}), ("streaming", {"n_sink": 4}),
])
def test_a_compaction_reads_one_layer_at_a_time(kind, bound, policy, options):
    store = make_store(kind, 32, BS, num_blocks=24, num_requests=2, num_layers=LAYERS)
    table = fill(store, [N], chunk=37, seed=3)[0]
    request = SimpleNamespace(num_cached_slots=N, block_table=list(table), request_id="r")
    dense = [store.read(layer, table, N, store.rope) for layer in range(LAYERS)]  # [N, Hkv, D]
    reader = CountingReader(store)
    store.use_block_reader(reader)
    view = store.policy_view(request)
    assert reader.reads == []  # nothing read when the view is taken

    policy = PolicyConfig(policy, BUDGET, options=options).build(block_size=BS)
    plan = plan_compression(policy, view.layers,
                            view.block_table, N, budget=BUDGET)
    assert [layer for layer, _ in reader.reads] == list(range(LAYERS))  # each layer once
    assert all(ids == table[:len(ids)] and len(ids) == -(-N // BS) for _, ids in reader.reads)
    # the loop keeps at most the previous layer's copy while it reads the next (a dense view of
    # every layer would have LAYERS - 1 alive at the last read)
    assert max(reader.alive_at_read) <= 1

    del reader.reads[:]
    store.apply_plan(request, plan, view)
    start = plan.first_changed_block * BS
    assert plan.num_evicted > 0 and start < BUDGET
    # only the blocks holding the kept tokens it re-writes, one layer at a time
    expected = [(layer, [table[b] for b in torch.unique(kept[..., start:] // BS).tolist()])
                for layer, kept in enumerate(plan.kept)]
    assert reader.reads == expected
    if policy.name == "streaming":  # sinks and the recent window: not every block
        assert all(len(ids) < -(-N // BS) for _, ids in reader.reads)

    store.use_block_reader(None)
    for layer, kept in enumerate(plan.kept):
        k, v = store.read(layer, table, BUDGET, store.rope)  # [BUDGET, Hkv, D]
        for got, ref in ((k, take(dense[layer][0], kept)), (v, take(dense[layer][1], kept))):
            err = (got - ref).abs().max() / ref.abs().max()
            assert err < bound, (layer, float(err))


def test_layer_reads_index_like_a_sequence():
    store = make_store("int8", 32, BS, num_blocks=8, num_requests=1, num_layers=3)
    table = fill(store, [40], chunk=40, seed=0)[0]
    view = store.policy_view(SimpleNamespace(num_cached_slots=40, block_table=table,
                                             request_id="r"))
    assert len(view.layers) == 3
    torch.testing.assert_close(view.layers[-1][0], view.layers[2][0])
    with pytest.raises(IndexError, match="layer 3 of 3"):
        view.layers[3]
    with pytest.raises(TypeError, match="int"):
        view.layers[0:2]


@pytest.mark.parametrize("kind", ["kvquant:2bit-nuq-thresholds", "kvquant:per-channel-post-rope",
                                  "kivi:2", "int8-pre-rope"])
@pytest.mark.parametrize("policy,options", [
    ("knorm", {"per_head": True}), ("streaming", {"n_sink": 4}),
])
@pytest.mark.parametrize("chunk_blocks,dense", [(1, False), (3, False), (3, True)])
def test_compaction_in_chunks_writes_the_same_bytes(monkeypatch, kind, policy, options,
                                                   chunk_blocks, dense):
    """`apply_plan` in chunks of `chunk_blocks` blocks (each chunk read, then written) leaves
    every buffer of the store as one chunk does, and reads only each chunk's blocks. `dense`:
    the chunked run gets a view of dense copies of every layer (a `KVView` built by hand)."""
    lens = [N, 37]  # a second request's blocks stay untouched
    policy = PolicyConfig(policy, BUDGET, options=options).build(block_size=BS)
    results = []
    for chunk_bytes in (None, chunk_blocks):
        torch.manual_seed(0)  # the same random outlier thresholds in both stores
        store = make_store(kind, 32, BS, num_blocks=24, num_requests=2)
        table = fill(store, lens, chunk=37, seed=5)[0]
        request = SimpleNamespace(num_cached_slots=N, block_table=list(table), request_id="r")
        reader = CountingReader(store)
        store.use_block_reader(reader)
        view = store.policy_view(request)
        plan = plan_compression(policy, view.layers, view.block_table, N, budget=BUDGET)
        if chunk_bytes is not None:  # bytes of chunk_blocks blocks of float K/V, all layers
            lay = store.layout
            per_block = 2 * lay.num_layers * BS * lay.num_kv_heads * lay.head_dim * 4
            monkeypatch.setattr(store, "compaction_chunk_bytes", chunk_bytes * per_block)
            if dense:
                view = KVView(list(view.layers), view.block_table, view.positions,
                              view.request_id)
        del reader.reads[:]
        store.apply_plan(request, plan, view)
        results.append((store, reader.reads, plan))
    (ref, ref_reads, plan), (got, reads, _) = results
    start, step = plan.first_changed_block * BS, chunk_blocks * BS
    assert len(ref_reads) == ref.layout.num_layers  # one chunk
    if not dense:  # chunk by chunk, each layer's read: the blocks holding that chunk's tokens
        assert reads == [(layer, [table[b] for b in torch.unique(kept[..., lo:lo + step] // BS)])
                         for lo in range(start, BUDGET, step)
                         for layer, kept in enumerate(plan.kept)]
        assert len(reads) > len(ref_reads)
    assert ref.buffers.keys() == got.buffers.keys()
    for name in ref.buffers:
        assert torch.equal(ref.buffers[name], got.buffers[name]), name
    assert torch.equal(ref.slot_positions, got.slot_positions)


@pytest.mark.parametrize("kind", ["kvquant:2bit-nuq-thresholds", "kvquant:per-channel-post-rope",
                                  "kivi:2", "int8-pre-rope"])
def test_blocks_kept_whole_are_copied_not_rewritten(kind):
    """A window slide by one block (StreamingLLM's decode step: sinks, then every later slot
    shifted by B): the new blocks after the sinks' block take old blocks whole and are copied,
    every buffer and recorded position equal to the old block's; only the slots of the sinks'
    block are read and re-written, and they read back as the kept tokens."""
    store = make_store(kind, 32, BS, num_blocks=24, num_requests=2)
    n, budget = 5 * BS, 4 * BS
    table = fill(store, [n, 37], chunk=37, seed=9)[0]
    request = SimpleNamespace(num_cached_slots=n, block_table=list(table), request_id="r")
    dense = [store.read(layer, table, n, store.rope) for layer in range(store.layout.num_layers)]
    before = {name: buf.clone() for name, buf in store.buffers.items()}
    positions = store.slot_positions.clone()
    reader = CountingReader(store)
    store.use_block_reader(reader)
    policy = PolicyConfig("streaming", budget, options={"n_sink": 4}).build(block_size=BS)
    view = store.policy_view(request)
    plan = plan_compression(policy, view.layers, view.block_table, n, budget=budget)
    del reader.reads[:]
    store.apply_plan(request, plan, view)
    assert plan.first_changed_block == 0
    # block 0 re-written from old blocks 0 and 1 (sinks, then slots 20..31); 1..3 <- 2..4
    assert reader.reads == [(layer, [table[0], table[1]])
                            for layer in range(store.layout.num_layers)]
    for new, old in ((1, 2), (2, 3), (3, 4)):
        for name, buf in store.buffers.items():
            axis = store._block_axis(name)
            if axis is None:
                continue
            got = buf.select(axis, table[new])
            assert torch.equal(got, before[name].select(axis, table[old])), (name, new)
        assert torch.equal(store.slot_positions[table[new]], positions[table[old]])
    store.use_block_reader(None)
    kept = plan.kept[0]
    for layer, (k_ref, v_ref) in enumerate(dense):
        k, v = store.read(layer, table, budget, store.rope)
        for got, ref in ((k, k_ref[kept]), (v, v_ref[kept])):
            err = (got - ref).abs().max() / ref.abs().max()
            assert err < 0.5, (layer, float(err))
