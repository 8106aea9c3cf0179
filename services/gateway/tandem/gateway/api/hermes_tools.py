"""Tool calls in a model's own words, for ``tool_choice: "auto"``: text and Hermes-style
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, read into content and OpenAI tool
calls, whole or as the answer streams.

Called by the wire formats (:mod:`~tandem.gateway.api.tool_wire`,
:mod:`~tandem.gateway.api.responses_wire`, :mod:`~tandem.gateway.api.anthropic_tool_wire`) for a
request whose :class:`~tandem.gateway.api.tools.ToolSpec` is ``"auto"``, which the gateway renders with
a tool-capable chat template (``templates/smollm2_tools.jinja`` for the default model). Pure.

The format and the whole-answer reading are vLLM's ``Hermes2ProToolParser``
(``vllm/tool_parsers/hermes_tool_parser.py`` in vLLM 0.32): a call is the JSON object between
``<tool_call>`` and ``</tool_call>``, or after a last ``<tool_call>`` the model never closed; its
``arguments`` are re-serialized with ``json.dumps(..., ensure_ascii=False)``; the text before the first
call is the content. That class is not imported: the gateway may not import vLLM (the import-linter
contract in pyproject.toml; vLLM pulls in torch), and the parser needs vLLM's request and tokenizer
objects. ``tests/unit/gateway/test_hermes_tools.py`` checks this reading against vLLM's class on the
same texts. Where this module differs from vLLM, on purpose:

* A block is a call only if it is valid for a declared tool: a JSON object whose ``name`` is one of the
  request's tools and whose ``arguments`` is a JSON object. Any other block stays text, in place (vLLM
  turns the whole answer into text when one block is not JSON, and returns calls to undeclared names).
  With ``parallel_tool_calls`` false, blocks after the first call stay text.
* The content is every text outside the calls, not only the text before the first one, so no text the
  model wrote is lost; content that is only whitespace beside calls is null (vLLM's is ``None`` when
  empty).
* A stream announces a call once its block is closed (or the answer ends) and found valid: its first
  delta (``id``, ``type``, ``name``, ``arguments: ""``) and one delta with the whole arguments. vLLM
  streams argument fragments before it knows the block is valid JSON, so its streamed calls can differ
  from its non-streamed ones; here the deltas always add up to the non-streamed answer of the same text.
  Text streams as content as it comes, except a tail that may begin ``<tool_call>`` (held until it
  cannot) and whitespace before any other content (held until text follows; dropped when the answer
  is only calls).

``finish_reason`` is ``"tool_calls"`` when the answer made a call, as vLLM's server answers.

**The Llama JSON form** (``ToolSpec.call_format == "llama3_json"``: Llama 3.1 with Tandem's copy of vLLM's
``tool_chat_template_llama3.1_json.jinja``) is read by the same reader: the whole answer, after any leading
whitespace and an optional ``<|python_tag|>``, is one or more JSON objects ``{"name": ..., "parameters":
{...}}`` (``"arguments"`` also accepted, and preferred when both are there, as vLLM's
``Llama3JsonToolParser``) separated by ``;``. Each object is checked by the same rule as a Hermes block (a
declared tool, an object of arguments; with ``parallel_tool_calls`` false, objects after the first stay
text, from the second object on, without the ``;`` before it). An answer that begins with ``{`` or
``<|python_tag|>`` is held whole until it ends, then is calls only if every object is a valid call and
nothing but separators lies between them; otherwise it is all text. Where this differs from vLLM, on
purpose: an answer that begins with other text is text (vLLM's streaming reader says so too, while its
whole-answer reader also takes JSON objects found later in the text, so its two readings of one answer can
differ).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tandem.gateway.api.tool_calls import ToolCall, new_tool_call_id
from tandem.gateway.api.tools import ToolSpec

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
#: What Llama 3.1 may write before its JSON calls (a special token: absent when the worker drops those).
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class Text:
    """Content text, in the order written."""

    text: str


@dataclass(frozen=True)
class Call:
    """A whole, valid tool call; ``index`` counts the answer's calls from 0."""

    index: int
    call: ToolCall


Event = Text | Call


def finish_reason(has_calls: bool, engine_finish_reason: str) -> str:
    """OpenAI's finish reason for an ``auto`` answer (vLLM's: ``tool_calls`` whenever a call was made)."""
    return "tool_calls" if has_calls else engine_finish_reason


def _partial_start(text: str) -> int:
    """How many characters at the end of ``text`` begin ``<tool_call>`` (0 when none do)."""
    for n in range(min(len(text), len(CALL_START) - 1), 0, -1):
        if CALL_START.startswith(text[-n:]):
            return n
    return 0


