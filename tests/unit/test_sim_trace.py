"""Traces: hashes only, chained, keyed; replayed token ids keep exactly the sharing structure;
synthetic generators are deterministic and share what their shape says."""

from __future__ import annotations

import json

import pytest

from nanokv.request import Request, RequestStatus
from nanokv.sampling_params import SamplingParams
from nanokv.sim.synthetic import WorkloadShape, generate
from nanokv.sim.trace import (BlockHasher, TraceRecord, TraceWriter, read_trace,
                              replay_token_ids, write_trace)


def test_writer_records_hashes_not_content(tmp_path):
    path = tmp_path / "t.jsonl"
    w = TraceWriter(str(path), hash_block_size=4)
    r = Request("a", [11, 12, 13, 14, 15, 16, 17, 18, 19], SamplingParams(max_tokens=3),
                cache_salt="tenant")
    r.output_token_ids = [21, 22, 23]
    r.num_cached_tokens = 4
    r.status = RequestStatus.FINISHED_LENGTH
    r.metrics.first_token_time = r.metrics.arrival_time + 0.5
    r.metrics.finished_time = r.metrics.arrival_time + 1.0
    w.record(r, "chat_completions/default")
    w.close()
    line = json.loads(path.read_text())
    assert set(line) == {"t", "prompt_len", "output_len", "hashes", "hash_block_size",
                         "finish", "class", "salt", "cached", "ttft_s", "e2e_s", "preemptions"}
    assert all(len(h) == 16 and int(h, 16) >= 0 for h in line["hashes"])  # 64-bit hex only
    assert "tenant" not in json.dumps(line)
    (rec,) = read_trace(str(path))
    assert (rec.prompt_len, rec.output_len, rec.finish, rec.cls) == (9, 3, "length",
                                                                     "chat_completions/default")
    assert len(rec.hashes) == 3  # 12 tokens of prompt + output in blocks of 4
    assert rec.cached == 4 and rec.ttft_s == pytest.approx(0.5) and rec.salt is not None


def test_hashes_are_chained_and_keyed():
    h = BlockHasher(2, key=b"k")
    a = h.chain([1, 2, 3, 4, 5, 6])
    b = h.chain([9, 9, 3, 4, 5, 6])
    assert a[0] != b[0] and a[1] != b[1]  # same block content, different prefix
    assert h.chain([1, 2, 3, 4, 7, 7])[:2] == a[:2]
    assert BlockHasher(2, key=b"other").chain([1, 2]) != h.chain([1, 2])
    assert h.chain([1, 2], salt="s") != h.chain([1, 2])


@pytest.mark.parametrize("coarse", [2, 4, 6])
def test_replayed_tokens_share_exactly_what_the_originals_share(coarse):
    """Brute force: for every pair of requests and every coarse block size that is a multiple
    of the hash block size, the replayed ids share as many whole coarse blocks as the
    original ids do."""
    import random

    rng = random.Random(1)
    base = [rng.randrange(5) for _ in range(40)]
    originals = [base[:rng.randrange(5, 40)] + [rng.randrange(5) for _ in range(rng.randrange(9))]
                 for _ in range(30)]
    hasher = BlockHasher(2, key=b"x")
    recs = [TraceRecord(t=0, prompt_len=len(o), output_len=0, hashes=hasher.chain(o),
                        hash_block_size=2) for o in originals]
    replayed = [replay_token_ids(r, i) for i, r in enumerate(recs)]

    def shared_blocks(x, y):
        n = 0
        while (n + 1) * coarse <= min(len(x), len(y)) and \
                x[n * coarse:(n + 1) * coarse] == y[n * coarse:(n + 1) * coarse]:
            n += 1
        return n

    for i in range(len(originals)):
        assert len(replayed[i]) == len(originals[i])
        for j in range(len(originals)):
            if i != j:
                assert shared_blocks(originals[i], originals[j]) == \
                    shared_blocks(replayed[i], replayed[j])


def test_trace_roundtrip_and_bad_lines(tmp_path):
    recs = generate("chat", 20, rate=5.0, seed=3)
    path = tmp_path / "t.jsonl"
    write_trace(str(path), recs)
    back = read_trace(str(path))
    assert [r.hashes for r in back] == [r.hashes for r in recs]
    path.write_text('{"t": 0, "prompt_len": 3, "output_len": 1, "hashes": [], "bogus": 1}\n')
    with pytest.raises(ValueError, match="bogus"):
        read_trace(str(path))


@pytest.mark.parametrize("fields,message", [
    ('"t": NaN', "t must be a finite number"),  # the simulator's clock never advanced past NaN
    ('"t": Infinity', "t must be a finite number"),
    ('"t": "0"', "t must be a finite number"),
    ('"t": 0, "hash_block_size": 0', "hash_block_size must be an integer >= 1"),
    ('"t": 0, "prompt_len": 40.5', "prompt_len must be an integer >= 1"),
    ('"t": 0, "output_len": true', "output_len must be an integer >= 0"),
    ('"t": 0, "hashes": ["zz"]', "hashes must be a list of hex strings"),
    ('"t": 0, "hashes": "00ff"', "hashes must be a list of hex strings"),
    ('"t": 0, "hashes": ["0x1f"]', "hashes must be a list of hex strings"),
    ('"t": 0, "hashes": [" ab"]', "hashes must be a list of hex strings"),
    ('"t": 0, "cached": -1', "cached must be an integer >= 0"),
    ('"t": 0, "abort_t": NaN', "abort_t must be a finite number"),
])
def test_malformed_trace_fields_are_named(tmp_path, fields, message):
    line = {"prompt_len": 40, "output_len": 4, "hashes": []}
    text = json.dumps(line)[:-1] + ", " + fields + "}"
    path = tmp_path / "t.jsonl"
    path.write_text(text + "\n")
    with pytest.raises(ValueError, match=f"t.jsonl:1: not a trace record: {message}"):
        read_trace(str(path))


def test_generators_are_deterministic_and_share_their_prefixes():
    shape = WorkloadShape(system_prompts=2, system_len=(64, 64), user_len=(8, 8),
                          output_len=(4, 4), max_model_len=4096)
    a = generate("chat", 50, 10.0, seed=7, shape=shape)
    assert [r.hashes for r in a] == [r.hashes for r in generate("chat", 50, 10.0, 7, shape)]
    # every chat request starts with one of two 64-token system prompts: 4 blocks of 16
    assert len({tuple(r.hashes[:4]) for r in a}) == 2
    s = generate("sessions", 40, 10.0, seed=1, shape=shape)
    by_session: dict[int, list[TraceRecord]] = {}
    for r in s:
        by_session.setdefault(r.extra["session"], []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: r.extra["turn"])
        for prev, nxt in zip(turns, turns[1:]):
            # a later turn resends the whole history: prompt + output of the previous turn
            full = (prev.prompt_len + prev.output_len) // 16
            assert nxt.hashes[:full] == prev.hashes[:full]
    rag = generate("rag", 30, 10.0, seed=2)
    assert all(r.cls == "rag" for r in rag)
    with pytest.raises(ValueError, match="workload"):
        generate("batch", 1, 1.0)
