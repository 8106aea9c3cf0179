"""A streamed answer: Server-Sent Events written through a bounded buffer.

Returned by the route handlers for ``stream: true`` (see
:mod:`tandem.gateway.api.generation` for what all answers share); every byte
it writes comes from :mod:`tandem.gateway.sse`.

* The status line waits for the first token; a request still queued after
  ``heartbeat_interval_s`` commits to 200 and sends heartbeats meanwhile.
* Writes go through a bounded buffer (:class:`_StreamWriter`): a client that
  stops reading holds at most ``max_buffered_bytes`` here, and one that stays
  stuck for ``slow_reader_timeout_s`` is cut off and its generation cancelled.
* After the stream has started, an error is its last event.
* Tokens whose text is not complete yet (a character split over tokens, text a
  stop string may still claim) reach the client with the next text, their
  log-probabilities too.
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.types import Send

from tandem.common.errors import TandemError
from tandem.gateway.api.errors import ApiError, api_error_from, internal_error
from tandem.gateway.api.generation import (
    STATUS_CLIENT_GONE,
    ClientGoneError,
    EventSource,
    GenerationResponse,
    raw_headers,
    send_error,
)
from tandem.gateway.api.wire import StreamEncoder
from tandem.gateway.job import Finished, GenerationEvent, TextDelta
from tandem.gateway.sse import HEARTBEAT, SSE_HEADERS

logger = logging.getLogger(__name__)


class SlowReaderError(Exception):
    """The client did not take our bytes for ``slow_reader_timeout_s``."""


class _StreamWriter:
    """A bounded buffer between the generation and the socket, drained by a task of its own.

    ``write`` appends and returns at once while fewer than ``max_buffered_bytes`` wait; beyond that it waits
    (so the gRPC stream is read no faster than the client reads). Under backpressure, events queued meanwhile
    go out together in one write.
    """

    def __init__(self, send: Send, *, max_buffered_bytes: int, timeout_s: float) -> None:
        self._send = send
        self._max = max_buffered_bytes
        self._timeout_s = timeout_s
        self._pending = bytearray()
        self._changed = asyncio.Condition()
        self._closing = False
        self.error: BaseException | None = None
        self.num_bytes_sent = 0
        self.max_pending_bytes = 0

    async def write(self, data: bytes) -> None:
        async with self._changed:
            if self.error is not None:
                raise self.error
            self._pending += data
            self.max_pending_bytes = max(self.max_pending_bytes, len(self._pending))
            self._changed.notify_all()
            await self._changed.wait_for(lambda: self.error is not None or len(self._pending) <= self._max)
            if self.error is not None:
                raise self.error

    async def close(self) -> None:
        """No more data: the writer sends what is left with ``more_body=False`` and stops."""
        async with self._changed:
            self._closing = True
            self._changed.notify_all()

    async def run(self) -> None:
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: bool(self._pending) or self._closing)
                chunk, last = bytes(self._pending), self._closing
                self._pending.clear()
                self._changed.notify_all()
            try:
                await asyncio.wait_for(
                    self._send({"type": "http.response.body", "body": chunk, "more_body": not last}),
                    self._timeout_s,
                )
                self.num_bytes_sent += len(chunk)
            except TimeoutError as exc:
                await self._fail(SlowReaderError(f"client took no data for {self._timeout_s} s"), exc)
                return
            except OSError as exc:  # uvicorn's ClientDisconnected
                await self._fail(ClientGoneError(), exc)
                return
            if last:
                return

    async def _fail(self, error: Exception, cause: BaseException) -> None:
        error.__cause__ = cause
        async with self._changed:
            self.error = error
            self._changed.notify_all()


class StreamedResponse(GenerationResponse):
    STREAM = True

    async def _respond(self, send: Send, source: EventSource) -> int:
        limits = self._limits
        writer = _StreamWriter(
            send, max_buffered_bytes=limits.max_buffered_bytes, timeout_s=limits.slow_reader_timeout_s
        )
        writer_task: asyncio.Task[None] | None = None
        encoder = self._options.wire.stream_encoder(self._meta, len(self._job.prompt_token_ids))
        headers = {**SSE_HEADERS, **self._options.headers, "X-Request-Id": self._job.request_id}

        async def start_stream() -> None:
            nonlocal writer_task
            await send({"type": "http.response.start", "status": 200, "headers": raw_headers(headers, sse=True)})
            writer_task = asyncio.create_task(writer.run())

        try:
            first: GenerationEvent | None = None
            try:
                first = await source.next(timeout_s=limits.heartbeat_interval_s)
                while first is None:  # still queued: commit to 200 and keep the connection warm
                    if writer_task is None:
                        await start_stream()
                    await writer.write(HEARTBEAT)
                    first = await source.next(timeout_s=limits.heartbeat_interval_s)
            except TandemError as exc:
                error = api_error_from(exc, request_id=self._job.request_id)
                if writer_task is None:
                    return await send_error(send, error, self._options.wire)
                return await self._end_with_error(writer, writer_task, encoder, error)
            except (SlowReaderError, ClientGoneError):
                raise
            except Exception:
                logger.exception("generation failed", extra={"request_id": self._job.request_id})
                if writer_task is None:
                    return await send_error(send, internal_error(), self._options.wire)
                return await self._end_with_error(writer, writer_task, encoder, internal_error())
            assert isinstance(first, TextDelta)
            self._observe_first_token(first)
            if writer_task is None:
                await start_stream()
            assert writer_task is not None
            await self._save_progress()
            await writer.write(encoder.start() + (self._delta(encoder, first.text) if first.text else b""))
            self._job.clock.mark("first_byte")
            self._metrics.count_generated(1, model=self._job.model)
            return await self._stream_rest(writer, writer_task, encoder, source)
        except SlowReaderError as exc:
            self._cut_off = True
            self._metrics.slow_reader_disconnects_total.inc()
            logger.warning("slow reader cut off: %s", exc, extra={"request_id": self._job.request_id})
            return STATUS_CLIENT_GONE
        finally:
            if writer_task is not None and not writer_task.done():
                writer_task.cancel()

    async def _stream_rest(
        self, writer: _StreamWriter, writer_task: asyncio.Task[None], encoder: StreamEncoder, source: EventSource
    ) -> int:
        last_token_s = time.monotonic()
        num_unsent_tokens = 0  # tokens whose text was empty so far; they reach the client with the next text
        try:
            async for event in source.remaining():
                if isinstance(event, TextDelta):
                    self._record(event)
                    num_unsent_tokens += event.num_tokens
                    if not event.text:
                        continue
                    now_s = time.monotonic()
                    self._metrics.observe_tokens(now_s - last_token_s, num_unsent_tokens, model=self._job.model)
                    self._metrics.count_generated(num_unsent_tokens, model=self._job.model)
                    last_token_s, num_unsent_tokens = now_s, 0
                    await self._save_progress()
                    await writer.write(self._delta(encoder, event.text))
                elif isinstance(event, Finished):
                    self._finished = event
                    self._metrics.count_generated(num_unsent_tokens, model=self._job.model)
                    # Tokens that added no text (a stop token) still have log-probabilities to report.
                    unsent = self._delta(encoder, "") if self._num_logprobs_sent < len(self._logprobs) else b""
                    await self._save_progress()
                    await self._answer_complete(event)
                    await writer.write(unsent + encoder.finish(event))
        except TandemError as exc:
            logger.warning("stream failed: %s", exc, extra={"request_id": self._job.request_id})
            error = api_error_from(exc, request_id=self._job.request_id)
            return await self._end_with_error(writer, writer_task, encoder, error)
        except (SlowReaderError, ClientGoneError):
            raise
        except Exception:
            logger.exception("stream failed", extra={"request_id": self._job.request_id})
            return await self._end_with_error(writer, writer_task, encoder, internal_error())
        self._job.clock.mark("done")
        await writer.write(encoder.end(self._job.clock.breakdown() if self._options.timings else None))
        await writer.close()
        await writer_task
        if writer.error is not None:
            raise writer.error
        return 200

    async def _end_with_error(
        self, writer: _StreamWriter, writer_task: asyncio.Task[None], encoder: StreamEncoder, error: ApiError
    ) -> int:
        """After the stream started, an error is the stream's last event."""
        await writer.write(encoder.error(error))
        await writer.close()
        await writer_task
        if writer.error is not None:
            raise writer.error
        return error.status_code

    def _delta(self, encoder: StreamEncoder, text: str) -> bytes:
        """A content chunk with the log-probabilities of every token not reported yet."""
        unsent = self._logprobs[self._num_logprobs_sent :]
        self._num_logprobs_sent = len(self._logprobs)
        return encoder.delta(text, unsent)
