"""The sampler's device path: every row of the step at once, with per-row parameter tensors.

Nothing here loops over rows in Python or reads a device value back: the host builds the step's
per-row parameters (and the seeded rows' uniforms) into one float64 buffer, uploads it once, and
the sampler brings back one packed tensor of token ids (and requested log-probabilities). The
per-row functions in `sampler.py` (`apply_penalties`, `filter_logits`,
`Sampler.sample_reference`) are the oracles these are tested against, token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanokv.sampling_params import SamplingParams
from nanokv.transfer import upload

History = tuple[list[int], list[int]]


@dataclass
class RowParams:
    """Per sampled row (S of them), on the device."""

    rows: torch.Tensor  # [S] int64, the rows of the logits that sample
    temperature: torch.Tensor  # [S, 1] float32
    top_k: torch.Tensor  # [S] int64, in [1, vocab] (vocab: off)
    top_p: torch.Tensor  # [S, 1] float32 (1: off)
    min_p: torch.Tensor  # [S, 1] float32 (0: off)
    uniforms: torch.Tensor  # [S, 1] float64, one draw per row
    # host flags: skip a filter no row asked for
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def build(cls, params: list[SamplingParams], rows: list[int], uniforms: np.ndarray,
              vocab: int, device: torch.device) -> RowParams:
        """uniforms: [S] float64, drawn by the caller (the seed contract lives there)."""
        s = len(rows)
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in (params[i] for i in rows)]
        host = np.empty((6, s), dtype=np.float64)  # one buffer, one upload
        host[0] = rows
        host[1] = top_k
        host[2] = [params[i].temperature for i in rows]
        host[3] = [params[i].top_p for i in rows]
        host[4] = [params[i].min_p for i in rows]
        host[5] = uniforms
        dev = upload(host, device)  # [6, S]
        f32 = dev[2:5].float()  # [3, S]; rounded as a float32 parameter tensor would be
        return cls(rows=dev[0].long(), temperature=f32[0, :, None], top_k=dev[1].long(),
                   top_p=f32[1, :, None], min_p=f32[2, :, None], uniforms=dev[5, :, None],
                   any_top_k=any(k < vocab for k in top_k),
                   any_top_p=any(params[i].top_p < 1.0 for i in rows),
                   any_min_p=any(params[i].min_p > 0.0 for i in rows))


def apply_penalties_batch(logits: torch.Tensor, params: list[SamplingParams],
                          histories: list[History | None]) -> torch.Tensor:
    """vLLM's repetition / frequency / presence penalties on every row that has them, at once.
    logits: [N, vocab] -> a penalised copy (the input itself when no row has penalties)."""
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    if not penalised:
        return logits
    vocab, device = logits.shape[1], logits.device
    out_rows, out_ids, seen_rows, seen_ids = [], [], [], []
    for j, i in enumerate(penalised):
        if histories is None or histories[i] is None:
            raise ValueError("penalties need each row's (prompt, output) token ids")
        prompt, output = histories[i]
        out = np.asarray(output, dtype=np.int64)
        out = out[out < vocab]
        prm = np.asarray(prompt, dtype=np.int64)
        prm = prm[prm < vocab]
        out_rows.append(np.full(len(out), j, dtype=np.int64))
        out_ids.append(out)
        seen_rows.append(np.full(len(prm), j, dtype=np.int64))
        seen_ids.append(prm)
    n_out = sum(len(a) for a in out_ids)
    factors = np.array([[params[i].repetition_penalty, params[i].frequency_penalty,
                         params[i].presence_penalty] for i in penalised],
                       dtype=np.float64).T  # [3, P]
    host = np.concatenate([np.asarray(penalised, dtype=np.int64)] + out_rows + seen_rows
                          + out_ids + seen_ids + [factors.view(np.int64).reshape(-1)])
    dev = upload(host, device)  # one upload: rows, (row, token) pairs, factors as raw bits
    p, n_tok = len(penalised), len(host) - len(penalised) - 3 * len(penalised)
    rows = dev[:p]
    pairs = dev[p:p + n_tok].view(2, -1)  # [2 = row | token, n]: output pairs first
    f = dev[p + n_tok:].view(torch.float64).view(3, p, 1).float()  # [3, P, 1]
    counts = torch.zeros(p, vocab, dtype=torch.float32, device=device)
    counts.index_put_((pairs[0, :n_out], pairs[1, :n_out]),
                      torch.ones(n_out, dtype=torch.float32, device=device), accumulate=True)
    seen = counts > 0
    seen[pairs[0, n_out:], pairs[1, n_out:]] = True
    sub = logits[rows].float()  # [P, vocab]
    r = f[0]
    sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    sub = sub - f[1] * counts
    sub = sub - f[2] * (counts > 0).to(sub.dtype)
    out_logits = logits.float().clone()
    out_logits[rows] = sub
    return out_logits


def filter_logits_batch(scaled: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """min_p, then top-k, then top-p, each row with its own parameters, as `filter_logits` does
    row by row. scaled: [S, vocab] (tempered) -> masked to -inf outside each row's set."""
    if rp.any_min_p:
        probs = scaled.softmax(-1)  # [S, vocab]
        scaled = scaled.masked_fill(probs < rp.min_p * probs.amax(-1, keepdim=True),
                                    float("-inf"))
    if not (rp.any_top_k or rp.any_top_p):
        return scaled
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [S, vocab] each
    if rp.any_top_k:
        kth = sorted_logits.gather(1, (rp.top_k - 1)[:, None])  # [S, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        # what sorting the masked row gives: its tail below the k-th value is -inf
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if rp.any_top_p:
        sorted_probs = sorted_logits.softmax(-1)  # [S, vocab]
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= rp.top_p
        drop_sorted &= rp.top_p < 1.0  # rows without top-p keep everything
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def draw(logits: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """The sampled rows' tokens by inverse CDF. logits: [N, vocab] -> [S] int64 (device)."""
    scaled = logits[rp.rows].float() / rp.temperature  # [S, vocab]
    scaled = filter_logits_batch(scaled, rp)
    cdf = scaled.softmax(-1).double().cumsum_(-1)  # [S, vocab], non-decreasing
    # first index with cdf > u * total: a zero-probability token never has cdf rising there
    picks = torch.searchsorted(cdf, rp.uniforms * cdf[:, -1:], right=True)  # [S, 1]
    return picks.clamp_max_(cdf.shape[1] - 1).view(-1)


def logprob_parts(raw: torch.Tensor, tokens: torch.Tensor, rows: list[int],
                  top: int) -> list[torch.Tensor]:
    """Device tensors to bring back with the tokens: for each row in `rows` the sampled token's
    raw log-probability [L], its rank [L] and the `top` best (log-probability, id) [L * top]
    each, all float64 (token ids < 2^53 are exact)."""
    index = torch.tensor(rows, dtype=torch.long).to(raw.device, non_blocking=True)
    lp = raw[index].float().log_softmax(-1)  # [L, vocab]
    value = lp.gather(1, tokens[index][:, None])  # [L, 1]
    rank = (lp > value).sum(-1) + 1  # [L]
    parts = [value.view(-1).double(), rank.double()]
    if top:
        values, ids = torch.topk(lp, top, dim=-1)  # [L, top] each
        parts += [values.reshape(-1).double(), ids.reshape(-1).double()]
    return parts
