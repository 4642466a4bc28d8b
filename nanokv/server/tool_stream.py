"""Tool calls of a streamed chat answer (`stream: true` with `tools`): the answer's content
pieces in, each chunk's `delta` parts out, so that a client concatenating a call's deltas gets
what the whole answer's message holds (`tool_calls.answer_tool_calls`).

Every call goes out in the chunk that completes it, as one `tool_calls` entry: `{"index",
"id", "type": "function", "function": {"name", "arguments"}}` (the OpenAI stream format; vLLM
sends the same fields, its arguments in smaller pieces). By tool choice:
- "auto", hermes: the text before the first `<tool_call>` is `content` (blank text before a
  call is dropped, as the whole answer's is); each `<tool_call>{...}</tool_call>` block is a
  call once it closes (an unclosed last block once the answer ends); other text after the first
  block is dropped. A block that is not JSON with `name` and `arguments` goes out as content
  text, and so does everything after it (the whole answer would be all content; calls already
  sent stay sent).
- "auto", llama3_json: as vLLM's stream, an answer that starts with `<|python_tag|>` or `{` is
  calls, each JSON object one once it closes (text between them dropped), and any other answer
  is content as it comes (the whole answer's parse also finds calls after text: then the two
  differ, as vLLM's do). An object that is not a call goes out as content with all after it.
- "auto", pythonic: as vLLM's stream, an answer that starts with `[` is read as a list of
  calls, here whole once the answer ends (the calls, or all its text as content when it is not
  one); any other answer is content as it comes.
- "auto", mistral: the text before the first `[TOOL_CALLS]` is `content` (blank text before a
  call dropped); after a marker, pre-v11's JSON array sends each `{"name", "arguments"}` item
  once it closes (a single object once it closes), v11+'s `name[ARGS]{...}` once its arguments
  close; text after a call that is no marker is dropped. What is not a call goes out as content,
  with everything after it.
- "required": each item of the constrained JSON array `[{"name", "parameters"}, ...]` is a call
  once its object closes; no content.
- a named function: the answer is the call's arguments, sent as it comes: the first piece with
  the call's id, type and name, the rest as `arguments` alone; no content.
"""

from __future__ import annotations

import json

