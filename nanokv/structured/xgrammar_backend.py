"""Structured outputs on xgrammar (vLLM's default backend): constraints compiled once each
against the tokenizer's vocabulary, and a matcher per request that says which tokens may come
next and follows the ones sampled.

xgrammar is the optional [structured] extra, imported on the first constrained request. Its
objects stay in the engine's process (rank 0): the scheduler asks a request's `RequestGrammar`
for the next token's bitmask (a numpy array, plain data to the model runner) and feeds it each
sampled token.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from nanokv.extras import require
from nanokv.structured.params import StructuredOutputsParams

MAX_COMPILED = 256  # compiled constraints kept (least recently used dropped first)


def choice_grammar(choices: Sequence[str]) -> str:
    """vLLM's `choice_as_grammar`: an EBNF grammar whose root is one of the strings."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}

    def literal(text: str) -> str:
        return "".join(escapes.get(c, f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F
                                   else c) for c in text)

    return "root ::= " + " | ".join(f'"{literal(c)}"' for c in choices)


class RequestGrammar:
    """One request's place in its grammar (a GrammarMatcher of its own). With `starts_after`
    (a text) the grammar waits: the output is free up to the token that completes the text's
    first occurrence (its last tokens decoded by `decode`), and the grammar constrains the
    tokens after it."""

    def __init__(self, matcher, vocab_size: int, starts_after: str | None = None,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self._matcher = matcher
        self._bitmask = np.empty((1, (vocab_size + 31) // 32), dtype=np.int32)
        self._waiting_for = starts_after or None
        self._decode = decode
        self._recent: list[int] = []  # the last output tokens while waiting

    @property
    def waiting(self) -> bool:
        """The grammar has not started: the output is free."""
        return self._waiting_for is not None

    def allowed_bitmask(self) -> np.ndarray | None:
        """The tokens that may come next: bit t % 32 of word t // 32 set for an allowed token t,
        int32 [ceil(vocab / 32)] (a new array: it travels with the step); None while waiting
        (every token)."""
        if self.waiting:
            return None
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return self._bitmask[0].copy()

    def draft_rows(self, drafts: list[int]) -> tuple[list[int], np.ndarray | None]:
        """Speculative decoding: the drafts this grammar lets through and each sampling row's
        bitmask, the matcher left as it was. Row j samples the token after drafts[:j]: its
        mask is the matcher's after them, int32 [1 + kept, words]. Kept: the drafts before the
        first the grammar refuses or that would end it (a stop token: the request stops there,
        no row may follow it). While waiting, every row is free (None) and the drafts stop
        before the one that would complete the text the grammar starts after."""
        if self.waiting:
            for j in range(len(drafts)):
                recent = (self._recent + drafts[:j + 1])[-(len(self._waiting_for) + 4):]
                if self._waiting_for in self._decode(recent):
                    return drafts[:j], None
            return drafts, None
        matcher = self._matcher
        masks = np.empty((len(drafts) + 1, self._bitmask.shape[1]), dtype=np.int32)
        matcher.fill_next_token_bitmask(masks, 0)
        kept = 0
        for token in drafts:
            if not matcher.accept_token(token):
                break
            if matcher.is_terminated():
                matcher.rollback(1)
                break
            kept += 1
            matcher.fill_next_token_bitmask(masks, kept)
        if kept:
            matcher.rollback(kept)
        return drafts[:kept], masks[:kept + 1]

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False when the grammar does not allow it."""
        if self.waiting:
            # enough tokens to hold the text (each decodes to one character or more, but for
            # pieces of a character: a few more)
            self._recent = (self._recent + [token])[-(len(self._waiting_for) + 4):]
            if self._waiting_for in self._decode(self._recent):  # it starts after this one
                self._waiting_for, self._recent = None, []
            return True
        return self._matcher.accept_token(token)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and one of its stop tokens was accepted."""
        return not self.waiting and self._matcher.is_terminated()


class GrammarBackend:
    """The engine's xgrammar compiler over its tokenizer's vocabulary, with the compiled
    constraints cached. Safe to call from several threads (the server compiles off its event
    loop, the engine thread builds matchers)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        require("structured", "structured outputs")
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=8, cache_enabled=False)
        self._compiled: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # constraints compiled (cache misses)

    def compile(self, spec: StructuredOutputsParams):
        """The constraint's compiled grammar, compiled on first use; ValueError naming the
        field when xgrammar cannot compile it."""
        key = spec.key
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        compiled = self._compile(spec)
        with self._lock:
            self._compiled[key] = compiled
            self.num_compiled += 1
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams):
        kind, compiler = spec.kind, self._compiler
        # vLLM's disable_any_whitespace: no whitespace, and none after the separators either
        whitespace = dict(any_whitespace=not spec.disable_any_whitespace,
                          separators=(",", ":") if spec.disable_any_whitespace else None)
        try:
            if kind == "json":
                return compiler.compile_json_schema(spec.json, **whitespace)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', **whitespace)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except Exception as e:  # noqa: BLE001 - xgrammar's errors are RuntimeError and others
            what = {"json": "a JSON schema xgrammar can compile",
                    "json_object": "true", "regex": "a regular expression xgrammar can compile",
                    "choice": "a list of strings", "grammar": "an EBNF grammar xgrammar can "
                    "compile (rule root first)"}[kind]
            raise ValueError(f"structured_outputs.{kind} must be {what}: "
                             f"{str(e).strip()[:500]}") from e

    def request_grammar(self, spec: StructuredOutputsParams, stop_token_ids: Sequence[int],
                        decode: Callable[[list[int]], str] | None = None) -> RequestGrammar:
        """A new matcher of the constraint. stop_token_ids end the output where the grammar
        is complete (vLLM's: EOS and the request's stop_token_ids); `decode` (token ids to
        text, special tokens kept): how a grammar with starts_after reads the output."""
        if spec.starts_after is not None and decode is None:
            raise ValueError("structured_outputs.starts_after needs the tokenizer to read the "
                             "output")
        matcher = self._xgr.GrammarMatcher(self.compile(spec),
                                           override_stop_tokens=list(stop_token_ids) or None)
        return RequestGrammar(matcher, self.vocab_size, spec.starts_after, decode)
