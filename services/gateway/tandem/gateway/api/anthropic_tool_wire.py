"""Anthropic Messages whose answer is a tool call: the :class:`~tandem.gateway.api.wire.WireFormat` the route
handler picks for ``/v1/messages`` when the request's tools constrain the answer (``tool_choice`` ``any`` or
``tool``; :mod:`tandem.gateway.api.tools`).

Called by the response writers through the ``WireFormat`` seam; reads the calls with the chat API's own
:class:`~tandem.gateway.api.tool_calls.ToolCallReader` (so both APIs see the same calls in the same text)
and writes every event and error as :mod:`~tandem.gateway.api.anthropic_wire` does. Pure: no I/O.

* A message: one ``tool_use`` block per call (``id``, ``name``, ``input``: the arguments parsed), and
  ``stop_reason`` ``tool_use``. An answer cut at ``max_tokens`` holds incomplete JSON: its text is then a
  ``text`` block, whole, with ``stop_reason`` ``max_tokens``, as is an answer that holds no call at all.
* A stream: ``message_start`` and ``ping``; per call a ``content_block_start`` (``tool_use`` with
  ``input: {}``), its arguments as ``input_json_delta`` fragments in the order generated, and a
  ``content_block_stop``; then ``message_delta`` and ``message_stop``. The SDK's accumulator parses
  the fragments into ``input``.
* ``tool_choice`` ``auto`` (:mod:`~tandem.gateway.api.hermes_tools` reads the model's own syntax): the
  blocks follow the answer in order, each run of text a ``text`` block and each call a ``tool_use``
  block (streamed whole, once its block is closed); ``stop_reason`` ``tool_use`` when a call was made.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tandem.gateway.api.anthropic_wire import (
    PING,
    block_delta,
    block_start,
    block_stop,
    error_body,
    event,
    message,
    message_end,
    message_start,
    stop_reason,
    usage_dict,
)
from tandem.gateway.api.errors import ApiError
from tandem.gateway.api.hermes_tools import Event, HermesReader, Text, read_whole
from tandem.gateway.api.tool_calls import ToolCall, ToolCallReader, tool_calls_of
from tandem.gateway.api.tools import ToolSpec
from tandem.gateway.job import Finished
from tandem.gateway.sse import ResponseMeta
from tandem.v1 import common_pb2


def _stop_reason(finished: Finished, has_calls: bool) -> str:
    return "tool_use" if has_calls and finished.finish_reason != "length" else stop_reason(finished)


def _tool_use_blocks(calls: Sequence[ToolCall]) -> list[dict[str, Any]] | None:
    """The calls as ``tool_use`` blocks; None when an argument text is not a JSON object (cut short)."""
    blocks = []
    for call in calls:
        try:
            arguments = json.loads(call.arguments)
        except ValueError:
            return None
        if not isinstance(arguments, dict):
            return None
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": arguments})
    return blocks


class _ToolUseStream:
    def __init__(self, meta: ResponseMeta, num_prompt_tokens: int, spec: ToolSpec) -> None:
        self._meta = meta
        self._num_prompt_tokens = num_prompt_tokens
        self._reader = ToolCallReader(spec)
        #: The index of the open content block (a call's), None before the first and after the last.
        self._open: int | None = None

    def start(self) -> bytes:
        return message_start(self._meta, self._num_prompt_tokens) + PING

    def delta(self, text: str, logprobs: Sequence[common_pb2.TokenLogprobs] = ()) -> bytes:
        out = b""
        for delta in self._reader.feed(text):
            index = delta["index"]
            if "id" in delta:  # a call's first delta: its block begins
                out += self._close()
                out += block_start(
                    index, {"type": "tool_use", "id": delta["id"], "name": delta["function"]["name"], "input": {}}
                )
                self._open = index
            fragment = delta["function"].get("arguments", "")
            if fragment:
                out += block_delta(index, {"type": "input_json_delta", "partial_json": fragment})
        return out

    def finish(self, finished: Finished) -> bytes:
        out = self._close()
        calls = self._reader.calls
        if not calls and self._reader.text:  # no call could be read: the text is the answer
            out += (
                block_start(0, {"type": "text", "text": ""})
                + block_delta(0, {"type": "text_delta", "text": self._reader.text})
                + block_stop(0)
            )
        return out + message_end(_stop_reason(finished, bool(calls)), finished)

    def end(self, timings: dict[str, Any] | None) -> bytes:
        return b""

    def error(self, error: ApiError) -> bytes:
        return event("error", error_body(error))

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        index, self._open = self._open, None
        return block_stop(index)


class _AutoBlocks:
    """The content blocks of an ``auto`` answer, as stream events, from its reader's events in order."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open_text = False

    def add(self, event: Event) -> bytes:
        index = len(self.blocks)
        if isinstance(event, Text):
            out = b""
            if not self._open_text:
                self.blocks.append({"type": "text", "text": ""})
                out, self._open_text = block_start(index, {"type": "text", "text": ""}), True
            self.blocks[-1]["text"] += event.text
            return out + block_delta(len(self.blocks) - 1, {"type": "text_delta", "text": event.text})
        out = self.close()
        call = event.call
        index = len(self.blocks)
        self.blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)})
        return (
            out
            + block_start(index, {"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            + block_delta(index, {"type": "input_json_delta", "partial_json": call.arguments})
            + block_stop(index)
        )

    def close(self) -> bytes:
        if not self._open_text:
            return b""
        self._open_text = False
        return block_stop(len(self.blocks) - 1)


class _AutoStream(_ToolUseStream):
    def __init__(self, meta: ResponseMeta, num_prompt_tokens: int, spec: ToolSpec) -> None:
        super().__init__(meta, num_prompt_tokens, spec)
        self._hermes = HermesReader(spec)
        self._blocks = _AutoBlocks()

    def delta(self, text: str, logprobs: Sequence[common_pb2.TokenLogprobs] = ()) -> bytes:
        return b"".join(self._blocks.add(e) for e in self._hermes.feed(text))

    def finish(self, finished: Finished) -> bytes:
        out = b"".join(self._blocks.add(e) for e in self._hermes.close()) + self._blocks.close()
        return out + message_end(_stop_reason(finished, bool(self._hermes.calls)), finished)


class AnthropicToolWire:
    """``/v1/messages`` answers as tool calls, for one request's :class:`ToolSpec`."""

    def __init__(self, spec: ToolSpec) -> None:
        assert spec.reads_calls, "only an answer that may be a tool call is read as one"
        self._spec = spec

    def stream_encoder(self, meta: ResponseMeta, num_prompt_tokens: int) -> _ToolUseStream:
        if self._spec.mode == "auto":
            return _AutoStream(meta, num_prompt_tokens, self._spec)
        return _ToolUseStream(meta, num_prompt_tokens, self._spec)

    def full_response(
        self, meta: ResponseMeta, text: str, finished: Finished, logprobs: Sequence[common_pb2.TokenLogprobs]
    ) -> dict[str, Any]:
        if self._spec.mode == "auto":
            events, _, auto_calls = read_whole(self._spec, text)
            built = _AutoBlocks()
            for auto_event in events:
                built.add(auto_event)
            answer = message(meta, built.blocks, usage_dict(finished.usage))
            answer["stop_reason"] = _stop_reason(finished, bool(auto_calls))
            return answer
        calls = tool_calls_of(self._spec, text)
        blocks = _tool_use_blocks(calls) if calls else None
        answer = message(meta, blocks or [{"type": "text", "text": text}], usage_dict(finished.usage))
        answer["stop_reason"] = _stop_reason(finished, bool(blocks))
        return answer

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error_body(error)
