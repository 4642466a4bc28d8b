"""Request traces: one JSON line per request, hashes only.

A line records what the KV cache needs to replay a request and nothing that reveals its content:

    {"t": 3.20, "prompt_len": 812, "output_len": 64, "finish": "length", "class": "chat/default",
     "salt": null, "hash_block_size": 16, "hashes": ["9f2c...", ...], "cached": 512,
     "ttft_s": 0.41, "e2e_s": 2.9, "preemptions": 0}

`hashes` are the chained hashes of the request's full blocks of `hash_block_size` tokens over its
prompt AND output (a later turn of a session resends both), `prompt_len // hash_block_size` of
them covering the prompt. They are keyed with a random per-writer secret (BLAKE2b), so they show
which requests share which prefixes but cannot be checked against a guessed text; traces from two
writers are therefore not comparable. `salt` is a digest of the request's `cache_salt`.
`cached`, `ttft_s`, `e2e_s` and `preemptions` are what the serving engine measured (validation);
`step` and `order` say where the engine added the request (the step it was added before, counted
as in the step log `nanokv/sim/step_log.py`, and its admission order).

A request its client aborted (a disconnect, a timeout) has `finish` "abort", `output_len` the
tokens produced until then, and `abort_t` (when the server processed the abort, on the trace's
clock), `abort_step` (the step it was aborted before) and `max_tokens` (what it would have run
to): a replay frees its blocks at that step (recorded admission) or time (arrival admission).

Any block size that is a multiple of `hash_block_size` can be replayed exactly: two requests share
their first k coarse blocks iff they share the fine hash at the k-th coarse boundary (chaining).
`replay_token_ids` turns a record back into token ids with exactly that property.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from array import array
from dataclasses import asdict, dataclass, field

from nanokv.request import RequestStatus
from nanokv.validation import check_finite, check_int

DEFAULT_HASH_BLOCK_SIZE = 16  # the finest block size the engine accepts
HEX = re.compile(r"[0-9a-f]+")  # how BlockHasher writes a hash
TOKEN_ID_BITS = 62  # replayed token ids stay positive int64 (the block manager hashes int64s)


@dataclass
class TraceRecord:
    t: float  # arrival, seconds from the trace's start
    prompt_len: int
    output_len: int
    hashes: list[str]  # chained hashes of full blocks of prompt + output (hex)
    hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE
    finish: str = "length"
    cls: str = "default"  # request class: endpoint/header class, or a generator's label
    salt: str | None = None  # digest of cache_salt
    cached: int | None = None  # prompt tokens the serving engine found in its prefix cache
    ttft_s: float | None = None
    e2e_s: float | None = None
    preemptions: int | None = None
    step: int | None = None  # the serving engine's step it was added before (step log)
    order: int | None = None  # its admission order in that engine
    abort_t: float | None = None  # a client abort: when the server processed it
    abort_step: int | None = None  # a client abort: the step it came before
    max_tokens: int | None = None  # a client abort: the request's output limit
    extra: dict = field(default_factory=dict)  # generator metadata (session id, turn ...)

    def __post_init__(self) -> None:
        check_finite("t", self.t, unit=" of seconds")
        check_int("prompt_len", self.prompt_len, 1)
        check_int("output_len", self.output_len, 0)
        check_int("hash_block_size", self.hash_block_size, 1)
        if not isinstance(self.hashes, list) or not all(_is_hex(h) for h in self.hashes):
            raise ValueError(f"hashes must be a list of hex strings, got {self.hashes!r}")
        for name in ("cached", "preemptions", "step", "order", "abort_step", "max_tokens"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 0)
        for name in ("abort_t", "ttft_s", "e2e_s"):
            if getattr(self, name) is not None:
                check_finite(name, getattr(self, name), unit=" of seconds")
        full = (self.prompt_len + self.output_len) // self.hash_block_size
        if len(self.hashes) > full:
            raise ValueError(f"{len(self.hashes)} block hashes for {full} full blocks of "
                             f"{self.hash_block_size} tokens")
        if self.abort_t is not None and self.abort_t < self.t:
            raise ValueError(f"a request cannot be aborted (abort_t {self.abort_t}) before it "
                             f"arrived (t {self.t})")
        if self.max_tokens is not None and self.max_tokens < max(1, self.output_len):
            raise ValueError(f"max_tokens {self.max_tokens} is below the {self.output_len} "
                             f"tokens the request produced")

    @property
    def aborted(self) -> bool:
        return self.abort_t is not None

    def to_json(self) -> str:
        d = asdict(self)
        d["class"] = d.pop("cls")
        if not d["extra"]:
            del d["extra"]
        return json.dumps({k: v for k, v in d.items() if v is not None}, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> TraceRecord:
        d = json.loads(line)
        d["cls"] = d.pop("class", "default")
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown trace fields {sorted(unknown)}")
        return cls(**d)


def _is_hex(h) -> bool:
    return isinstance(h, str) and HEX.fullmatch(h) is not None


class BlockHasher:
    """Keyed chained hashes of token blocks (64-bit, hex)."""

    def __init__(self, block_size: int = DEFAULT_HASH_BLOCK_SIZE, key: bytes | None = None):
        if block_size < 1:
            raise ValueError(f"hash block size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.key = key if key is not None else os.urandom(16)

    def chain(self, token_ids: list[int], salt: str | None = None) -> list[str]:
        bs = self.block_size
        parent = (salt or "").encode()
        out = []
        for i in range(len(token_ids) // bs):
            h = hashlib.blake2b(parent, key=self.key, digest_size=8)
            h.update(array("q", token_ids[i * bs:(i + 1) * bs]).tobytes())
            parent = h.digest()
            out.append(parent.hex())
        return out


def salt_digest(cache_salt: str | None) -> str | None:
    if cache_salt is None:
        return None
    return hashlib.sha256(cache_salt.encode()).hexdigest()[:16]


class TraceWriter:
    """Appends one line per finished request (thread-safe, flushed per line). With `steps_path`
    it also writes the step log (`nanokv/sim/step_log.py`); the server's loop drives `steps`
    (`attach`, `begin_turn`, `admitted`, `end_turn`) and `record`s each finished request."""

    def __init__(self, path: str, hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE,
                 key: bytes | None = None, steps_path: str | None = None) -> None:
        from nanokv.sim.step_log import StepLogWriter

        self.path = path
        self.hasher = BlockHasher(hash_block_size, key)
        self.start = time.monotonic()
        self._lock = threading.Lock()
        self._admitted: dict[str, tuple[int, int]] = {}  # request id -> (step, order)
        try:
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        except OSError as e:
            raise ValueError(f"cannot open the trace file {path!r}: {e}") from e
        self.steps = StepLogWriter(steps_path, self.start)

    def attach(self, engine) -> None:
        """Count the engine's steps (and log their shapes when a step log is written)."""
        self.steps.attach(engine)

    def begin_turn(self) -> None:
        self.steps.begin_turn()

    def admitted(self, request) -> None:
        self._admitted[request.request_id] = self.steps.admitted()

    def end_turn(self, busy: bool) -> None:
        self.steps.end_turn(busy)

    def record(self, request, request_class: str = "default") -> None:
        """A finished `nanokv.request.Request` (its prompt and output token ids)."""
        step, order = self._admitted.pop(request.request_id, (None, None))
        self.steps.ended()
        m = request.metrics
        tokens = request.prompt_token_ids + request.output_token_ids
        end = m.finished_time or time.monotonic()
        aborted = request.status is RequestStatus.FINISHED_ABORTED
        rec = TraceRecord(
            t=round(m.arrival_time - self.start, 6), prompt_len=request.num_prompt_tokens,
            output_len=request.num_output_tokens,
            hashes=self.hasher.chain(tokens, request.cache_salt),
            hash_block_size=self.hasher.block_size, finish=request.status.value,
            cls=request_class, salt=salt_digest(request.cache_salt),
            cached=max(0, request.num_cached_tokens),
            ttft_s=None if m.ttft is None else round(m.ttft, 6),
            e2e_s=round(end - m.arrival_time, 6), preemptions=request.num_preemptions,
            step=step, order=order,
            abort_t=round(end - self.start, 6) if aborted else None,
            abort_step=self.steps.step if aborted else None,
            max_tokens=request.params.max_tokens if aborted else None)
        line = rec.to_json() + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()
        self.steps.close()


def write_trace(path: str, records: list[TraceRecord]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(r.to_json() + "\n")


def read_trace(path: str) -> list[TraceRecord]:
    """Records sorted by arrival (a server writes them as requests finish)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(TraceRecord.from_json(line))
                except (ValueError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: not a trace record: {e}") from e
    if not records:
        raise ValueError(f"{path} holds no trace records")
    records.sort(key=lambda r: r.t)
    return records


def replay_token_ids(record: TraceRecord, unique: int) -> list[int]:
    """Token ids of prompt + output with the record's sharing structure: each full fine block
    is its hash followed by zeros (equal blocks <=> equal chained hashes), the partial tail
    belongs to this request alone (`unique` must differ between records; ids stay below
    2^62 and distinct from every hash-derived block)."""
    bs = record.hash_block_size
    mask = (1 << TOKEN_ID_BITS) - 1
    zeros = [0] * (bs - 1)
    tokens: list[int] = []
    for h in record.hashes:
        tokens.append((int(h, 16) & mask) | 1)  # odd: never equal to a tail token below
        tokens += zeros
    n = record.prompt_len + record.output_len
    tail = n - len(tokens)
    tokens += [((unique * 1_000_003 + i + 1) << 1) & mask for i in range(tail)]
    return tokens
