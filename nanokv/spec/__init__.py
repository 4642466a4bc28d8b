"""Speculative decoding: n-gram (prompt lookup) drafts verified in one forward pass."""

from nanokv.spec.config import SpeculativeConfig
from nanokv.spec.ngram import NgramIndex, propose_ngram

__all__ = ["SpeculativeConfig", "NgramIndex", "propose_ngram"]
