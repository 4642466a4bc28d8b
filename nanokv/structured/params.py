"""vLLM's `StructuredOutputsParams`: the one constraint a request's output must satisfy. Plain
data, no xgrammar: validated here, compiled by `nanokv/structured/xgrammar_backend.py`."""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """Exactly one of:

    json: a JSON schema (a dict, or its JSON text); the output is a JSON value it accepts.
    json_object: True; the output is any JSON object (OpenAI's `json_object` format).
    regex: the output matches this regular expression (as a whole).
    choice: the output is one of these strings.
    grammar: an EBNF grammar (xgrammar's / llama.cpp's GBNF dialect, rule `root` first).

    disable_any_whitespace: JSON without whitespace between its tokens (no newlines or runs of
    spaces a model could fill its token budget with); vLLM sets it engine-wide, nanokv per
    request.
    starts_after: a text; the constraint holds only for the output's tokens after the one that
    completes its first occurrence (the text is read as the tokens come, decoded; those tokens
    are free): a reasoning model's end marker "</think>", as vLLM's reasoning parsers exempt
    the reasoning. The server sets it under --reasoning-parser; None (the default): from the
    first token.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    starts_after: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError unless exactly one constraint is set, of the right type."""
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            what = f"{len(given)} are set ({', '.join(given)})" if given else "none is set"
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; "
                             f"{what}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json must be a JSON schema (an "
                                     f"object, or its JSON text); the text is not JSON: "
                                     f"{e}") from e
            _check(isinstance(schema, dict),
                   f"structured_outputs.json must be a JSON schema (an object, or its JSON "
                   f"text), got {self.json!r:.200}")
            try:
                json.dumps(schema)
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_outputs.json must be a JSON schema (plain JSON "
                                 f"values): {e}") from e
        _check(self.json_object in (None, True),
               f"structured_outputs.json_object must be true (or left out), got "
               f"{self.json_object!r}")
        _check(self.regex is None or (isinstance(self.regex, str) and bool(self.regex)
                                      and "\x00" not in self.regex),
               f"structured_outputs.regex must be a non-empty string without NUL characters, "
               f"got {self.regex!r:.200}")
        _check(self.choice is None
               or (isinstance(self.choice, (list, tuple)) and bool(self.choice)
                   and all(isinstance(c, str) and c for c in self.choice)),
               f"structured_outputs.choice must be a non-empty list of non-empty strings, got "
               f"{self.choice!r:.200}")
        if self.choice is not None:
            self.choice = list(self.choice)
        _check(self.grammar is None
               or (isinstance(self.grammar, str) and bool(self.grammar.strip())),
               f"structured_outputs.grammar must be a non-empty EBNF grammar string, got "
               f"{self.grammar!r:.200}")
        _check(isinstance(self.disable_any_whitespace, bool),
               f"structured_outputs.disable_any_whitespace must be true or false, got "
               f"{self.disable_any_whitespace!r}")
        _check(self.starts_after is None
               or (isinstance(self.starts_after, str) and bool(self.starts_after)),
               f"structured_outputs.starts_after must be a non-empty string (the text after "
               f"which the constraint starts), got {self.starts_after!r:.200}")

    @property
    def kind(self) -> str:
        """The constraint's field name: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def key(self) -> tuple:
        """Equal for constraints that compile to the same grammar (the compile cache's key)."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            value = json.dumps(schema, sort_keys=True)
        elif self.kind == "choice":
            value = tuple(value)
        whitespace = self.disable_any_whitespace and self.kind in ("json", "json_object")
        return self.kind, value, whitespace


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
