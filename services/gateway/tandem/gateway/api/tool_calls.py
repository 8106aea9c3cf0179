"""From the text a tool-constrained answer generated to OpenAI tool calls, whole
or as stream deltas.

Called by the response writers (:mod:`tandem.gateway.api.complete` with the whole
text, :mod:`tandem.gateway.api.streaming` delta by delta) for a request whose
:class:`~tandem.gateway.api.tools.ToolSpec` constrains the answer; pure. Both go
through one :class:`ToolCallReader`, so a streamed answer's deltas always add up
to the non-streamed answer of the same text.

* Named choice: the whole text is the one call's ``arguments``.
* ``"required"``: the text is a JSON array of ``{"name", "parameters"}`` objects;
  one string- and nesting-aware pass (vLLM's ``_scan_required_tool_calls`` in
  ``vllm/tool_parsers/streaming.py``, made incremental here: each character is
  read once) finds each item's name and the span of its ``parameters`` value,
  and that span's text, as generated, is the call's ``arguments``. A call is
  announced once its name is complete and its parameters have begun.

Deltas follow OpenAI (and vLLM): a call's first delta carries ``index``, ``id``,
``type``, ``function.name`` and ``arguments: ""``; the next ones only ``index``
and an ``arguments`` fragment. Finish reason as OpenAI and vLLM: ``"tool_calls"``
for ``"required"``, ``"stop"`` for a named choice, ``"length"`` whenever the
answer was cut (its arguments are then incomplete JSON, as vLLM returns them).

When the model's text holds no call at all (the grammar rules this out unless
the answer was cut before a call's parameters began), the text is the answer's
``content``, never lost.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from tandem.gateway.api.tools import ToolSpec


def new_tool_call_id() -> str:
    """``call_`` and 24 random characters, as OpenAI's ids."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def finish_reason(spec: ToolSpec, engine_finish_reason: str) -> str:
    """OpenAI's finish reason for a tool-constrained answer that ended with ``engine_finish_reason``."""
    if spec.mode == "required" and engine_finish_reason == "stop":
        return "tool_calls"
    return engine_finish_reason


def tool_calls_of(spec: ToolSpec, text: str) -> list[ToolCall]:
    """The tool calls in a whole answer's ``text`` (none: the text is content)."""
    reader = ToolCallReader(spec)
    reader.feed(text)
    return reader.calls


# Where the scan is inside one item of the "required" array.
_EXPECT_KEY, _EXPECT_COLON, _EXPECT_VALUE, _IN_STRING, _IN_CONTAINER, _IN_SCALAR, _AFTER_VALUE = range(7)


@dataclass
class _Item:
    """One item of the ``"required"`` array, as far as it was read."""

    name: str | None = None
    #: Offsets of its parameters value in the text; end None while it is still being generated.
    args_start: int | None = None
    args_end: int | None = None


