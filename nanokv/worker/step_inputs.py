"""One step's inputs built with array operations and uploaded once.

From the scheduler's output: the flattened input ids and RoPE positions, each new token's flat
cache slot, the step's `CommonAttentionMetadata` (its fields keep their host-list types: every
attention backend reads them) and the rows that sample. Per-token values come from numpy
operations over per-request arrays (positions = arange + each request's offset; slot = its block
table entry * block_size + offset in block), not per-token Python loops; the ids, positions and
slots then travel to the device in one copy that does not wait for the device.

`common_reference` is the per-token list construction this replaces, kept as the test oracle.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from nanokv.attention.common import CommonAttentionMetadata, PrefillChunk
from nanokv.scheduler.output import ScheduledRequest
from nanokv.transfer import upload
from nanokv.utils import cdiv


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64, on the device
    positions: torch.Tensor  # [T] int64, on the device
    slots: torch.Tensor  # [T] int64 on the device: each new token's flat slot (pool slot id)
    common: CommonAttentionMetadata
    sample_rows: list[int]  # rows of the batch whose logits sample (a request's in order)
    capture: list[tuple[str, int, int]]  # (request id, first row, end row) of query capture
    capture_rows: torch.Tensor | None  # [Tc] int64 on the device, or None
    positions_host: np.ndarray | None = None  # [T] int64, the positions before the upload
    # a request has several decode rows (speculative drafts, or a short chunk's decode_rows)
    has_row_groups: bool = False

    @property
    def is_decode_only(self) -> bool:
        c = self.common
        return not c.prefills and c.num_decode_tokens > 0


def build_step_inputs(scheduled: list[ScheduledRequest], block_size: int, num_pool_blocks: int,
                      num_layers: int, device: torch.device) -> StepInputs:
    """The step's inputs; decodes must come first in `scheduled`."""
    n = len(scheduled)
    lens = np.fromiter((s.num_tokens for s in scheduled), dtype=np.int64, count=n)
    query_start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=query_start[1:])
    num_tokens = int(query_start[-1])
    num_decode = sum(1 for s in scheduled if s.is_decode)
    if any(not s.is_decode for s in scheduled[:num_decode]):
        raise RuntimeError("decodes must come first in the batch")
    start_pos = np.fromiter((s.start_position for s in scheduled), dtype=np.int64, count=n)
    host = np.empty((3, num_tokens), dtype=np.int64)  # [ids | positions | slots, T]
    host[0] = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in scheduled),
                          dtype=np.int64, count=num_tokens)
    # each token's offset inside its request's chunk, then its position
    within = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start[:-1], lens)  # [T]
    host[1] = within + np.repeat(start_pos, lens)
    if any(s.layer_tables is not None for s in scheduled):
        per_layer = []
        for layer in range(num_layers):
            common, slots = _common(scheduled, num_decode, lens, query_start, within,
                                    block_size, layer * num_pool_blocks, layer)
            per_layer.append(common)
            if layer == 0:
                # each layer addresses its own slices; the slot positions are kept at layer 0's
                # slot, as a pool slot
                host[2] = slots % (num_pool_blocks * block_size)
        common = CommonAttentionMetadata(host[2].tolist(), per_layer[0].num_decode_tokens, [],
                                         [], [], per_layer=per_layer)
    else:
        common, host[2] = _common(scheduled, num_decode, lens, query_start, within, block_size,
                                  0, None)
    dev = upload(host, device)  # [3, T]: the step's one upload
    # a sampling request's last row, and before it its draft tokens' rows (speculative)
    sample_rows = [row for i, s in enumerate(scheduled) if s.sample
                   for row in range(int(query_start[i + 1]) - 1 - len(s.draft_token_ids),
                                    int(query_start[i + 1]))]
    capture = []
    for i, s in enumerate(scheduled):
        if s.capture_from is not None and s.start_position + s.num_tokens > s.capture_from:
            first = max(0, s.capture_from - s.start_position)
            capture.append((s.request_id, int(query_start[i]) + first, int(query_start[i + 1])))
    capture_rows = None
    if capture:
        capture_rows = upload(np.concatenate([np.arange(a, b) for _, a, b in capture]), device)
    return StepInputs(dev[0], dev[1], dev[2], common, sample_rows, capture, capture_rows,
                      host[1], has_row_groups=int(query_start[num_decode]) != num_decode)


