"""The Anthropic Messages API, answer side: the :class:`~tandem.gateway.api.wire.WireFormat` that writes a
generation (and its errors) as Anthropic does, for the ``anthropic`` SDK and Claude Code.

Used by the ``/v1/messages`` route through :class:`~tandem.gateway.api.generation.ResponseOptions`; the
request side is :mod:`~tandem.gateway.api.anthropic_messages`. Pure: no I/O.

* A message: ``{id: "msg_…", type: "message", role: "assistant", model, content: [{type: "text", text}],
  stop_reason, stop_sequence, usage}``. ``stop_reason`` is ``max_tokens`` for an answer cut at its
  length, ``stop_sequence`` (with ``stop_sequence`` the string) when one of ``stop_sequences`` ended it
  (the worker reports which: ``Finished.stop_string``), else ``end_turn``.
* ``usage`` counts as Anthropic does: ``input_tokens`` are the prompt tokens *not* read from the cache,
  ``cache_read_input_tokens`` those that were (the chat API's ``cached_tokens``), so their sum is the
  chat API's ``prompt_tokens``; ``cache_creation_input_tokens`` is 0 (caching is automatic and free).
* A stream: ``message_start`` (the message without content; ``input_tokens`` the whole prompt until
  the cache's share is known), ``content_block_start`` of one text block, ``ping``, one
  ``content_block_delta`` (``text_delta``) per text, ``content_block_stop``, ``message_delta``
  (stop reason and the final usage, which the SDK's accumulator takes over), ``message_stop``. Every
  event has an ``event:`` line, which the SDK needs; the queue heartbeat (blank lines) is no event to it.
  The stage timings are not sent in a stream (the SDK would parse an unknown event as a message event).
* An error: ``{"type": "error", "error": {"type", "message"}}`` with the HTTP status of the gateway's
  own error (:func:`error_type` maps it, in this one place); after the stream began, an ``error`` event.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.gateway.api.errors import ApiError
from tandem.gateway.api.wire import StreamEncoder
from tandem.gateway.job import Finished, Usage
from tandem.gateway.sse import ResponseMeta, encode_event
from tandem.v1 import common_pb2

#: Anthropic's error type for each HTTP status the gateway answers with.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
}


def error_type(status_code: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return _ERROR_TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "api_error")


def error_body(error: ApiError) -> dict[str, Any]:
    """An error in Anthropic's shape; its message is the gateway's, written for clients (api.errors)."""
    return {"type": "error", "error": {"type": error_type(error.status_code), "message": error.message}}


def stop_reason(finished: Finished) -> str:
    if finished.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if finished.stop_string else "end_turn"


def usage_dict(usage: Usage) -> dict[str, int]:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def message(meta: ResponseMeta, content: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": meta.id,
        "type": "message",
        "role": "assistant",
        "model": meta.model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }


def event(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\n".encode() + encode_event(payload)


PING = event("ping", {"type": "ping"})


def message_start(meta: ResponseMeta, num_prompt_tokens: int) -> bytes:
    """The message without content; the cache's share of the prompt is not known yet."""
    usage = {"input_tokens": num_prompt_tokens, "output_tokens": 1}
    return event("message_start", {"type": "message_start", "message": message(meta, [], usage)})


def block_start(index: int, block: dict[str, Any]) -> bytes:
    return event("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})


def block_delta(index: int, delta: dict[str, Any]) -> bytes:
    return event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


def block_stop(index: int) -> bytes:
    return event("content_block_stop", {"type": "content_block_stop", "index": index})


def message_end(stop_reason: str, finished: Finished) -> bytes:
    """``message_delta`` with the stop reason (and stop sequence) and the final usage, then ``message_stop``."""
    delta = {"stop_reason": stop_reason, "stop_sequence": finished.stop_string or None}
    usage = usage_dict(finished.usage)
    return event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}) + event(
        "message_stop", {"type": "message_stop"}
    )


class _MessageStream:
    def __init__(self, meta: ResponseMeta, num_prompt_tokens: int) -> None:
        self._meta = meta
        self._num_prompt_tokens = num_prompt_tokens

    def start(self) -> bytes:
        return message_start(self._meta, self._num_prompt_tokens) + block_start(0, {"type": "text", "text": ""}) + PING

    def delta(self, text: str, logprobs: Sequence[common_pb2.TokenLogprobs] = ()) -> bytes:
        if not text:  # log-probabilities are not part of this API
            return b""
        return block_delta(0, {"type": "text_delta", "text": text})

    def finish(self, finished: Finished) -> bytes:
        return block_stop(0) + message_end(stop_reason(finished), finished)

    def end(self, timings: dict[str, Any] | None) -> bytes:
        return b""

    def error(self, error: ApiError) -> bytes:
        return event("error", error_body(error))


class AnthropicWire:
    """Answers and errors of ``/v1/messages``."""

    def stream_encoder(self, meta: ResponseMeta, num_prompt_tokens: int) -> StreamEncoder:
        return _MessageStream(meta, num_prompt_tokens)

    def full_response(
        self, meta: ResponseMeta, text: str, finished: Finished, logprobs: Sequence[common_pb2.TokenLogprobs]
    ) -> dict[str, Any]:
        answer = message(meta, [{"type": "text", "text": text}], usage_dict(finished.usage))
        answer["stop_reason"] = stop_reason(finished)
        answer["stop_sequence"] = finished.stop_string or None
        return answer

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error_body(error)


ANTHROPIC_WIRE = AnthropicWire()
