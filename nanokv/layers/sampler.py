"""Token sampling: penalties, then greedy rows by argmax; the rest with temperature, min-p,
top-k, top-p; log-probabilities of the sampled tokens on request.

The order is vLLM's: penalties change the logits every row reads (greedy ones too), then the
temperature, then min_p on the tempered distribution, then top-k and top-p. Log-probabilities are
those of the model's raw distribution (vLLM's default `raw_logprobs`): what the model thought,
not what the sampling settings made of it.

Sampled rows are drawn together by inverse-CDF sampling: one uniform u per row and the first
token whose cumulative probability (float64) exceeds u * total. That is one random number per
row where a multinomial (the exponential race inside torch.multinomial) draws one per vocabulary
entry (an order of magnitude faster for a large vocabulary; figures in docs/results/engine).
`sample_row_reference` is the per-row softmax + multinomial it replaces, and `apply_penalties`
is written token by token in the tests as the oracle of the vectorised version.

A request with a seed draws token i with a uniform from a generator seeded by (seed, i), so its
output does not depend on what else is in the batch, nor on preemption. Requests without a seed
share the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanokv.sampling_params import SamplingParams

# (prompt token ids, output token ids) of a row: what the penalties look at
History = tuple[list[int], list[int]]


@dataclass
class TokenLogprobs:
    """The sampled token's log-probability, its rank (1 = the most likely token) and the
    `logprobs` most likely tokens with theirs, best first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where the request did not ask


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 output_indices: list[int],
                 histories: list[History | None] | None = None) -> list[int]:
        """logits: [N, vocab] float32 -> one token id per row."""
        return self.sample(logits, params, output_indices, histories).token_ids

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               output_indices: list[int],
               histories: list[History | None] | None = None) -> SamplerOutput:
        """logits: [N, vocab]; histories[i] is needed where params[i].has_penalties."""
        raw = logits
        penalised = [i for i, p in enumerate(params) if p.has_penalties]
        if penalised:
            if histories is None:
                raise ValueError("penalties need each row's (prompt, output) token ids")
            logits = logits.float().clone()
            for i in penalised:
                logits[i] = apply_penalties(logits[i], params[i], *histories[i])
        tokens = logits.argmax(dim=-1).tolist()
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            self._sample_rows(logits, params, output_indices, rows, tokens)
        return SamplerOutput(tokens, token_logprobs(raw, params, tokens))

    def _sample_rows(self, logits: torch.Tensor, params: list[SamplingParams],
                     output_indices: list[int], rows: list[int], tokens: list[int]) -> None:
        temps = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32)
        scaled = logits[rows].float().cpu() / temps[:, None]  # [S, vocab]
        for j, i in enumerate(rows):
            p = params[i]
            if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
                scaled[j] = filter_logits(scaled[j], p.top_k, p.top_p, p.min_p)
        cdf = scaled.softmax(-1).double().cumsum_(-1)  # [S, vocab], non-decreasing
        u = torch.rand(len(rows), 1, generator=self.generator, dtype=torch.float64)  # [S, 1]
        for j, i in enumerate(rows):
            if params[i].seed is not None:
                u[j] = torch.rand(1, generator=self._request_generator(params[i],
                                                                       output_indices[i]),
                                  dtype=torch.float64)
        # first index with cdf > u * total: a zero-probability token never has cdf rising there
        picks = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # [S, 1]
        picks = picks.clamp_max_(cdf.shape[1] - 1).view(-1).tolist()
        for j, i in enumerate(rows):
            tokens[i] = picks[j]

    @staticmethod
    def _request_generator(p: SamplingParams, index: int) -> torch.Generator:
        return torch.Generator().manual_seed((p.seed * 1_000_003 + index) % (2**63))

    def sample_row_reference(self, logits: torch.Tensor, p: SamplingParams, index: int,
                             history: History | None = None) -> int:
        """One row by softmax + multinomial (the reference the batched sampling is tested
        against)."""
        logits = logits.float()
        if p.has_penalties:
            logits = apply_penalties(logits, p, *history)
        if p.greedy:
            return int(logits.argmax())
        logits = filter_logits(logits / p.temperature, p.top_k, p.top_p, p.min_p)
        probs = logits.softmax(-1).cpu()
        gen = self._request_generator(p, index) if p.seed is not None else self.generator
        return int(torch.multinomial(probs, 1, generator=gen))


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt_token_ids: list[int],
                    output_token_ids: list[int]) -> torch.Tensor:
    """vLLM's penalties on one row. logits: [vocab] -> [vocab].

    repetition (tokens of the prompt or the output): positive logits / r, negative ones * r;
    frequency: - f * (times the token was output); presence: - p once if it was output.
    """
    vocab = logits.shape[-1]
    logits = logits.float()
    out = torch.tensor(output_token_ids, dtype=torch.long, device=logits.device)
    out = out[out < vocab]
    counts = torch.bincount(out, minlength=vocab).to(logits.dtype)  # [vocab]
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        prompt = torch.tensor(prompt_token_ids, dtype=torch.long, device=logits.device)
        seen[prompt[prompt < vocab]] = True
        r = p.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    if p.frequency_penalty != 0.0:
        logits = logits - p.frequency_penalty * counts
    if p.presence_penalty != 0.0:
        logits = logits - p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def token_logprobs(raw: torch.Tensor, params: list[SamplingParams],
                   tokens: list[int]) -> list[TokenLogprobs | None]:
    """Per row asking for logprobs: the sampled token's log-probability under the raw
    distribution, its rank and the top alternatives. raw: [N, vocab]."""
    out: list[TokenLogprobs | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    lp = raw[rows].float().log_softmax(-1).cpu()  # [L, vocab]
    for j, i in enumerate(rows):
        row, token, k = lp[j], tokens[i], params[i].logprobs
        value = row[token]
        rank = int((row > value).sum()) + 1
        top: list[tuple[int, float]] = []
        if k:
            values, ids = torch.topk(row, k)
            top = list(zip(ids.tolist(), values.tolist()))
        out[i] = TokenLogprobs(token, float(value), rank, top)
    return out


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float,
                  min_p: float = 0.0) -> torch.Tensor:
    """Mask (to -inf) tokens below min_p x the top probability, then everything outside the
    top-k and the top-p nucleus. logits: [vocab]."""
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
