"""The sampler's device path: every row of the step at once, with per-row parameter tensors.

Nothing here loops over rows in Python or reads a device value back: the host builds the step's
per-row parameters (and the seeded rows' uniforms) into one float64 buffer, uploads it once, and
the sampler brings back one packed tensor of token ids (and requested log-probabilities). The
per-row functions in `sampler.py` (`shape_logits`, `apply_penalties`, `filter_logits`,
`Sampler.sample_reference`) are the oracles these are tested against, token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanokv.sampling_params import SamplingParams
from nanokv.transfer import upload

History = tuple[list[int], list[int]]
ALL_ROWS = slice(None)  # a filter every sampled row asked for


def _take(x: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
    """The rows a filter applies to: x itself for ALL_ROWS, else a gathered copy."""
    return x if isinstance(rows, slice) else x.index_select(0, rows)


def _put(x: torch.Tensor, rows: torch.Tensor | slice, sub: torch.Tensor) -> None:
    """Write a filter's rows back (nothing to do when it worked on x itself)."""
    if not isinstance(rows, slice):
        x.index_copy_(0, rows, sub)


@dataclass
class RowParams:
    """Per sampled row (S of them), on the device, and which of them each filter applies to:
    positions in [0, S) as a tensor, ALL_ROWS when every row asked (the filter then works in
    place, no gathered copy), None when none did."""

    rows: torch.Tensor  # [S] int64, the rows of the logits that sample
    temperature: torch.Tensor  # [S, 1] float32
    top_k: torch.Tensor  # [S] int64, in [1, vocab] (vocab: off)
    top_p: torch.Tensor  # [S, 1] float32 (1: off)
    min_p: torch.Tensor  # [S, 1] float32 (0: off)
    uniforms: torch.Tensor  # [S, 1] float64, one draw per row
    min_p_rows: torch.Tensor | slice | None
    top_k_rows: torch.Tensor | slice | None
    top_p_rows: torch.Tensor | slice | None
    max_top_k: int  # the largest top_k among top_k_rows

    @classmethod
    def build(cls, params: list[SamplingParams], rows: list[int], uniforms: np.ndarray,
              vocab: int, device: torch.device) -> RowParams:
        """uniforms: [S] float64, drawn by the caller (the seed contract lives there)."""
        s = len(rows)
        ps = [params[i] for i in rows]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in ps]
        subsets = [[j for j, p in enumerate(ps) if p.min_p > 0.0],
                   [j for j, k in enumerate(top_k) if k < vocab],
                   [j for j, p in enumerate(ps) if p.top_p < 1.0]]
        max_top_k = max((top_k[j] for j in subsets[1]), default=0)
        index: list[torch.Tensor | slice | None] = [
            ALL_ROWS if len(x) == s else None for x in subsets]
        subsets = [x if len(x) < s else [] for x in subsets]  # only partial subsets travel
        host = np.empty(6 * s + sum(len(x) for x in subsets), dtype=np.float64)  # one upload
        table = host[:6 * s].reshape(6, s)  # [6, S]
        table[0] = rows
        table[1] = top_k
        table[2] = [p.temperature for p in ps]
        table[3] = [p.top_p for p in ps]
        table[4] = [p.min_p for p in ps]
        table[5] = uniforms
        start = 6 * s
        for subset in subsets:
            host[start:start + len(subset)] = subset
            start += len(subset)
        dev = upload(host, device)
        params_dev = dev[:6 * s].view(6, s)
        f32 = params_dev[2:5].float()  # [3, S]; rounded as a float32 parameter tensor would be
        start = 6 * s
        for f, subset in enumerate(subsets):
            if subset:
                index[f] = dev[start:start + len(subset)].long()
            start += len(subset)
        return cls(rows=params_dev[0].long(), temperature=f32[0, :, None],
                   top_k=params_dev[1].long(), top_p=f32[1, :, None], min_p=f32[2, :, None],
                   uniforms=params_dev[5, :, None], min_p_rows=index[0], top_k_rows=index[1],
                   top_p_rows=index[2], max_top_k=max_top_k)


def apply_token_bitmasks(logits: torch.Tensor,
                         bitmasks: list[np.ndarray | None]) -> torch.Tensor:
    """Structured outputs: row i keeps only the tokens set in `bitmasks[i]` (int32 words, bit
    t % 32 of word t // 32 for token t; `RequestGrammar.allowed_bitmask`), the rest to -inf;
    rows with None keep all. logits: [N, vocab] -> a float32 copy (one upload of the masks)."""
    rows = [i for i, m in enumerate(bitmasks) if m is not None]
    vocab = logits.shape[1]
    host = np.concatenate([np.array(rows, dtype=np.int64)]
                          + [bitmasks[i].astype(np.int32).view(np.uint32).astype(np.int64)
                             for i in rows])
    dev = upload(host, logits.device)  # rows, then each row's words
    index = dev[:len(rows)]
    words = dev[len(rows):].view(len(rows), -1)  # [R, W]
    shifts = torch.arange(32, device=logits.device)
    allowed = ((words[:, :, None] >> shifts) & 1).bool().view(len(rows), -1)  # [R, W * 32]
    allowed = allowed[:, :vocab]
    if allowed.shape[1] < vocab:  # tokens past the mask's vocabulary are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    out = logits.to(torch.float32, copy=True)
    out[index] = out[index].masked_fill(~allowed, float("-inf"))
    return out


