"""OpenAI chat completions whose answer is a tool call: the wire format
(:class:`tandem.gateway.api.wire.WireFormat`) that the route handler picks,
per request, when the request's tools constrain the answer.

Called by the response writers through the ``WireFormat`` seam; calls
:class:`~tandem.gateway.api.tool_calls.ToolCallReader` for the calls and
:mod:`tandem.gateway.sse` for every byte, so a tool-call stream is framed as
any chat stream (heartbeats, usage chunk, ``[DONE]``, errors). Pure: no I/O.

The stream: the role chunk (``role: "assistant"``, no content), then one chunk
per text delta that completes tool-call deltas (the first of a call with id,
type, name and ``arguments: ""``), then the finish chunk (``finish_reason``
from :func:`~tandem.gateway.api.tool_calls.finish_reason`) and the usage chunk
unchanged. Log-probabilities of tokens that completed no delta yet wait for
the next chunk, as a text stream's do for tokens that complete no character.

With ``tool_choice: "auto"`` the answer is read by
:class:`~tandem.gateway.api.hermes_tools.HermesReader`: its text streams as content deltas, each call
as its tool-call deltas once its block is whole, and the message may hold both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.gateway.api.errors import ApiError
from tandem.gateway.api.hermes_tools import Event, HermesReader, Text, call_deltas, read_whole
from tandem.gateway.api.hermes_tools import finish_reason as hermes_finish_reason
from tandem.gateway.api.tool_calls import ToolCallReader, finish_reason, tool_calls_of
from tandem.gateway.api.tools import ToolSpec
from tandem.gateway.job import Finished
from tandem.gateway.sse import DONE_EVENT, ChunkEncoder, ResponseMeta, full_response, stream_end
from tandem.v1 import common_pb2


class _ToolCallStream:
    def __init__(self, meta: ResponseMeta, spec: ToolSpec) -> None:
        self._chunks = ChunkEncoder(meta)
        self._spec = spec
        self._reader = ToolCallReader(spec)
        self._pending_logprobs: list[common_pb2.TokenLogprobs] = []

    def start(self) -> bytes:
        return self._chunks.start(content=None)

    def delta(self, text: str, logprobs: Sequence[common_pb2.TokenLogprobs] = ()) -> bytes:
        self._pending_logprobs.extend(logprobs)
        deltas = self._reader.feed(text)
        if not deltas:
            return b""
        return self._chunks.delta(None, self._take_logprobs(), tool_calls=deltas)

    def finish(self, finished: Finished) -> bytes:
        leftover = b""
        if not self._reader.calls and self._reader.text:
            # No call could be read (the answer was cut before one began): the text is the content.
            leftover = self._chunks.delta(self._reader.text, self._take_logprobs())
        elif self._pending_logprobs:
            leftover = self._chunks.delta(None, self._take_logprobs())
        reason = finish_reason(self._spec, finished.finish_reason) if self._reader.calls else finished.finish_reason
        return leftover + self._chunks.finish(reason) + self._chunks.usage(finished.usage)

    def end(self, timings: dict[str, Any] | None) -> bytes:
        return stream_end(timings)

    def error(self, error: ApiError) -> bytes:
        return ChunkEncoder.error(error.body()) + DONE_EVENT

    def _take_logprobs(self) -> list[common_pb2.TokenLogprobs]:
        taken, self._pending_logprobs = self._pending_logprobs, []
        return taken


class _AutoToolStream(_ToolCallStream):
    """An ``auto`` answer: content and tool-call deltas in the order the model wrote them."""

    def __init__(self, meta: ResponseMeta, spec: ToolSpec) -> None:
        super().__init__(meta, spec)
        self._hermes = HermesReader(spec)

    def start(self) -> bytes:
        return self._chunks.start()

    def delta(self, text: str, logprobs: Sequence[common_pb2.TokenLogprobs] = ()) -> bytes:
        self._pending_logprobs.extend(logprobs)
        return self._events(self._hermes.feed(text))

    def finish(self, finished: Finished) -> bytes:
        out = self._events(self._hermes.close())
        if self._pending_logprobs:
            out += self._chunks.delta(None, self._take_logprobs())
        reason = hermes_finish_reason(bool(self._hermes.calls), finished.finish_reason)
        return out + self._chunks.finish(reason) + self._chunks.usage(finished.usage)

    def _events(self, events: list[Event]) -> bytes:
        out = b""
        for event in events:
            if isinstance(event, Text):
                out += self._chunks.delta(event.text, self._take_logprobs())
            else:
                out += self._chunks.delta(None, self._take_logprobs(), tool_calls=call_deltas(event.index, event.call))
        return out


class OpenAIToolWire:
    """OpenAI's chat completion answer as tool calls, for one request's :class:`ToolSpec`."""

    def __init__(self, spec: ToolSpec) -> None:
        assert spec.reads_calls, "only an answer that may be a tool call is read as one"
        self._spec = spec

    def stream_encoder(self, meta: ResponseMeta, num_prompt_tokens: int) -> _ToolCallStream:
        if self._spec.mode == "auto":
            return _AutoToolStream(meta, self._spec)
        return _ToolCallStream(meta, self._spec)

    def full_response(
        self, meta: ResponseMeta, text: str, finished: Finished, logprobs: Sequence[common_pb2.TokenLogprobs]
    ) -> dict[str, Any]:
        if self._spec.mode == "auto":
            _, content, auto_calls = read_whole(self._spec, text)
            return full_response(
                meta,
                text if content is None else content,
                hermes_finish_reason(bool(auto_calls), finished.finish_reason),
                finished.usage,
                logprobs,
                tool_calls=[call.as_openai() for call in auto_calls],
                content=content,
            )
        calls = tool_calls_of(self._spec, text)
        if not calls:
            return full_response(meta, text, finished.finish_reason, finished.usage, logprobs)
        return full_response(
            meta,
            text,
            finish_reason(self._spec, finished.finish_reason),
            finished.usage,
            logprobs,
            tool_calls=[call.as_openai() for call in calls],
        )

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error.body()