@dataclass
class HermesReader:
    """Reads an ``auto`` answer as it is generated: :meth:`feed` each text delta, then :meth:`close`
    once; both return the :data:`Event` s the text completes."""

    spec: ToolSpec
    calls: list[ToolCall] = field(default_factory=list)
    #: The content handed out so far.
    content: str = ""
    #: Text not yet decided: a tail that may begin ``<tool_call>``, or an open call block.
    _pending: str = ""
    #: Whitespace before any content, held until text follows (dropped when the answer is only calls).
    _held_whitespace: str = ""
    _in_call: bool = False
    #: Characters of an open call block already searched for its end tag.
    _num_searched: int = 0
    _closed: bool = False

    #: Llama JSON form only: whether the answer was found to be calls (held whole), text, or not yet known.
    _json_answer: bool | None = None

    def feed(self, delta: str) -> list[Event]:
        assert not self._closed, "the answer was closed"
        self._pending += delta
        if self.spec.call_format == "llama3_json":
            return self._feed_json()
        events: list[Event] = []
        while True:
            if self._in_call:
                # Search only the new text (and an end tag it may complete): each character is read once.
                end = self._pending.find(CALL_END, max(0, self._num_searched - len(CALL_END) + 1))
                if end < 0:
                    self._num_searched = len(self._pending)
                    break
                self._num_searched = 0
                block = self._pending[: end + len(CALL_END)]
                self._pending = self._pending[end + len(CALL_END) :]
                self._in_call = False
                events.extend(self._block(block, block[len(CALL_START) : -len(CALL_END)]))
                continue
            start = self._pending.find(CALL_START)
            if start >= 0:
                events.extend(self._text(self._pending[:start]))
                self._pending = self._pending[start:]
                self._in_call = True
                continue
            sendable = len(self._pending) - _partial_start(self._pending)
            events.extend(self._text(self._pending[:sendable]))
            self._pending = self._pending[sendable:]
            break
        return events

    def close(self) -> list[Event]:
        """The answer ended: an open block is a call if what follows its tag is one, else text."""
        assert not self._closed, "the answer was closed"
        self._closed = True
        pending, self._pending = self._pending, ""
        if self._json_answer:
            events = self._json_calls(pending)
        elif self._in_call:
            self._in_call = False
            events = self._block(pending, pending[len(CALL_START) :])
        else:
            events = self._text(pending)
        if self._held_whitespace and not self.calls:
            held, self._held_whitespace = self._held_whitespace, ""
            self.content += held
            events.append(Text(held))
        return events

    def _feed_json(self) -> list[Event]:
        """The Llama JSON form: decide from the answer's first characters whether it is calls (hold it
        whole until :meth:`close`) or text (stream it as it comes)."""
        if self._json_answer is None:
            start = self._pending.lstrip()
            if not start or (len(start) < len(PYTHON_TAG) and PYTHON_TAG.startswith(start)):
                return []  # not yet known
            self._json_answer = start.startswith(("{", PYTHON_TAG))
        if self._json_answer:
            return []
        pending, self._pending = self._pending, ""
        return self._text(pending)

    def _json_calls(self, answer: str) -> list[Event]:
        """A whole Llama JSON answer: its calls, or all of it as text when any part is not a valid call."""
        body = answer.lstrip()
        body = body.removeprefix(PYTHON_TAG)
        decoder = json.JSONDecoder()
        # (start, end) of each object in ``answer``; the parse fails on anything but objects and separators.
        spans: list[tuple[int, int]] = []
        at = len(answer) - len(body)
        while True:
            at += len(answer[at:]) - len(answer[at:].lstrip())
            if at == len(answer):
                break
            if spans:
                if answer[at] != ";":
                    return self._text(answer)
                at += 1
                at += len(answer[at:]) - len(answer[at:].lstrip())
            try:
                _, end = decoder.raw_decode(answer, at)
            except (ValueError, RecursionError):
                return self._text(answer)
            spans.append((at, end))
            at = end
        calls = [self._call(answer[start:end], "parameters") for start, end in spans[:1]]
        if not spans or calls[0] is None:
            return self._text(answer)
        for start, end in spans[1:]:
            if not self.spec.parallel_tool_calls:
                break
            call = self._call(answer[start:end], "parameters")
            if call is None:
                return self._text(answer)
            calls.append(call)
        events: list[Event] = []
        for call in calls:
            assert call is not None
            self.calls.append(call)
            events.append(Call(len(self.calls) - 1, call))
        if len(calls) < len(spans):  # parallel_tool_calls false: the objects after the first stay text,
            # from the second one on (the separator between the call and them is neither).
            events.extend(self._text(answer[spans[1][0] :]))
        return events

    def _text(self, text: str) -> list[Event]:
        if not text:
            return []
        if not self.content and not text.strip():
            self._held_whitespace += text
            return []
        text, self._held_whitespace = self._held_whitespace + text, ""
        self.content += text
        return [Text(text)]

    def _block(self, block: str, body: str) -> list[Event]:
        call = self._call(body)
        if call is None:
            return self._text(block)
        self.calls.append(call)
        return [Call(len(self.calls) - 1, call)]

    def _call(self, body: str, arguments_alias: str | None = None) -> ToolCall | None:
        """``body`` as a call of a declared tool, or None. ``arguments_alias``: another key the arguments may
        be under (Llama's ``parameters``), read when ``arguments`` is absent."""
        if self.calls and not self.spec.parallel_tool_calls:
            return None
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):  # nested deeper than json's recursion allows: not a call either
            return None
        if not isinstance(value, dict):
            return None
        key = "arguments" if arguments_alias is None or "arguments" in value else arguments_alias
        name, arguments = value.get("name"), value.get(key)
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return None
        if not any(tool.name == name for tool in self.spec.tools):
            return None
        return ToolCall(new_tool_call_id(), name, json.dumps(arguments, ensure_ascii=False))


def read_whole(spec: ToolSpec, text: str) -> tuple[list[Event], str | None, list[ToolCall]]:
    """A whole ``auto`` answer: its events in order, its content (None: no text beside the calls) and calls."""
    reader = HermesReader(spec)
    events = reader.feed(text) + reader.close()
    return events, (reader.content if reader.content or not reader.calls else None), reader.calls


def call_deltas(index: int, call: ToolCall) -> list[dict[str, Any]]:
    """A whole call as OpenAI's ``delta.tool_calls`` entries: its announcement, then its arguments."""
    return [
        {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}},
        {"index": index, "function": {"arguments": call.arguments}},
    ]