@dataclass
class ToolCallReader:
    """Reads a tool-constrained answer as it is generated; :meth:`feed` returns the OpenAI
    ``delta.tool_calls`` entries that the new text completes."""

    spec: ToolSpec
    calls: list[ToolCall] = field(default_factory=list)
    #: The answer so far (a few thousand characters at most: answers are bounded by max_tokens).
    text: str = ""
    # The "required" scan's state (vLLM's, kept across feeds).
    _items: list[_Item] = field(default_factory=list)
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _string_start: int = 0
    _expect: int = _EXPECT_KEY
    _key: str | None = None
    _value_start: int = 0
    _done: bool = False
    #: Characters of each announced call's parameters already handed out.
    _sent_ends: list[int] = field(default_factory=list)

    def feed(self, delta: str) -> list[dict[str, Any]]:
        if not delta:
            return []
        start = len(self.text)
        self.text += delta
        if self.spec.mode == "named":
            return self._feed_named(delta)
        if not self._done:
            self._scan(self.text, start)
        return self._new_required_deltas(self.text)

    def _feed_named(self, delta: str) -> list[dict[str, Any]]:
        deltas = []
        if not self.calls:
            assert self.spec.name is not None
            call = ToolCall(new_tool_call_id(), self.spec.name)
            self.calls.append(call)
            deltas.append(_first_delta(0, call))
        self.calls[0].arguments += delta
        deltas.append(_arguments_delta(0, delta))
        return deltas

    def _new_required_deltas(self, text: str) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for index, item in enumerate(self._items):
            if item.name is None or item.args_start is None:
                break  # items are generated in order: nothing later is ready
            end = item.args_end if item.args_end is not None else len(text)
            if index == len(self.calls):
                self.calls.append(ToolCall(new_tool_call_id(), item.name))
                self._sent_ends.append(item.args_start)
                deltas.append(_first_delta(index, self.calls[index]))
            sent = self._sent_ends[index]
            if end > sent:
                fragment = text[sent:end]
                self.calls[index].arguments += fragment
                self._sent_ends[index] = end
                deltas.append(_arguments_delta(index, fragment))
        return deltas

    def _scan(self, text: str, start: int) -> None:
        for i in range(start, len(text)):
            ch = text[i]
            item = self._items[-1] if self._items and self._depth >= 2 else None
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 2 and item is not None:
                        if self._expect == _EXPECT_KEY:
                            self._key = text[self._string_start + 1 : i]
                            self._expect = _EXPECT_COLON
                        elif self._expect == _IN_STRING:
                            self._end_value(item, text, i + 1)
                continue
            if ch == '"':
                self._in_string = True
                self._string_start = i
                if self._depth == 2 and item is not None and self._expect == _EXPECT_VALUE:
                    self._start_value(item, i, _IN_STRING)
                continue
            if ch in "{[":
                if (self._depth == 0 and ch != "[") or (self._depth == 1 and ch != "{"):
                    self._done = True
                    return
                if self._depth == 1:
                    self._items.append(_Item())
                    self._expect, self._key = _EXPECT_KEY, None
                elif self._depth == 2 and item is not None and self._expect == _EXPECT_VALUE:
                    self._start_value(item, i, _IN_CONTAINER)
                self._depth += 1
                continue
            if ch in "}]":
                if self._depth == 2 and item is not None and self._expect == _IN_SCALAR:
                    self._end_value(item, text, i)
                self._depth -= 1
                if self._depth == 2 and item is not None and self._expect == _IN_CONTAINER:
                    self._end_value(item, text, i + 1)
                elif self._depth <= 0:
                    self._done = True
                    return
                continue
            if self._depth != 2 or item is None:
                continue
            if ch == ":":
                if self._expect == _EXPECT_COLON:
                    self._expect = _EXPECT_VALUE
            elif ch == ",":
                if self._expect == _IN_SCALAR:
                    self._end_value(item, text, i)
                self._expect, self._key = _EXPECT_KEY, None
            elif ch.isspace():
                if self._expect == _IN_SCALAR:
                    self._end_value(item, text, i)
            elif self._expect == _EXPECT_VALUE:
                self._start_value(item, i, _IN_SCALAR)

    def _start_value(self, item: _Item, position: int, state: int) -> None:
        self._value_start = position
        if self._key == "parameters":
            item.args_start = position
        self._expect = state

    def _end_value(self, item: _Item, text: str, position: int) -> None:
        if self._key == "parameters":
            item.args_end = position
        elif self._key == "name" and self._expect == _IN_STRING:
            try:
                name = json.loads(text[self._value_start : position])
            except ValueError:
                name = None  # not a JSON string: this call never becomes ready
            item.name = name if isinstance(name, str) else None
        self._expect = _AFTER_VALUE


def _first_delta(index: int, call: ToolCall) -> dict[str, Any]:
    return {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}


def _arguments_delta(index: int, fragment: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": fragment}}