def _common(scheduled: list[ScheduledRequest], num_decode: int, lens: np.ndarray,
            query_start: np.ndarray, within: np.ndarray, block_size: int, offset: int,
            layer: int | None) -> tuple[CommonAttentionMetadata, np.ndarray]:
    """The step's addressing and its slots [T]: shared by all layers (layer None), or layer
    `layer`'s in flat layer-slice ids (a request with per-layer tables uses its own; the others
    their shared table, offset by `offset`)."""
    tables: list[list[int]] = []
    firsts = np.empty(len(scheduled), dtype=np.int64)
    for i, s in enumerate(scheduled):
        if layer is not None and s.layer_tables is not None:
            table, firsts[i] = s.layer_tables[layer], s.layer_start_slots[layer]
        else:
            table, firsts[i] = s.block_table, s.start_slot
            if offset:
                table = [b + offset for b in table]
        tables.append(table[:cdiv(int(firsts[i] + lens[i]), block_size)])
    table_lens = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
    table_start = np.zeros(len(tables), dtype=np.int64)
    np.cumsum(table_lens[:-1], out=table_start[1:])
    flat_tables = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64,
                              count=int(table_lens.sum()))
    slot_in_request = within + np.repeat(firsts, lens)  # [T]
    blocks = flat_tables[np.repeat(table_start, lens) + slot_in_request // block_size]
    slots = blocks * block_size + slot_in_request % block_size  # [T]
    contexts = (firsts + lens).tolist()
    prefills = [PrefillChunk(int(query_start[i]), int(lens[i]), contexts[i], tables[i])
                for i in range(num_decode, len(scheduled))]
    # a decode entry per decode row: a request's token and drafts (speculative decoding) each
    # over the slots up to its own, as it would decode alone
    num_rows = int(query_start[num_decode])
    row_contexts = (slot_in_request[:num_rows] + 1).tolist()
    decode_tables = tables[:num_decode] if num_rows == num_decode else [  # no drafts: one a row
        tables[i][:cdiv(c, block_size)] for i in range(num_decode)
        for c in row_contexts[int(query_start[i]):int(query_start[i + 1])]]
    common = CommonAttentionMetadata(slots.tolist(), len(row_contexts), decode_tables,
                                     row_contexts, prefills)
    return common, slots


def common_reference(scheduled: list[ScheduledRequest], block_size: int, num_pool_blocks: int,
                     layer: int | None) -> CommonAttentionMetadata:
    """The same addressing built token by token in Python lists (the oracle of `_common`)."""
    offset = 0 if layer is None else layer * num_pool_blocks
    slots: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillChunk] = []
    for s in scheduled:
        start, n = len(slots), s.num_tokens
        if layer is not None and s.layer_tables is not None:
            table, first = s.layer_tables[layer], s.layer_start_slots[layer]
        else:
            table, first = s.block_table, s.start_slot
            if offset:
                table = [b + offset for b in table]
        context = first + n
        table = table[:cdiv(context, block_size)]
        slots += [table[j // block_size] * block_size + j % block_size
                  for j in range(first, context)]
        if s.is_decode:  # each row (a token, its drafts) a decode over the slots up to its own
            for j in range(first + 1, context + 1):
                decode_tables.append(table[:cdiv(j, block_size)])
                decode_lens.append(j)
        else:
            prefills.append(PrefillChunk(start, n, context, table))
    return CommonAttentionMetadata(slots, len(decode_lens), decode_tables, decode_lens, prefills)
