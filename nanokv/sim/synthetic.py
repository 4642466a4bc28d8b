"""Synthetic traces of three common shapes, deterministic in a seed.

    chat      a few system prompts (Zipf popularity) + a fresh user message; Poisson arrivals
    rag       a fixed system prompt + k documents of a shared set (Zipf popularity, in retrieval
              order) + a fresh question
    sessions  multi-turn conversations: turn k resends the whole history (system prompt, earlier
              user messages and answers) + a new message; sessions start as a Poisson process,
              turns follow after a think time

Requests are built as token ids (segments of ids no other segment uses) and hashed like a real
trace (`BlockHasher`), so a replay sees exactly the sharing the shape implies. Lengths are drawn
uniformly from the given ranges; arrivals are Poisson at `rate` requests per second (sessions:
`rate` is the mean request rate over all turns).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from nanokv.sim.trace import DEFAULT_HASH_BLOCK_SIZE, BlockHasher, TraceRecord

WORKLOADS = ("chat", "rag", "sessions")


@dataclass(frozen=True)
class WorkloadShape:
    """Lengths in tokens, as (min, max) ranges drawn uniformly."""

    system_prompts: int = 8  # distinct shared system prompts (chat, sessions)
    system_len: tuple[int, int] = (512, 2048)
    zipf_s: float = 1.1  # popularity of system prompts / documents: P(rank r) ~ r^-s
    user_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (32, 512)
    documents: int = 500  # rag: the shared document set
    document_len: tuple[int, int] = (256, 1024)
    documents_per_request: int = 4
    turns: tuple[int, int] = (2, 8)  # sessions: turns per session
    think_time_s: float = 20.0  # sessions: mean gap between turns (exponential)
    max_model_len: int = 8192  # a request's prompt + output stays below this


class _Segments:
    """Token ids for segments: segment k of length n is [k * 2^20 + j for j < n], unique."""

    def __init__(self) -> None:
        self._next = 1
        self.fixed: dict[tuple, list[int]] = {}

    def fresh(self, n: int) -> list[int]:
        k = self._next
        self._next += 1
        return [(k << 20) + j for j in range(n)]

    def named(self, key: tuple, n: int) -> list[int]:
        if key not in self.fixed:
            self.fixed[key] = self.fresh(n)
        return self.fixed[key]


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (r ** s) for r in range(1, n + 1)]


def generate_requests(workload: str, num_requests: int, rate: float, seed: int = 0,
                      shape: WorkloadShape | None = None) -> list[tuple]:
    """(arrival, prompt ids, output ids, class, extra) of each request, by arrival. Ids are
    segment ids (large); `nanokv.sim.validate` maps them into a real vocabulary."""
    items: list[tuple] = []
    _build(workload, num_requests, rate, seed, shape, lambda *item: items.append(item))
    return sorted(items, key=lambda item: item[0])


def _build(workload, num_requests, rate, seed, shape, emit) -> None:
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {list(WORKLOADS)}, got {workload!r}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    build = {"chat": _chat, "rag": _rag, "sessions": _sessions}[workload]
    build(num_requests, rate, random.Random(seed), _Segments(), shape or WorkloadShape(), emit)


def generate(workload: str, num_requests: int, rate: float, seed: int = 0,
             shape: WorkloadShape | None = None,
             hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE) -> list[TraceRecord]:
    """`num_requests` records of the named shape, sorted by arrival (each request is hashed as
    it is made: only the hashes are kept)."""
    hasher = BlockHasher(hash_block_size, key=b"nanokv-synthetic")
    records: list[tuple[float, TraceRecord]] = []

    def emit(t, prompt, output, cls, extra):
        records.append((t, TraceRecord(
            t=round(t, 6), prompt_len=len(prompt), output_len=len(output),
            hashes=hasher.chain(prompt + output), hash_block_size=hash_block_size, cls=cls,
            extra=extra)))

    _build(workload, num_requests, rate, seed, shape, emit)
    records.sort(key=lambda item: item[0])
    return [r for _, r in records]


def _lengths(rng: random.Random, r: tuple[int, int]) -> int:
    return rng.randint(r[0], r[1])


def _fit(prompt: list[int], out_len: int, max_len: int) -> tuple[list[int], int]:
    """Trim the prompt's tail so prompt + output < max_len."""
    out_len = max(1, min(out_len, max_len // 4))
    return prompt[:max_len - 1 - out_len], out_len


def _chat(n, rate, rng, seg, shape, emit):
    weights = _zipf_weights(shape.system_prompts, shape.zipf_s)
    sys_lens = [_lengths(rng, shape.system_len) for _ in range(shape.system_prompts)]
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        k = rng.choices(range(shape.system_prompts), weights)[0]
        prompt = seg.named(("sys", k), sys_lens[k]) + seg.fresh(_lengths(rng, shape.user_len))
        prompt, out = _fit(prompt, _lengths(rng, shape.output_len), shape.max_model_len)
        emit(t, prompt, seg.fresh(out), f"chat/sys{k}", {})


def _rag(n, rate, rng, seg, shape, emit):
    weights = _zipf_weights(shape.documents, shape.zipf_s)
    doc_lens = [_lengths(rng, shape.document_len) for _ in range(shape.documents)]
    system = seg.named(("sys", 0), _lengths(rng, shape.system_len))
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        docs: list[int] = []
        while len(docs) < min(shape.documents_per_request, shape.documents):
            d = rng.choices(range(shape.documents), weights)[0]
            if d not in docs:
                docs.append(d)
        prompt = list(system)
        for d in docs:
            prompt += seg.named(("doc", d), doc_lens[d])
        prompt += seg.fresh(_lengths(rng, shape.user_len))
        prompt, out = _fit(prompt, _lengths(rng, shape.output_len), shape.max_model_len)
        emit(t, prompt, seg.fresh(out), "rag", {"top_doc": docs[0]})


def _sessions(n, rate, rng, seg, shape, emit):
    weights = _zipf_weights(shape.system_prompts, shape.zipf_s)
    sys_lens = [_lengths(rng, shape.system_len) for _ in range(shape.system_prompts)]
    mean_turns = (shape.turns[0] + shape.turns[1]) / 2
    t_start, made, sid = 0.0, 0, 0
    while made < n:
        t_start += rng.expovariate(rate / mean_turns)
        k = rng.choices(range(shape.system_prompts), weights)[0]
        history = list(seg.named(("sys", k), sys_lens[k]))
        t = t_start
        for turn in range(_lengths(rng, shape.turns)):
            prompt = history + seg.fresh(_lengths(rng, shape.user_len))
            out_len = _lengths(rng, shape.output_len)
            if len(prompt) + out_len >= shape.max_model_len or made >= n:
                break
            output = seg.fresh(out_len)
            cls = "sessions/first" if turn == 0 else "sessions/followup"
            emit(t, prompt, output, cls, {"session": sid, "turn": turn})
            made += 1
            history = prompt + output
            t += rng.expovariate(1.0 / shape.think_time_s)
        sid += 1