def shape_logits_batch(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """vLLM's allowed_token_ids (every other token to -inf) then logit_bias (added) on every row
    that has them, at once. logits: [N, vocab] -> a float32 copy (the input itself when no row
    has either: nothing is uploaded or computed)."""
    shaped = [i for i, p in enumerate(params) if p.shapes_logits]
    if not shaped:
        return logits
    allowed_rows = [i for i in shaped if params[i].allowed_token_ids is not None]
    allowed = [(i, t) for i in allowed_rows for t in params[i].allowed_token_ids]
    biased = [(i, t, b) for i in shaped for t, b in (params[i].logit_bias or {}).items()]
    bias = np.array([b for _, _, b in biased], dtype=np.float64)
    host = np.concatenate([np.array(allowed_rows, dtype=np.int64),
                           np.array(allowed, dtype=np.int64).reshape(-1, 2).T.reshape(-1),
                           np.array([(i, t) for i, t, _ in biased],
                                    dtype=np.int64).reshape(-1, 2).T.reshape(-1),
                           bias.view(np.int64)])
    dev = upload(host, logits.device)  # one upload: rows, (row, token) pairs, biases as raw bits
    a, n_allowed, n_biased = len(allowed_rows), len(allowed), len(biased)
    out = logits.to(torch.float32, copy=True)
    if allowed_rows:
        pairs = dev[a:a + 2 * n_allowed].view(2, -1)  # [2 = row | token, n_allowed]
        kept = out[pairs[0], pairs[1]]
        out.index_fill_(0, dev[:a], float("-inf"))
        out[pairs[0], pairs[1]] = kept
    if biased:
        start = a + 2 * n_allowed
        pairs = dev[start:start + 2 * n_biased].view(2, -1)  # [2 = row | token, n_biased]
        out[pairs[0], pairs[1]] += dev[start + 2 * n_biased:].view(torch.float64).float()
    return out


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


def ban_tokens(logits: torch.Tensor, banned: list[tuple[int, ...]],
               raw: torch.Tensor) -> torch.Tensor:
    """Row i's `banned[i]` token ids to -inf (min_tokens: a row may not stop yet; bad_words:
    it may not complete one). logits: [N, vocab] -> the same tensor when it is already a copy
    (`shape_logits_batch`'s), else a masked copy (the raw logits stay as they are:
    log-probabilities read them)."""
    vocab = logits.shape[1]
    pairs = np.array([(i, t) for i, ids in enumerate(banned) for t in ids if t < vocab],
                     dtype=np.int64).reshape(-1, 2).T  # [2 = row | token, n]
    out = logits.clone() if logits is raw else logits
    if pairs.shape[1]:
        index = upload(pairs.reshape(-1), logits.device).view(2, -1)
        out[index[0], index[1]] = float("-inf")
    return out


def filter_logits_batch(scaled: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """min_p, then top-k, then top-p, each on the rows that asked with their own parameters, as
    `filter_logits` does row by row. scaled: [S, vocab] (tempered, changed in place) -> masked
    to -inf outside each row's set."""
    inf = float("-inf")
    if rp.min_p_rows is not None:
        rows = rp.min_p_rows
        sub = _take(scaled, rows)  # [m, vocab]
        probs = sub.softmax(-1)
        cut = _take(rp.min_p, rows) * probs.amax(-1, keepdim=True)  # [m, 1]
        _put(scaled, rows, sub.masked_fill_(probs < cut, inf))
    if rp.top_k_rows is not None:
        rows = rp.top_k_rows
        sub = _take(scaled, rows)  # [k, vocab]
        best = torch.topk(sub, rp.max_top_k, dim=-1).values  # [k, max_top_k], descending
        kth = best.gather(1, (_take(rp.top_k, rows) - 1)[:, None])  # [k, 1]
        _put(scaled, rows, sub.masked_fill_(sub < kth, inf))
    if rp.top_p_rows is not None:
        rows = rp.top_p_rows
        sub = _take(scaled, rows)  # [p, vocab]
        sorted_logits, order = sub.sort(dim=-1, descending=True)  # [p, vocab] each
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= _take(rp.top_p, rows)
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        _put(scaled, rows, sub.masked_fill_(drop, inf))
    return scaled


def draw(logits: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """The sampled rows' tokens by inverse CDF. logits: [N, vocab] -> [S] int64 (device)."""
    scaled = logits.index_select(0, rp.rows).float().div_(rp.temperature)  # [S, vocab]
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
