"""The HTTP response of a generation request, streamed or not.

Returned by the route handlers; calls :meth:`Orchestrator.generate` and writes
its events with :mod:`tandem.gateway.sse`. It is an ASGI response of its own
(rather than Starlette's ``StreamingResponse``) because:

* the status line waits for the first token, so that "no capacity" or a dead
  prefill worker is an HTTP 503 the client can retry, not an error event —
  except that a stream still queued after ``heartbeat_interval_s`` commits to
  200 and sends heartbeats (blank lines, :data:`~tandem.gateway.sse.HEARTBEAT`)
  so that proxies keep it open;
* it listens for the client's ``http.disconnect`` while generating, so that a
  client that goes away cancels the gRPC calls at once (not at the next write)
  and the orchestrator's cleanup (Abort, Release) runs;
* writes go through a bounded buffer (:class:`_StreamWriter`): a client that
  stops reading holds at most ``max_buffered_bytes`` here, and one that stays
  stuck for ``slow_reader_timeout_s`` is cut off and its generation cancelled;
* on drain expiry (SIGTERM past the grace period) the stream ends with an error
  event;
* when it ends, however it ends, the completion hook runs once with what was
  actually generated (quota reconciliation, usage, conversation), in a task of
  its own so a cancelled request still settles.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from tandem.common.errors import TandemError
from tandem.gateway.api.errors import ApiError, api_error_from, internal_error
from tandem.gateway.drain import Drain
from tandem.gateway.errors import ShuttingDownError
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.orchestrator import Finished, GenerationEvent, GenerationJob, Orchestrator, TextDelta
from tandem.gateway.sse import DONE_EVENT, HEARTBEAT, SSE_HEADERS, ChunkEncoder, ResponseMeta, full_response, stream_end
from tandem.v1 import common_pb2

logger = logging.getLogger(__name__)

STATUS_CLIENT_GONE = 499


@dataclass(frozen=True)
class RequestTiming:
    endpoint: str
    received_s: float  # time.monotonic() when the request arrived


@dataclass(frozen=True)
class StreamLimits:
    heartbeat_interval_s: float = 5.0
    max_buffered_bytes: int = 256 * 1024
    slow_reader_timeout_s: float = 10.0


@dataclass
class Outcome:
    """How a request ended, for the completion hook."""

    status: int
    num_completion_tokens: int = 0
    text: str = ""
    finished: Finished | None = None


@dataclass(frozen=True)
class ResponseOptions:
    """Per-request extras decided by the route handler."""

    #: Headers added to a successful response (x-ratelimit-*).
    headers: dict[str, str] = field(default_factory=dict)
    #: Send the stage breakdown (final SSE event / ``tandem_timings`` field).
    timings: bool = False
    #: Extra top-level fields of the non-streamed body (e.g. conversation_id).
    extra_fields: dict[str, Any] = field(default_factory=dict)
    on_finish: Callable[[Outcome], Coroutine[Any, Any, None]] | None = None


class SlowReaderError(Exception):
    """The client did not take our bytes for ``slow_reader_timeout_s``."""


class _ClientGoneError(Exception):
    pass


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
                await self._fail(_ClientGoneError(), exc)
                return
            if last:
                return

    async def _fail(self, error: Exception, cause: BaseException) -> None:
        error.__cause__ = cause
        async with self._changed:
            self.error = error
            self._changed.notify_all()


class _EventSource:
    """``anext`` with a timeout that does not cancel the pending step, and a stop signal (drain expiry)."""

    def __init__(self, events: AsyncGenerator[GenerationEvent, None], stop: asyncio.Event) -> None:
        self._events = events
        self._stop = stop
        self._step: asyncio.Future[GenerationEvent] | None = None

    async def next(self, timeout_s: float | None = None) -> GenerationEvent | None:
        """The next event; None when ``timeout_s`` passed first. Raises StopAsyncIteration at the end,
        ShuttingDownError when the drain's grace period ended, or the generation's error."""
        if self._step is None:
            self._step = asyncio.ensure_future(anext(self._events))
        stopped: asyncio.Future[Any] = asyncio.ensure_future(self._stop.wait())
        try:
            waiting: set[asyncio.Future[Any]] = {self._step, stopped}
            done, _ = await asyncio.wait(waiting, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if self._step in done:
            step, self._step = self._step, None
            return step.result()
        if self._stop.is_set():
            raise ShuttingDownError("The server is shutting down; retry on another replica.")
        return None

    async def aclose(self) -> None:
        if self._step is not None:
            self._step.cancel()
            with contextlib.suppress(BaseException):
                await self._step
        await self._events.aclose()


class GenerationResponse(Response):
    def __init__(
        self,
        *,
        orchestrator: Orchestrator,
        job: GenerationJob,
        meta: ResponseMeta,
        stream: bool,
        metrics: GatewayMetrics,
        timing: RequestTiming,
        drain: Drain | None = None,
        limits: StreamLimits | None = None,
        options: ResponseOptions | None = None,
    ) -> None:
        super().__init__(status_code=200)
        self._orchestrator = orchestrator
        self._job = job
        self._meta = meta
        self._stream = stream
        self._metrics = metrics
        self._timing = timing
        self._drain = drain if drain is not None else Drain()
        self._limits = limits or StreamLimits()
        self._options = options or ResponseOptions()
        self._ttft_s: float | None = None
        self._num_completion_tokens = 0
        self._texts: list[str] = []
        #: One entry per generated token when the client asked for log-probabilities.
        self._logprobs: list[common_pb2.TokenLogprobs] = []
        #: How many of them went out: tokens whose text is not complete yet wait for the next text.
        self._num_logprobs_sent = 0
        self._finished: Finished | None = None
        self._cut_off = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._metrics.in_flight_requests.inc()
        status = 500
        response_complete = False

        async def tracking_send(message: Message) -> None:
            nonlocal response_complete
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                response_complete = True

        with self._drain.track():
            pump = asyncio.create_task(self._pump(tracking_send))
            watcher = asyncio.create_task(_wait_for_disconnect(receive))
            try:
                await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not pump.done() and response_complete:
                    # The server reports a disconnect once the response is complete: not the client leaving.
                    await asyncio.wait({pump})
                if pump.done():
                    try:
                        status = pump.result()
                    except (OSError, _ClientGoneError):  # the client left while we wrote
                        status = STATUS_CLIENT_GONE
                else:
                    status = STATUS_CLIENT_GONE
                    pump.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await pump
            finally:
                watcher.cancel()
                if not pump.done():  # we were cancelled ourselves (server shutdown)
                    pump.cancel()
                self._finish(status)

    def _finish(self, status: int) -> None:
        clock = self._job.clock
        clock.mark("done")
        self._metrics.in_flight_requests.dec()
        self._metrics.requests_total.labels(endpoint=self._timing.endpoint, status=str(status)).inc()
        e2e_s = time.monotonic() - self._timing.received_s
        if status == 200:
            self._metrics.e2e_request_latency_s.observe(e2e_s)
        stages = clock.stages_s()
        for stage in ("auth", "quota", "first_byte_write"):
            if stage in stages:
                self._metrics.observe_stage(stage, stages[stage])
        for name, stage in (("prefill_engine_s", "prefill_engine"), ("kv_transfer_s", "kv_transfer")):
            if name in clock.worker:
                self._metrics.observe_stage(stage, clock.worker[name])
        if self._options.on_finish is not None:
            outcome = Outcome(status, self._num_completion_tokens, "".join(self._texts), self._finished)
            self._orchestrator.run_in_background(self._options.on_finish(outcome))
        logger.info(
            "request finished",
            extra={
                "request_id": self._job.request_id,
                "tenant": self._job.tenant,
                "endpoint": self._timing.endpoint,
                "status": status,
                "stream": self._stream,
                "num_prompt_tokens": len(self._job.prompt_token_ids),
                "num_completion_tokens": self._num_completion_tokens,
                "ttft_s": None if self._ttft_s is None else round(self._ttft_s, 6),
                "e2e_s": round(e2e_s, 6),
                "stages_ms": {k: round(v * 1000, 3) for k, v in stages.items()},
                "cut_off_slow_reader": self._cut_off,
            },
        )

    async def _pump(self, send: Send) -> int:
        """Run the generation and write the response; returns the HTTP status (for metrics)."""
        source = _EventSource(self._orchestrator.generate(self._job), self._drain.expired)
        try:
            if self._stream:
                return await self._stream_all(send, source)
            return await self._collect_all(send, source)
        finally:
            await source.aclose()

    async def _first_event(self, source: _EventSource) -> TextDelta:
        event = await source.next()
        assert isinstance(event, TextDelta)
        self._observe_first_token(event)
        return event

    async def _stream_all(self, send: Send, source: _EventSource) -> int:
        limits = self._limits
        writer = _StreamWriter(
            send, max_buffered_bytes=limits.max_buffered_bytes, timeout_s=limits.slow_reader_timeout_s
        )
        writer_task: asyncio.Task[None] | None = None
        encoder = ChunkEncoder(self._meta)
        headers = {**SSE_HEADERS, **self._options.headers, "X-Request-Id": self._job.request_id}

        async def start_stream() -> None:
            nonlocal writer_task
            await send({"type": "http.response.start", "status": 200, "headers": _raw_headers(headers, sse=True)})
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
                if writer_task is None:
                    return await _send_error(send, api_error_from(exc))
                return await self._end_with_error(writer, writer_task, api_error_from(exc), exc)
            except (SlowReaderError, _ClientGoneError):
                raise
            except Exception:
                logger.exception("generation failed", extra={"request_id": self._job.request_id})
                if writer_task is None:
                    return await _send_error(send, internal_error())
                return await self._end_with_error(writer, writer_task, internal_error(), None)
            assert isinstance(first, TextDelta)
            self._observe_first_token(first)
            if writer_task is None:
                await start_stream()
            assert writer_task is not None
            await writer.write(encoder.start() + (self._delta(encoder, first.text) if first.text else b""))
            self._job.clock.mark("first_byte")
            self._metrics.generated_tokens_total.inc()
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
        self, writer: _StreamWriter, writer_task: asyncio.Task[None], encoder: ChunkEncoder, source: _EventSource
    ) -> int:
        last_token_s = time.monotonic()
        num_unsent_tokens = 0  # tokens whose text was empty so far; they reach the client with the next text
        try:
            while True:
                try:
                    event = await source.next()
                except StopAsyncIteration:
                    break
                if isinstance(event, TextDelta):
                    self._num_completion_tokens += event.num_tokens
                    num_unsent_tokens += event.num_tokens
                    self._texts.append(event.text)
                    self._logprobs.extend(event.logprobs)
                    if not event.text:
                        continue
                    now_s = time.monotonic()
                    self._metrics.observe_tokens(now_s - last_token_s, num_unsent_tokens)
                    self._metrics.generated_tokens_total.inc(num_unsent_tokens)
                    last_token_s, num_unsent_tokens = now_s, 0
                    await writer.write(self._delta(encoder, event.text))
                elif isinstance(event, Finished):
                    self._finished = event
                    self._metrics.generated_tokens_total.inc(num_unsent_tokens)
                    # Tokens that added no text (a stop token) still have log-probabilities to report.
                    unsent = self._delta(encoder, "") if self._num_logprobs_sent < len(self._logprobs) else b""
                    await writer.write(unsent + encoder.finish(event.finish_reason) + encoder.usage(event.usage))
        except TandemError as exc:
            logger.warning("stream failed: %s", exc, extra={"request_id": self._job.request_id})
            return await self._end_with_error(writer, writer_task, api_error_from(exc), exc)
        except (SlowReaderError, _ClientGoneError):
            raise
        except Exception:
            logger.exception("stream failed", extra={"request_id": self._job.request_id})
            return await self._end_with_error(writer, writer_task, internal_error(), None)
        self._job.clock.mark("done")
        await writer.write(stream_end(self._job.clock.breakdown() if self._options.timings else None))
        await writer.close()
        await writer_task
        if writer.error is not None:
            raise writer.error
        return 200

    async def _end_with_error(
        self, writer: _StreamWriter, writer_task: asyncio.Task[None], error: ApiError, exc: BaseException | None
    ) -> int:
        """After the stream started, an error is the stream's last event."""
        await writer.write(ChunkEncoder.error(error.body()) + DONE_EVENT)
        await writer.close()
        await writer_task
        if writer.error is not None:
            raise writer.error
        return error.status_code

    async def _collect_all(self, send: Send, source: _EventSource) -> int:
        try:
            first = await self._first_event(source)
            self._texts.append(first.text)
            while True:
                try:
                    event = await source.next()
                except StopAsyncIteration:
                    break
                if isinstance(event, TextDelta):
                    self._texts.append(event.text)
                    self._logprobs.extend(event.logprobs)
                    self._num_completion_tokens += event.num_tokens
                elif isinstance(event, Finished):
                    self._finished = event
        except TandemError as exc:
            return await _send_error(send, api_error_from(exc))
        except Exception:
            logger.exception("generation failed", extra={"request_id": self._job.request_id})
            return await _send_error(send, internal_error())
        finished = self._finished
        if finished is None:
            return await _send_error(send, internal_error())
        self._metrics.generated_tokens_total.inc(finished.usage.completion_tokens)
        self._job.clock.mark("first_byte")
        self._job.clock.mark("done")
        payload = full_response(
            self._meta, "".join(self._texts), finished.finish_reason, finished.usage, self._logprobs
        )
        payload.update(self._options.extra_fields)
        if self._options.timings:
            payload["tandem_timings"] = self._job.clock.breakdown()
        body = json.dumps(payload, ensure_ascii=False).encode()
        headers = {"Content-Type": "application/json", **self._options.headers, "X-Request-Id": self._job.request_id}
        await send({"type": "http.response.start", "status": 200, "headers": _raw_headers(headers, length=len(body))})
        await _send_body(send, body, more_body=False)
        return 200

    def _observe_first_token(self, first: TextDelta) -> None:
        self._ttft_s = time.monotonic() - self._timing.received_s
        self._num_completion_tokens = 1
        self._metrics.time_to_first_token_s.observe(self._ttft_s)
        self._logprobs.extend(first.logprobs)
        if self._stream:
            self._texts.append(first.text)

    def _delta(self, encoder: ChunkEncoder, text: str) -> bytes:
        """A content chunk with the log-probabilities of every token not reported yet."""
        unsent = self._logprobs[self._num_logprobs_sent :]
        self._num_logprobs_sent = len(self._logprobs)
        return encoder.delta(text, unsent)


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _send_body(send: Send, body: bytes, *, more_body: bool = True) -> None:
    if body or not more_body:
        await send({"type": "http.response.body", "body": body, "more_body": more_body})


async def _send_error(send: Send, error: ApiError) -> int:
    body = json.dumps(error.body()).encode()
    headers = {"Content-Type": "application/json", **error.headers}
    await send(
        {
            "type": "http.response.start",
            "status": error.status_code,
            "headers": _raw_headers(headers, length=len(body)),
        }
    )
    await _send_body(send, body, more_body=False)
    return error.status_code


def _raw_headers(headers: dict[str, str], *, sse: bool = False, length: int | None = None) -> list[tuple[bytes, bytes]]:
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    if sse:
        raw.append((b"content-type", b"text/event-stream; charset=utf-8"))
    if length is not None:
        raw.append((b"content-length", str(length).encode()))
    return raw
