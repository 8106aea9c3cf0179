"""OpenAI wire encoding of generation results: Server-Sent Event chunks for
``stream: true`` and whole objects otherwise. Every byte of an event stream
comes from here.

Used by the response writers (:mod:`tandem.gateway.api.streaming`,
:mod:`tandem.gateway.api.complete`, their base :mod:`tandem.gateway.api.generation`),
the error responses (:mod:`tandem.gateway.api.errors`, :mod:`tandem.gateway.api.routes`)
and :mod:`tandem.gateway.logprobs`. Pure: no I/O; what it imports of the
gateway is what it encodes (usage, log-probabilities, the timings event). The chunk
shapes follow OpenAI exactly (field order included) so that SDKs and UIs
written against OpenAI parse them unchanged.

The framing is chosen for the parsers clients run, not only for the WHATWG rules:

* vLLM's benchmark client (``vllm/benchmarks/lib/endpoint_request_func.py``,
  ``async_request_openai_chat_completions``) strips every network read
  (``chunk_bytes = chunk_bytes.strip()``), so an event loses its closing blank
  line whenever a read ends there, and ``StreamedResponseHandler.add_chunk``
  emits such a leftover only if it ``startswith("data: ")`` and parses as JSON.
  Anything else left at the end of a read (a ``: comment``, an ``event:`` line)
  stays at the front of its buffer and the next events are glued to it: dropped
  whole by ``if message.startswith(":"): continue``, or failing ``json.loads``
  (the request counts as failed).
* The ``openai`` SDK turns every event before ``[DONE]`` into a chunk whatever its
  ``event:`` name, and stops reading at ``[DONE]``.

Hence: before ``[DONE]`` only ``data: {json}`` events; the queue heartbeat is a
blank-line pair (:data:`HEARTBEAT`); the one named event, the stage timings,
comes after ``[DONE]`` (:func:`stream_end`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tandem.gateway.job import Usage
from tandem.gateway.logprobs import chat_logprobs, completion_logprobs
from tandem.gateway.timings import TIMINGS_EVENT
from tandem.v1 import common_pb2

DONE_EVENT = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

#: Written every ``heartbeat_interval_s`` while a stream that committed to 200 waits in the router's queue,
#: so that proxies keep it open. Blank lines with no field are no event to any SSE parser, vLLM's strip reduces
#: them to nothing whatever read they end up in, and a pair keeps readers that split on "\n\n" aligned. Not an
#: OpenAI chunk: one with choices (the role chunk) would start vLLM bench's TTFT clock, and one with
#: ``"choices": []`` breaks clients that read ``chunk.choices[0]`` as OpenAI's own examples do.
HEARTBEAT = b"\n\n"

Kind = Literal["chat", "text"]


#: Characters that JSON may carry raw but that many clients' line readers (Python's str.splitlines,
#: httpx's aiter_lines, JavaScript before ES2019) take for line ends: sent as JSON escapes instead.
_LINE_BREAKERS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\u0085": "\\u0085"})


def _data_line(payload: dict[str, Any]) -> bytes:
    """A ``data:`` line with its line end, on one line whichever way a client splits lines."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKERS)
    return b"data: " + text.encode() + b"\n"


def encode_event(payload: dict[str, Any]) -> bytes:
    """One SSE ``data:`` event."""
    return _data_line(payload) + b"\n"


def stream_end(timings: dict[str, Any] | None = None) -> bytes:
    """``[DONE]``, then the stage ``timings`` (when the client asked) as the ``tandem.timings`` event.

    After ``[DONE]`` because a named event is the one thing the SDKs and vLLM bench cannot take before it: the
    SDKs stop at ``[DONE]``, vLLM bench never emits it (its closing blank line ends the last read and is stripped),
    and EventSource listeners and line readers that know the name still get it.
    """
    if timings is None:
        return DONE_EVENT
    return DONE_EVENT + b"event: " + TIMINGS_EVENT.encode() + b"\n" + _data_line(timings) + b"\n"


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass(frozen=True)
class ResponseMeta:
    """What every chunk of one response repeats."""

    id: str
    created: int
    model: str
    kind: Kind
    include_usage: bool = False
    #: The client asked for log-probabilities.
    logprobs: bool = False


def logprobs_dict(meta: ResponseMeta, entries: Sequence[common_pb2.TokenLogprobs], text_offset: int) -> dict[str, Any]:
    """``entries`` in the endpoint's shape; ``text_offset``: where the first token starts (completions only)."""
    return chat_logprobs(entries) if meta.kind == "chat" else completion_logprobs(entries, text_offset)


class ChunkEncoder:
    """Encodes the events of one streamed response."""

    def __init__(self, meta: ResponseMeta) -> None:
        self._meta = meta
        #: Characters of the tokens whose log-probabilities went out so far (completions' text_offset).
        self._num_token_chars = 0

    def _chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        meta = self._meta
        payload: dict[str, Any] = {
            "id": meta.id,
            "object": "chat.completion.chunk" if meta.kind == "chat" else "text_completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [choice] if choice is not None else [],
        }
        if meta.include_usage:
            # OpenAI: with include_usage every chunk carries "usage": null except the last one.
            payload["usage"] = None
        return payload

    def _choice(
        self,
        content: str | None,
        *,
        role: bool = False,
        finish_reason: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        if self._meta.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if content is not None:
                delta["content"] = content
            if tool_calls:
                delta["tool_calls"] = tool_calls
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish_reason}

    def start(self, *, content: str | None = "") -> bytes:
        """The role chunk of a chat stream (a tool-call answer's has no content); text completions have none."""
        if self._meta.kind != "chat":
            return b""
        return encode_event(self._chunk(self._choice(content, role=True)))

    def delta(
        self,
        text: str | None,
        logprobs: Sequence[common_pb2.TokenLogprobs] = (),
        *,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> bytes:
        """A content chunk, or with ``text`` None a chunk of ``delta.tool_calls`` entries
        (tandem.gateway.api.tool_calls); ``logprobs``: one entry per token whose text it completes."""
        choice = self._choice(text, tool_calls=tool_calls)
        if self._meta.logprobs and logprobs:
            choice["logprobs"] = logprobs_dict(self._meta, logprobs, self._num_token_chars)
            self._num_token_chars += sum(len(e.token) for e in logprobs)
        return encode_event(self._chunk(choice))

    def finish(self, finish_reason: str) -> bytes:
        return encode_event(self._chunk(self._choice(None, finish_reason=finish_reason)))

    def usage(self, usage: Usage) -> bytes:
        if not self._meta.include_usage:
            return b""
        payload = self._chunk(None)
        payload["usage"] = usage_dict(usage)
        return encode_event(payload)

    @staticmethod
    def error(body: dict[str, Any]) -> bytes:
        return encode_event(body)


def full_response(
    meta: ResponseMeta,
    text: str,
    finish_reason: str,
    usage: Usage,
    logprobs: Sequence[common_pb2.TokenLogprobs] = (),
    tool_calls: list[dict[str, Any]] | None = None,
    content: str | None = None,
) -> dict[str, Any]:
    """The non-streamed response object; with ``tool_calls`` (chat) the message is those calls, and
    ``content`` its content (null: none; an ``auto`` answer may write text beside its calls)."""
    logprobs_value = logprobs_dict(meta, logprobs, 0) if meta.logprobs else None
    if meta.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": logprobs_value,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs_value, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": meta.id,
        "object": obj,
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
        "usage": usage_dict(usage),
    }