from nanokv.server.tool_calls import (MISTRAL_CALLS, MISTRAL_FUNCTION, MISTRAL_NAME, NOT_A_CALL,
                                      PYTHON_TAG, finish_reason, hermes_call, llama3_call,
                                      mistral_listed_call, mistral_named_call, parse_pythonic,
                                      required_call, tool_call)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class ToolCallStream:
    """One streamed answer's tool calls. `feed(piece)` and then `finish()` each return
    (content, tool_calls): the text and the `delta.tool_calls` entries this piece completes
    ("" and [] for none). `called`: whether a call went out."""

    def __init__(self, choice: str, name: str | None = None, parser: str = "hermes") -> None:
        self.choice, self.name, self.parser = choice, name, parser
        self.calls = 0  # calls sent
        self.pending = ""  # text not yet decided on
        # "auto"
        self.in_block = False  # inside a <tool_call> block
        self.plain = False  # a block was not a call: everything is content from here on
        self.sent_content = False  # content went out (blank text after it is content too)
        self.blank = ""  # blank text before the first block, dropped unless all is content
        self.objects = JsonObjects(2 if choice == "required" else 1)  # required, llama3_json
        self.answer_is_calls: bool | None = None  # llama3_json, pythonic: None until it starts
        # mistral: after the first marker, the open call's name (None: a pre-v11 list or
        # object) and JSON scanner (None: between calls)
        self.call_name: str | None = None
        self.call_json: JsonObjects | None = None
        self.call_text = ""  # the open call's text so far, its markers and name included

    @property
    def called(self) -> bool:
        return self.calls > 0

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """The choice's finish_reason (the whole answer's rule: `tool_calls.finish_reason`)."""
        return finish_reason(self.choice, self.called, engine_reason)

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        self.pending += piece
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, list[dict]]:
        if self.choice == "auto" and self.parser == "llama3_json":
            return self._llama3(final)
        if self.choice == "auto" and self.parser == "pythonic":
            return self._pythonic(final)
        if self.choice == "auto" and self.parser == "mistral":
            return self._mistral(final)
        if self.choice == "auto":
            return self._auto(final)
        if self.choice == "required":
            return "", self._required()
        return "", self._named()

    def _entry(self, call: dict) -> dict:
        self.calls += 1
        return {"index": self.calls - 1, **call}

    # -- "auto": hermes blocks --------------------------------------------------------------------
    def _auto(self, final: bool) -> tuple[str, list[dict]]:
        content, calls = [], []
        while not self.plain:
            if self.in_block:
                end = self.pending.find(CLOSE)
                if end < 0 and not final:
                    break  # the block goes on
                block, rest = (self.pending, "") if end < 0 else (
                    self.pending[:end], self.pending[end + len(CLOSE):])
                call = self._hermes(block)
                if call is None:  # not a call: its text and all after it are content
                    self.plain, self.pending = True, self.blank + OPEN + self.pending
                    break
                calls.append(call)
                self.in_block, self.pending = False, rest
                continue
            start = self.pending.find(OPEN)
            if start >= 0:
                before = self.pending[:start]
                if not self.calls:  # the content before the first block (blank: dropped)
                    if self.sent_content or before.strip():
                        content.append(before)
                    else:
                        self.blank = before
                self.in_block, self.pending = True, self.pending[start + len(OPEN):]
                continue
            keep = 0 if final else _partial_suffix(self.pending, OPEN)
            ready = self.pending[:len(self.pending) - keep]
            if self.calls:  # text between and after blocks: dropped
                self.pending = self.pending[len(ready):]
            elif final or self.sent_content or ready.strip():  # blank text waits
                content.append(ready)
                self.pending = self.pending[len(ready):]
            break
        return self._emit(content, calls)

    def _emit(self, content: list[str], calls: list[dict]) -> tuple[str, list[dict]]:
        """A piece's (content, calls), and all text still waiting once nothing more can be a
        call ("auto": hermes, mistral)."""
        if self.plain:
            content.append(self.pending)
            self.pending = ""
        text = "".join(content)
        self.sent_content = self.sent_content or bool(text)
        return text, calls

    def _hermes(self, block: str) -> dict | None:
        try:
            return self._entry(hermes_call(block))
        except NOT_A_CALL:
            return None

    # -- "auto", mistral: [TOOL_CALLS] markers ---------------------------------------------------
    def _mistral(self, final: bool) -> tuple[str, list[dict]]:
        content, calls = [], []
        if not self.in_block and not self.plain:  # before the first marker: content
            start = self.pending.find(MISTRAL_CALLS)
            if start >= 0:
                before = self.pending[:start]
                if self.sent_content or before.strip():
                    content.append(before)
                else:
                    self.blank = before  # blank text before a call: dropped
                self.in_block, self.pending = True, self.pending[start:]
            else:
                keep = 0 if final else _partial_suffix(self.pending, MISTRAL_CALLS)
                ready = self.pending[:len(self.pending) - keep]
                if final or self.sent_content or ready.strip():
                    content.append(ready)
                    self.pending = self.pending[len(ready):]
        while self.in_block and not self.plain and self.pending:
            if self.call_json is None and not self._mistral_start(final):
                break
            calls += self._mistral_feed()
            if self.call_json is not None:  # the call goes on
                break
        if final and self.call_json is not None and not self.plain:  # cut short: content
            self.plain, self.pending = True, self.call_text
        return self._emit(content, calls)

    def _mistral_start(self, final: bool) -> bool:
        """At a call's start (markers, then a list, an object or a name): open it; False when
        it cannot start yet (more text to come, or none: then content from here on)."""
        self.pending = _after_marker(self.pending)  # text after a call up to a marker: dropped
        if not self.pending.startswith(MISTRAL_CALLS):  # a marker still coming, or none
            if final:
                self.pending = ""
            return False
        body = self.pending
        while body.startswith(MISTRAL_CALLS):
            body = body[len(MISTRAL_CALLS):].lstrip()
        if not body or MISTRAL_CALLS.startswith(body):  # the next marker still coming, or the end
            if final and not self.calls:  # markers and nothing after: all content
                self.plain, self.pending = True, self.blank + self.pending
            elif final:
                self.pending = ""
            return False
        head = self.pending[:len(self.pending) - len(body)]  # the markers before it
        match = MISTRAL_NAME.match(body)
        if body[0] in "[{":
            self.call_name, self.call_json = None, JsonObjects(2 if body[0] == "[" else 1)
            self.call_text, self.pending = head, body
        elif match is not None:
            self.call_name, self.call_json = match.group(1), JsonObjects(1)
            self.call_text, self.pending = head + body[:match.end()], body[match.end():]
        elif final or not _may_name(body):  # no call here: it and all after it are content
            self.plain = True
            if not self.calls:
                self.pending = self.blank + self.pending
            return False
        else:
            return False  # a name still coming
        return True

    def _mistral_feed(self) -> list[dict]:
        """The calls the open call's text completes: an object (a name's arguments, or one
        pre-v11 call) or a pre-v11 list's items; the call is done when its object or list
        closes, and the text after it is dropped up to the next marker."""
        calls = []
        for at, ch in enumerate(self.pending):
            self.call_text += ch
            for obj, _ in self.call_json.feed(ch):
                call = self._mistral_call(obj)
                if call is None:  # not a call: its text and all after it are content
                    self.plain, self.pending = True, self.call_text + self.pending[at + 1:]
                    return calls
                calls.append(call)
            if self.call_json.depth == 0:
                self.call_json, self.pending = None, self.pending[at + 1:]
                return calls
        self.pending = ""
        return calls

    def _mistral_call(self, obj: str) -> dict | None:
        try:
            if self.call_name is None:
                return self._entry(mistral_listed_call(json.loads(obj)))
            return self._entry(mistral_named_call(self.call_name, json.loads(obj)))
        except (*NOT_A_CALL, json.JSONDecodeError):
            return None

    # -- "required": the items of a JSON array ----------------------------------------------------
    def _required(self) -> list[dict]:
        calls = []
        for item, _ in self.objects.feed(self.pending):
            try:
                calls.append(self._entry(required_call(json.loads(item), self.parser)))
            except NOT_A_CALL:
                pass  # not a call (the constraint makes every item one)
        self.pending = ""
        return calls

    # -- "auto", llama3_json: JSON objects -----------------------------------------------------
    def _llama3(self, final: bool) -> tuple[str, list[dict]]:
        if self.answer_is_calls is None:  # calls or content: the answer's first characters say
            text = self.pending
            if not final and PYTHON_TAG.startswith(text):  # (or nothing yet)
                return "", []
            self.answer_is_calls = text.startswith((PYTHON_TAG, "{"))
            if text.startswith(PYTHON_TAG):
                self.pending = text[len(PYTHON_TAG):]
        if self.plain or not self.answer_is_calls:  # content as it comes
            out, self.pending = self.pending, ""
            return out, []
        calls = []
        fed, self.pending = self.pending, ""
        for obj, end in self.objects.feed(fed):
            try:
                calls.append(self._entry(llama3_call(json.loads(obj))))
            except NOT_A_CALL:  # not a call: content from here on
                self.plain = True
                return obj + fed[end:], calls
        if final and self.objects.open():  # an object cut short: content
            return self.objects.rest(), calls
        return "", calls

    # -- "auto", pythonic: a Python list of calls -------------------------------------------------
    def _pythonic(self, final: bool) -> tuple[str, list[dict]]:
        if self.answer_is_calls is None:
            if not self.pending:
                return "", []
            self.answer_is_calls = self.pending.startswith("[")
        if not self.answer_is_calls:  # content as it comes
            out, self.pending = self.pending, ""
            return out, []
        if not final:  # the list is read whole, at the end
            return "", []
        calls, content = parse_pythonic(self.pending)
        self.pending = ""
        return content or "", [self._entry(call) for call in calls]

    # -- a named function: the answer is its arguments --------------------------------------------
    def _named(self) -> list[dict]:
        if not self.calls and not self.pending.strip():
            return []  # the call starts with its arguments' first text (none: no call)
        out, self.pending = self.pending, ""
        if not self.calls:
            return [self._entry(tool_call(self.name, out, self.parser))]
        return [{"index": 0, "function": {"arguments": out}}] if out else []


