"""Synthetic benchmark workload, shared by nanokv and its peers (HF transformers, vLLM).

Modelled on nano-vLLM's bench.py (random token-id prompts, random output lengths,
``ignore_eos``), scaled down for a CPU. Pure standard library: no torch import, so the
peer scripts can load this file by path from another virtual environment.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

# Token ids are drawn from [0, min(vocab_size, MAX_TOKEN_ID)).
MAX_TOKEN_ID = 10000


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: a prompt of token ids and how many tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _check_range(name: str, value: Sequence[int]) -> tuple[int, int]:
    try:
        lo, hi = value
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair (min, max) of integers, got {value!r}") from None
    for v in (lo, hi):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(  # noqa: TRY004 - one error type for all bad workload args
                f"{name} must be a pair (min, max) of integers, got {value!r}"
            )
    if lo < 1:
        raise ValueError(f"{name} min must be >= 1, got {lo}")
    if hi < lo:
        raise ValueError(f"{name} max must be >= min, got ({lo}, {hi})")
    return lo, hi


def make_workload(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    """Build ``num_requests`` random requests, deterministic in ``seed``.

    Prompt and output lengths are drawn uniformly from the inclusive ranges ``prompt_len``
    and ``output_len``; token ids uniformly from ``[0, min(vocab_size, 10000))``.
    """
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be an integer >= 1, got {num_requests!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be an integer >= 1, got {vocab_size!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")  # noqa: TRY004
    p_lo, p_hi = _check_range("prompt_len", prompt_len)
    o_lo, o_hi = _check_range("output_len", output_len)

    rng = random.Random(seed)
    id_hi = min(vocab_size, MAX_TOKEN_ID)
    requests = []
    for _ in range(num_requests):
        n = rng.randint(p_lo, p_hi)
        ids = [rng.randrange(id_hi) for _ in range(n)]
        requests.append(BenchRequest(prompt_token_ids=ids, output_len=rng.randint(o_lo, o_hi)))
    return requests


@dataclass(frozen=True)
class BenchResult:
    """One engine's run over a workload. Throughputs count useful tokens only."""

    engine: str
    num_requests: int
    output_tokens: int
    total_tokens: int  # prompt + output tokens
    elapsed_s: float
    output_tok_s: float
    total_tok_s: float
    ttft_median_s: float | None = None
    tpot_median_s: float | None = None
    peak_kv_blocks: int | None = None
    peak_running: int | None = None  # most requests running (holding KV) after one engine step
    num_preemptions: int | None = None  # requests preempted (recomputed) during the timed run
    # speculative decoding: accepted / verified draft tokens in the timed run (None: no drafts)
    spec_acceptance_rate: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=False)

    @classmethod
    def from_json(cls, line: str) -> BenchResult:
        data = json.loads(line)
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in fields})


def _median(values: Iterable[float] | None) -> float | None:
    vals = [float(v) for v in values] if values is not None else []
    return statistics.median(vals) if vals else None


def summarize(
    engine: str,
    requests: Sequence[BenchRequest],
    elapsed_s: float,
    ttfts_s: Iterable[float] | None = None,
    tpots_s: Iterable[float] | None = None,
    peak_kv_blocks: int | None = None,
    peak_running: int | None = None,
    num_preemptions: int | None = None,
    spec_acceptance_rate: float | None = None,
) -> BenchResult:
    """Turn a timed run over ``requests`` into a :class:`BenchResult`.

    Output tokens are each request's own ``output_len`` (tokens an engine generated past that
    are waste and not counted); total tokens add the prompt tokens. ``peak_kv_blocks``,
    ``peak_running``, ``num_preemptions`` and ``spec_acceptance_rate`` are what the engine
    reports, None where it has no such figure.
    """
    if elapsed_s <= 0:
        raise ValueError(f"elapsed_s must be > 0, got {elapsed_s!r}")
    out = sum(r.output_len for r in requests)
    total = out + sum(len(r.prompt_token_ids) for r in requests)
    return BenchResult(
        engine=engine,
        num_requests=len(requests),
        output_tokens=out,
        total_tokens=total,
        elapsed_s=float(elapsed_s),
        output_tok_s=out / elapsed_s,
        total_tok_s=total / elapsed_s,
        ttft_median_s=_median(ttfts_s),
        tpot_median_s=_median(tpots_s),
        peak_kv_blocks=peak_kv_blocks,
        peak_running=peak_running,
        num_preemptions=num_preemptions,
        spec_acceptance_rate=spec_acceptance_rate,
    )
