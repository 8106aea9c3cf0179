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


class AnthropicToolWire:
    """``/v1/messages`` answers as tool calls, for one request's :class:`ToolSpec`."""

    def __init__(self, spec: ToolSpec) -> None:
        assert spec.constrains, "only an answer constrained to a tool call is read as one"
        self._spec = spec

    def stream_encoder(self, meta: ResponseMeta, num_prompt_tokens: int) -> _ToolUseStream:
        return _ToolUseStream(meta, num_prompt_tokens, self._spec)

    def full_response(
        self, meta: ResponseMeta, text: str, finished: Finished, logprobs: Sequence[common_pb2.TokenLogprobs]
    ) -> dict[str, Any]:
        calls = tool_calls_of(self._spec, text)
        blocks = _tool_use_blocks(calls) if calls else None
        answer = message(meta, blocks or [{"type": "text", "text": text}], usage_dict(finished.usage))
        answer["stop_reason"] = _stop_reason(finished, bool(blocks))
        return answer

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error_body(error)
