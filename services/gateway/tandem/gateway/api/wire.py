"""How a generation's answer is written for the API the client speaks: the seam between the one
response writer (:mod:`~tandem.gateway.api.streaming`, :mod:`~tandem.gateway.api.complete`) and the
dialects it writes (OpenAI here; Anthropic Messages in :mod:`~tandem.gateway.api.anthropic_wire`).

A :class:`WireFormat` is chosen by the route handler (:mod:`~tandem.gateway.api.routes`) and travels in
:class:`~tandem.gateway.api.generation.ResponseOptions`; the writers call it and nothing else for the
bytes they send. Everything else (admission, the bounded stream buffer, heartbeats, the completion hook,
metrics) is the writers' own and the same for every dialect. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tandem.gateway.api.errors import ApiError
from tandem.gateway.job import Finished
from tandem.gateway.sse import DONE_EVENT, ChunkEncoder, ResponseMeta, full_response, stream_end
from tandem.v1 import common_pb2


class StreamEncoder(Protocol):
    """The events of one streamed answer, called by the stream writer in this order: :meth:`start` once
    with the first token, :meth:`delta` for each text, then either :meth:`finish` and :meth:`end`, or
    :meth:`error` (which ends the stream by itself)."""

    def start(self) -> bytes:
        """What comes before the first text."""
        ...

    def delta(self, text: str, logprobs: Sequence[common_pb2.TokenLogprobs] = ()) -> bytes:
        """New text; ``logprobs``: one entry per token whose text it completes (may be sent with text "")."""
        ...

    def finish(self, finished: Finished) -> bytes:
        """Why the answer ended, and its usage."""
        ...

    def end(self, timings: dict[str, Any] | None) -> bytes:
        """The stream's last bytes after :meth:`finish`; ``timings``: the stage breakdown, when asked for."""
        ...

    def error(self, error: ApiError) -> bytes:
        """An error after the stream started: the stream's last bytes."""
        ...


class WireFormat(Protocol):
    """One API dialect's encoding of answers and errors."""

    def stream_encoder(self, meta: ResponseMeta, num_prompt_tokens: int) -> StreamEncoder: ...

    def full_response(
        self, meta: ResponseMeta, text: str, finished: Finished, logprobs: Sequence[common_pb2.TokenLogprobs]
    ) -> dict[str, Any]:
        """The non-streamed answer."""
        ...

    def error_body(self, error: ApiError) -> dict[str, Any]:
        """An error's JSON body (its HTTP status and headers are the ApiError's)."""
        ...


class _OpenAIStream:
    def __init__(self, meta: ResponseMeta) -> None:
        self._chunks = ChunkEncoder(meta)

    def start(self) -> bytes:
        return self._chunks.start()

    def delta(self, text: str, logprobs: Sequence[common_pb2.TokenLogprobs] = ()) -> bytes:
        return self._chunks.delta(text, logprobs)

    def finish(self, finished: Finished) -> bytes:
        return self._chunks.finish(finished.finish_reason) + self._chunks.usage(finished.usage)

    def end(self, timings: dict[str, Any] | None) -> bytes:
        return stream_end(timings)

    def error(self, error: ApiError) -> bytes:
        return ChunkEncoder.error(error.body()) + DONE_EVENT


class OpenAIWire:
    """Chat and text completions as OpenAI writes them (:mod:`tandem.gateway.sse`)."""

    def stream_encoder(self, meta: ResponseMeta, num_prompt_tokens: int) -> StreamEncoder:
        return _OpenAIStream(meta)

    def full_response(
        self, meta: ResponseMeta, text: str, finished: Finished, logprobs: Sequence[common_pb2.TokenLogprobs]
    ) -> dict[str, Any]:
        return full_response(meta, text, finished.finish_reason, finished.usage, logprobs)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error.body()


OPENAI_WIRE = OpenAIWire()
