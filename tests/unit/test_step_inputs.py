"""The step's inputs built with arrays against the per-token list construction they replace."""

from __future__ import annotations

import random

import pytest
import torch

from nanokv.sampling_params import SamplingParams
from nanokv.scheduler.output import ScheduledRequest
from nanokv.utils import cdiv
from nanokv.worker.step_inputs import build_step_inputs, common_reference

BS, POOL, LAYERS = 16, 64, 3


def random_step(seed: int, per_layer: bool = False) -> list[ScheduledRequest]:
    """Decodes first (some with speculative drafts, across block ends, some short chunks as
    decode rows), then prefill chunks;
    slots differ from positions (evicted caches), tables longer than needed (the runner trims
    them)."""
    rng = random.Random(seed)
    out = []
    for i in range(rng.randrange(1, 9)):
        decode = i < 3 and rng.random() < 0.8 and (not out or out[-1].is_decode)
        drafts = [rng.randrange(500) for _ in range(rng.choice([0, 0, 2, 5, 20]))] \
            if decode and not per_layer else []
        rows = decode and not drafts and rng.random() < 0.3  # a short chunk as decode rows
        n = rng.randrange(2, 9) if rows else 1 + len(drafts) if decode else rng.randrange(1, 40)
        first = rng.randrange(1, 100) if decode else rng.choice([0, rng.randrange(0, 60)])
        table = rng.sample(range(POOL), cdiv(first + n, BS) + rng.randrange(3))
        s = ScheduledRequest(f"r{i}", [rng.randrange(500) for _ in range(n - len(drafts))]
                             + drafts, first + rng.randrange(0, 30), first, table,
                             sample=rng.random() < .7 or bool(drafts), params=SamplingParams(),
                             output_index=0, capture_from=rng.choice([None, first + n // 2]),
                             draft_token_ids=drafts, decode_rows=rows)
        if per_layer and rng.random() < 0.5:
            firsts = [max(0, first - rng.randrange(0, 20)) if layer else first
                      for layer in range(LAYERS)]
            s.layer_start_slots = firsts
            s.layer_tables = [[layer * POOL + b
                               for b in rng.sample(range(POOL), cdiv(f + n, BS))]
                              for layer, f in enumerate(firsts)]
        out.append(s)
    out.sort(key=lambda s: not s.is_decode)
    return out


def assert_same_common(got, want) -> None:
    assert got.slot_mapping == want.slot_mapping
    assert got.num_decode_tokens == want.num_decode_tokens
    assert got.decode_block_tables == want.decode_block_tables
    assert got.decode_context_lens == want.decode_context_lens
    assert got.prefills == want.prefills


@pytest.mark.parametrize("seed", range(20))
def test_arrays_equal_the_per_token_lists(seed):
    scheduled = random_step(seed)
    inputs = build_step_inputs(scheduled, BS, POOL, LAYERS, torch.device("cpu"))
    want = common_reference(scheduled, BS, POOL, None)
    assert_same_common(inputs.common, want)
    assert inputs.slots.tolist() == want.slot_mapping
    assert inputs.input_ids.tolist() == [t for s in scheduled for t in s.token_ids]
    assert inputs.positions.tolist() == [p for s in scheduled for p in
                                         range(s.start_position, s.start_position + s.num_tokens)]
    ends = list(torch.tensor([s.num_tokens for s in scheduled]).cumsum(0).tolist())
    assert inputs.sample_rows == [r for e, s in zip(ends, scheduled) if s.sample
                                  for r in range(e - 1 - len(s.draft_token_ids), e)]
    # a decode entry per decode row, drafts included
    assert inputs.common.num_decode_tokens == sum(s.num_tokens for s in scheduled
                                                  if s.is_decode)
    rows = [] if inputs.capture_rows is None else inputs.capture_rows.tolist()
    want_rows = []
    start = 0
    for s in scheduled:
        if s.capture_from is not None:
            want_rows += [start + j for j in range(s.num_tokens)
                          if s.start_position + j >= s.capture_from]
        start += s.num_tokens
    assert rows == want_rows


@pytest.mark.parametrize("seed", range(10))
def test_per_layer_tables_equal_the_per_token_lists(seed):
    scheduled = random_step(seed, per_layer=True)
    if all(s.layer_tables is None for s in scheduled):
        scheduled[-1].layer_tables = [[layer * POOL + b for b in scheduled[-1].block_table]
                                      for layer in range(LAYERS)]
        scheduled[-1].layer_start_slots = [scheduled[-1].start_slot] * LAYERS
    inputs = build_step_inputs(scheduled, BS, POOL, LAYERS, torch.device("cpu"))
    for layer in range(LAYERS):
        assert_same_common(inputs.common.per_layer[layer],
                           common_reference(scheduled, BS, POOL, layer))
    layer0 = common_reference(scheduled, BS, POOL, 0).slot_mapping
    assert inputs.common.slot_mapping == [s % (POOL * BS) for s in layer0]
    assert inputs.slots.tolist() == inputs.common.slot_mapping


def test_a_token_and_its_drafts_decode_each_over_the_slots_up_to_its_own():
    """Speculative decoding: a request's token at slot 14 and 4 drafts (slots 15-18, across a
    block end) are 5 decode entries of contexts 15-19, each table the blocks it reads."""
    s = ScheduledRequest("d", [7, 1, 2, 3, 4], 30, 14, [9, 4, 11], True, SamplingParams(), 3,
                         draft_token_ids=[1, 2, 3, 4])
    plain = ScheduledRequest("e", [8], 5, 5, [2], True, SamplingParams(), 0)
    assert s.is_decode and plain.is_decode
    c = build_step_inputs([s, plain], BS, POOL, LAYERS, torch.device("cpu")).common
    assert c.num_decode_tokens == 6 and not c.prefills
    assert build_step_inputs([s, plain], BS, POOL, LAYERS, torch.device("cpu")).has_row_groups
    assert not build_step_inputs([plain], BS, POOL, LAYERS, torch.device("cpu")).has_row_groups
    assert c.decode_context_lens == [15, 16, 17, 18, 19, 6]
    assert c.decode_block_tables == [[9], [9], [9, 4], [9, 4], [9, 4], [2]]
    assert c.slot_mapping == [9 * BS + 14, 9 * BS + 15, 4 * BS, 4 * BS + 1, 4 * BS + 2, 2 * BS + 5]


def test_a_short_chunks_decode_rows_sample_at_its_last_row_alone():
    """A prefill chunk of 3 tokens at slots 30-32 after a cached past, as decode rows: 3 decode
    entries of contexts 31-33 (across a block end), the last row alone sampling; the step has
    row groups (the CUDA graphs leave it to the eager path)."""
    s = ScheduledRequest("c", [7, 8, 9], 40, 30, [9, 4, 11], True, SamplingParams(), 0,
                         decode_rows=True)
    plain = ScheduledRequest("e", [8], 5, 5, [2], True, SamplingParams(), 0)
    inputs = build_step_inputs([s, plain], BS, POOL, LAYERS, torch.device("cpu"))
    c = inputs.common
    assert s.is_decode and c.num_decode_tokens == 4 and not c.prefills
    assert c.decode_context_lens == [31, 32, 33, 6]
    assert c.decode_block_tables == [[9, 4], [9, 4], [9, 4, 11], [2]]
    assert inputs.sample_rows == [2, 3] and inputs.has_row_groups
    prefill = ScheduledRequest("p", [7, 8, 9], 0, 0, [9], True, SamplingParams(), 0,
                               decode_rows=True)  # no cached past: a prefill after all
    assert not prefill.is_decode


def test_decodes_must_come_first():
    prefill = ScheduledRequest("p", [1, 2], 0, 0, [5], True, SamplingParams(), 0)
    decode = ScheduledRequest("d", [3], 7, 7, [6], True, SamplingParams(), 0)
    with pytest.raises(RuntimeError, match="decodes must come first"):
        build_step_inputs([prefill, decode], BS, POOL, LAYERS,
                          torch.device("cpu"))