def _after_marker(text: str) -> str:
    """Mistral: what follows a call, from its next marker on (other text is dropped)."""
    at = text.find(MISTRAL_CALLS)
    return text[at:] if at >= 0 else text[len(text) - _partial_suffix(text, MISTRAL_CALLS):]


def _may_name(text: str) -> bool:
    """Mistral: whether text may still become `name[ARGS]{`."""
    name = text.split("[", 1)[0].rstrip()
    return (bool(MISTRAL_FUNCTION.fullmatch(name))
            and ("[" not in text or "[ARGS]".startswith("[" + text.split("[", 1)[1].strip())))


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (and is shorter)."""
    return max((k for k in range(1, len(marker)) if text.endswith(marker[:k])), default=0)


class JsonObjects:
    """The JSON objects of a text fed in pieces whose `{` opens at nesting depth `level` (1: top
    level; 2: the items of an array), each returned once its `}` arrives, with where it ended
    in the piece; other text between them is dropped. Strings and their escapes are followed,
    so brackets inside them count for nothing."""

    def __init__(self, level: int) -> None:
        self.level = level
        self.depth = 0
        self.in_string = self.escaped = False
        self.current: str | None = None  # the open object's text so far (None: none open)

    def open(self) -> bool:
        return self.current is not None

    def rest(self) -> str:
        """The open object's text, given up (the scan starts over)."""
        out = self.current or ""
        self.current, self.depth, self.in_string, self.escaped = None, 0, False, False
        return out

    def feed(self, text: str) -> list[tuple[str, int]]:
        done = []
        for at, ch in enumerate(text):
            if ch == "{" and not self.in_string and self.depth == self.level - 1:
                self.current = ""
            if self.current is not None:
                self.current += ch
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
            elif ch in "]}":
                self.depth = max(self.depth - 1, 0)  # a stray closing bracket: ignored
                if self.current is not None and self.depth == self.level - 1:
                    done.append((self.current, at + 1))
                    self.current = None
        return done
