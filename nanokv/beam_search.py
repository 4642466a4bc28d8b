"""Beam search over the engine, as vLLM's `LLM.beam_search` and its server's `use_beam_search`:
each step asks the engine for one token of every live beam with its 2 x beam_width likeliest
next tokens (a request of max_tokens 1 over the beam's tokens), and keeps the beam_width best
continuations by cumulative log-probability. A beam's request finds the blocks its prompt and
earlier steps filled in the prefix cache, so a step computes only each beam's last partial
block and its new token; sibling beams share their common blocks by reference.

This file holds the search itself (no engine): `BeamSearchParams`, one prompt's `BeamSearch`
and its results. The drivers that run its steps: `LLM.beam_search` (nanokv/engine/llm.py) and
the server's (nanokv/server/beam_serving.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nanokv.layers.sampler import TokenLogprobs
from nanokv.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam asks for 2 x beam_width candidates


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams. `temperature` is accepted for vLLM's sake and changes nothing:
    vLLM samples one extra candidate per beam at it, which never ranks among the beam_width
    best (each beam's 2 x beam_width likeliest tokens outrank it); nanokv's candidates are
    those likeliest tokens alone, by their raw log-probabilities."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}] (each beam asks for "
                             f"2 x beam_width candidates, at most {MAX_LOGPROBS} log-"
                             f"probabilities), got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def step_params(self) -> SamplingParams:
        """A beam's request in one step: one greedy token with the 2 x beam_width likeliest."""
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * self.beam_width,
                              ignore_eos=True, detokenize=False)


@dataclass
class BeamSearchSequence:
    """A beam (vLLM's): `tokens` the prompt's then the generated ones (an ending EOS kept), as
    vLLM's offline search returns them; `logprobs` one entry per generated token (its
    log-probability, its rank, and the beam's candidates at that step)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS) or "length"
    stop_reason: int | None = None  # the EOS id that ended it

    def num_generated(self) -> int:
        return len(self.logprobs)


@dataclass
class BeamSearchOutput:
    """vLLM's: the beam_width best sequences of a prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(sequence: BeamSearchSequence, eos_token_ids: frozenset[int],
               length_penalty: float) -> float:
    """vLLM's (after Hugging Face's): cum_logprob / length ** length_penalty, the length the
    sequence's tokens (prompt included), an ending EOS not counted."""
    length = len(sequence.tokens)
    if sequence.tokens and sequence.tokens[-1] in eos_token_ids:
        length -= 1
    return sequence.cum_logprob / (max(length, 1) ** length_penalty)


class BeamSearch:
    """One prompt's search. Each step: `live()` are the beams to extend (their tokens are the
    step's prompts), `advance(results)` takes each one's TokenLogprobs and keeps the beam_width
    best continuations; a continuation by an EOS (unless ignore_eos) is a finished beam.
    `done` once max_tokens steps ran or no beam is left."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.params = params
        self.prompt_len = len(prompt_token_ids)
        self.eos = frozenset(eos_token_ids)
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.params.max_tokens

    def live(self) -> list[BeamSearchSequence]:
        return [] if self.done else self.beams

    def advance(self, results: list[TokenLogprobs]) -> None:
        if len(results) != len(self.beams):
            raise ValueError(f"got {len(results)} results for {len(self.beams)} beams")
        width, candidates = self.params.beam_width, []
        for beam, lp in zip(self.beams, results):
            for rank, (token, logprob) in enumerate(lp.top[:2 * width], start=1):
                step = TokenLogprobs(token, logprob, rank, lp.top)
                grown = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [step],
                                           beam.cum_logprob + logprob)
                if token in self.eos and not self.params.ignore_eos:
                    grown.finish_reason, grown.stop_reason = "stop", token
                    self.completed.append(grown)
                else:
                    candidates.append(grown)
        # the best by cumulative log-probability (all of one length: the score's order); a
        # stable sort keeps the earlier beam's, then the likelier token's, on ties
        candidates.sort(key=lambda s: s.cum_logprob, reverse=True)
        self.beams = candidates[:width]
        self.steps += 1

    def best(self) -> list[BeamSearchSequence]:
        """The beam_width best of the finished and the live beams by `beam_score`; live ones
        end with finish_reason "length"."""
        for beam in self.beams:
            beam.finish_reason = "length"
        ranked = sorted(self.completed + self.beams, reverse=True,
                        key=lambda s: beam_score(s, self.eos, self.params.length_penalty))
        return ranked[:self.params.beam_width]


def step_beams(searches: list[BeamSearch]) -> list[tuple[int, BeamSearchSequence]]:
    """One step's beams to extend, all searches together: (search index, beam)."""
    return [(i, beam) for i, search in enumerate(searches) for beam in search.live()]


def advance_all(searches: list[BeamSearch], beams: list[tuple[int, BeamSearchSequence]],
                results: list[TokenLogprobs]) -> None:
    """Each search advanced by its beams' results (`results[k]` is `beams[k]`'s)."""
    mine: list[list[TokenLogprobs]] = [[] for _ in searches]
    for (i, _), lp in zip(beams, results, strict=True):
        mine[i].append(lp)
    for search, lps in zip(searches, mine):
        if lps:
            search.advance(lps)
