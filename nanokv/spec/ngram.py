"""N-gram (prompt lookup) drafts: the tokens that followed the first occurrence of the longest
n-gram ending a request's tokens (Hugging Face's prompt lookup's choice: the first occurrence
has the most tokens after it, where the output repeats itself). `propose_ngram` is the
reference, token lists in Python; `NgramIndex` the same over a numpy copy of the tokens that
grows as they do."""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens: for n from max_n down to min_n, the first start s < len - n with
    tokens[s:s + n] == tokens[-n:] gives tokens[s + n:s + n + k]; [] when none matches."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        for s in range(size - n):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


class NgramIndex:
    """A request's tokens as a numpy array (appended as they come) and its drafts."""

    def __init__(self) -> None:
        self.tokens = np.empty(256, dtype=np.int64)
        self.size = 0

    def sync(self, prompt: list[int], outputs: list[int] = ()) -> None:
        """Append what prompt + outputs (a request's tokens, which only grow) hold beyond the
        copy."""
        n = len(prompt) + len(outputs)
        if n < self.size:
            raise ValueError(f"the tokens shrank ({self.size} -> {n}): an index follows one "
                             f"request's growing tokens")
        if n > self.tokens.shape[0]:
            grown = np.empty(max(n, 2 * self.tokens.shape[0]), dtype=np.int64)
            grown[:self.size] = self.tokens[:self.size]
            self.tokens = grown
        p = len(prompt)
        if self.size < p:
            self.tokens[self.size:p] = prompt[self.size:]
        start = max(self.size, p)
        self.tokens[start:n] = outputs[start - p:]
        self.size = n

    def propose(self, min_n: int, max_n: int, k: int) -> list[int]:
        """`propose_ngram` of the synced tokens: the places the last token occurred before
        (one pass over the tokens), then, for n from the largest down, those whose n - 1
        tokens before match the suffix's (a pass over those places per token compared)."""
        a, size = self.tokens, self.size
        if size < 2:
            return []
        ends = np.flatnonzero(a[:size - 1] == a[size - 1])  # an n-gram's last token: [m]
        for n in range(min(max_n, size - 1), min_n - 1, -1):
            at = ends[ends >= n - 1]  # n-grams a[e - n + 1:e + 1] inside the tokens
            for d in range(1, n):
                if not at.size:
                    break
                at = at[a[at - d] == a[size - 1 - d]]
            if at.size:
                s = int(at[0]) + 1  # the first occurrence's next token
                return a[s:min(s + k, size)].tolist()
        return []
