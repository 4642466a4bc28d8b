"""Token sampling: greedy rows by argmax; the rest with temperature, top-k, top-p.

A request with a seed draws token i from a generator seeded by (seed, i), so its output does not
depend on what else is in the batch, nor on preemption. Requests without a seed share the
engine's generator.
"""

from __future__ import annotations

import torch

from nanokv.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 output_indices: list[int]) -> list[int]:
        """logits: [N, vocab] float32 -> one token id per row."""
        tokens = logits.argmax(dim=-1).tolist()
        for row, p in enumerate(params):
            if not p.greedy:
                tokens[row] = self._sample_row(logits[row], p, output_indices[row])
        return tokens

    def _sample_row(self, logits: torch.Tensor, p: SamplingParams, index: int) -> int:
        logits = filter_logits(logits.float() / p.temperature, p.top_k, p.top_p)
        probs = logits.softmax(-1).cpu()
        if p.seed is not None:
            gen = torch.Generator().manual_seed((p.seed * 1_000_003 + index) % (2**63))
        else:
            gen = self.generator
        return int(torch.multinomial(probs, 1, generator=gen))


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and the top-p nucleus. logits: [vocab]."""
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
