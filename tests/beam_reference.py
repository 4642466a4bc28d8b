"""vLLM's beam search written out over a Hugging Face model's full forward passes: the oracle
of `LLM.beam_search` (tests/model/test_beam_search.py, test_sliding_window.py)."""

from __future__ import annotations

import torch


def reference_beam_search(hf, prompt, width, max_tokens, eos, ignore_eos, length_penalty):
    """vLLM's beam search written out over full forward passes: each beam's 2 x width likeliest
    tokens are candidates, an EOS one a finished sequence (unless ignore_eos), the width best
    others by cumulative log-probability go on; at the end the width best of all by
    cum / length ** length_penalty (length: prompt and output, an ending EOS not counted)."""
    beams, finished = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        if not beams:
            break
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logits = hf(torch.tensor([tokens])).logits[0, -1].float()
            top = torch.log_softmax(logits, -1).topk(2 * width)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                grown = (tokens + [token], cum + value)
                (finished if token in eos and not ignore_eos else candidates).append(grown)
        beams = sorted(candidates, key=lambda c: c[1], reverse=True)[:width]

    def score(c):
        length = len(c[0]) - (c[0][-1] in eos)
        return c[1] / max(length, 1) ** length_penalty

    return sorted(finished + beams, key=score, reverse=True)[:width]
