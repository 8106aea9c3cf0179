"""The HTTP response of a generation request: what streamed and non-streamed
answers share. :mod:`tandem.gateway.api.streaming` writes Server-Sent Events,
:mod:`tandem.gateway.api.complete` one JSON body; both build on
:class:`GenerationResponse` here.

Returned by the route handlers; calls :meth:`Orchestrator.generate`. It is an
ASGI response of its own (rather than Starlette's ``StreamingResponse``) because:

* the status line waits for the first token, so that "no capacity" or a dead
  prefill worker is an HTTP 503 the client can retry, not an error event —
  except that a stream still queued after ``heartbeat_interval_s`` commits to
  200 and sends heartbeats (blank lines, :data:`~tandem.gateway.sse.HEARTBEAT`)
  so that proxies keep it open;
* it listens for the client's ``http.disconnect`` while generating, so that a
  client that goes away cancels the gRPC calls at once (not at the next write)
  and the orchestrator's cleanup (Abort, Release) runs;
* on drain expiry (SIGTERM past the grace period) the answer ends with an error;
* when it ends, however it ends, the completion hook runs once with what was
  actually generated (quota reconciliation, usage, conversation), in a task of
  its own so a cancelled request still settles, and every stage of the request's
  :class:`~tandem.gateway.timings.StageClock` feeds ``tandem_gateway_stage_seconds``
  (the one place stage metrics come from).
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
from tandem.gateway.api.errors import ApiError
from tandem.gateway.api.wire import OPENAI_WIRE, WireFormat
from tandem.gateway.drain import Drain
from tandem.gateway.errors import ShuttingDownError
from tandem.gateway.job import Finished, GenerationEvent, GenerationJob, TextDelta
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.orchestrator import Orchestrator
from tandem.gateway.sse import ResponseMeta
from tandem.v1 import common_pb2

logger = logging.getLogger(__name__)

STATUS_CLIENT_GONE = 499
#: Worker figures (StageClock.worker) that are stages of their own in the histogram.
#: Worker figures that are stages of their own: the prefill engine's time, the KV pull's, and a migrated
#: stream's gap (the failure seen → the first token from the new decode worker).
_WORKER_STAGES = (
    ("prefill_engine_s", "prefill_engine"),
    ("kv_transfer_s", "kv_transfer"),
    ("migration_s", "migration"),
)


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
    #: Passes on the number of tokens about to be sent, for the open usage record (written off the token
    #: path: a gateway killed mid-answer leaves a record short by at most the writer's bound).
    on_progress: Callable[[int], Coroutine[Any, Any, None]] | None = None
    #: The API dialect the answer and its errors are written in (tandem.gateway.api.wire).
    wire: WireFormat = OPENAI_WIRE
    #: Awaited once the answer is complete, before its last bytes go out, so that what it stores (a
    #: stored response) can be read as soon as the client has the answer; a TandemError it raises is
    #: logged and the answer still goes out.
    on_answer: Callable[[Outcome], Coroutine[Any, Any, None]] | None = None


class ClientGoneError(Exception):
    """The client left while its answer was being written."""


class EventSource:
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

    async def remaining(self) -> AsyncGenerator[GenerationEvent, None]:
        """The events left, until the generation ends (errors as :meth:`next`)."""
        while True:
            try:
                event = await self.next()
            except StopAsyncIteration:
                return
            assert event is not None  # no timeout given
            yield event

    async def aclose(self) -> None:
        if self._step is not None:
            self._step.cancel()
            with contextlib.suppress(BaseException):
                await self._step
        await self._events.aclose()


class GenerationResponse(Response):
    """One generation's answer; subclasses write it (:meth:`_respond`)."""

    #: Whether this kind of response streams (for logs).
    STREAM = False

    def __init__(
        self,
        *,
        orchestrator: Orchestrator,
        job: GenerationJob,
        meta: ResponseMeta,
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
        self._num_tokens_saved = 0

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
                    except (OSError, ClientGoneError):  # the client left while we wrote
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
            self._metrics.observe_e2e(e2e_s, model=self._job.model)
        stages = clock.stages_s()
        for stage, seconds in stages.items():
            self._metrics.observe_stage(stage, seconds)
        for name, stage in _WORKER_STAGES:
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
                "stream": self.STREAM,
                "num_prompt_tokens": len(self._job.prompt_token_ids),
                "num_completion_tokens": self._num_completion_tokens,
                "ttft_s": None if self._ttft_s is None else round(self._ttft_s, 6),
                "e2e_s": round(e2e_s, 6),
                "stages_ms": {k: round(v * 1000, 3) for k, v in stages.items()},
                # What the workers reported (a local prefill, the prefix hits against the router's
                # expectation, the KV transfer, the decode worker's first token): where the time went.
                "worker": clock.breakdown()["worker"],
                "cut_off_slow_reader": self._cut_off,
            },
        )

    async def _pump(self, send: Send) -> int:
        """Run the generation and write the response; returns the HTTP status (for metrics)."""
        source = EventSource(self._orchestrator.generate(self._job), self._drain.expired)
        try:
            return await self._respond(send, source)
        finally:
            await source.aclose()

    async def _respond(self, send: Send, source: EventSource) -> int:
        """Write the answer from ``source``; returns the HTTP status."""
        raise NotImplementedError

    async def _first_event(self, source: EventSource) -> TextDelta:
        event = await source.next()
        assert isinstance(event, TextDelta)
        self._observe_first_token(event)
        return event

    async def _answer_complete(self, finished: Finished) -> None:
        """Runs the ``on_answer`` hook (the writers call it before the answer's last bytes)."""
        hook = self._options.on_answer
        if hook is None:
            return
        try:
            await hook(Outcome(200, self._num_completion_tokens, "".join(self._texts), finished))
        except TandemError as exc:
            logger.warning("answer hook failed: %s", exc, extra={"request_id": self._job.request_id})

    async def _save_progress(self) -> None:
        """Have the open usage record follow the tokens about to be sent (off the token path: the hook
        waits only while the record lags too far, tandem.gateway.usage_progress)."""
        hook = self._options.on_progress
        if hook is not None and self._num_completion_tokens > self._num_tokens_saved:
            await hook(self._num_completion_tokens)
            self._num_tokens_saved = self._num_completion_tokens

    def _record(self, delta: TextDelta) -> None:
        """Keep what a delta after the first one generated (for the answer, usage and the completion hook)."""
        self._num_completion_tokens += delta.num_tokens
        self._texts.append(delta.text)
        self._logprobs.extend(delta.logprobs)

    def _observe_first_token(self, first: TextDelta) -> None:
        self._ttft_s = time.monotonic() - self._timing.received_s
        self._num_completion_tokens = 1
        self._metrics.observe_first_token(self._ttft_s, model=self._job.model)
        self._logprobs.extend(first.logprobs)
        self._texts.append(first.text)


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


async def send_body(send: Send, body: bytes, *, more_body: bool = True) -> None:
    if body or not more_body:
        await send({"type": "http.response.body", "body": body, "more_body": more_body})


async def send_error(send: Send, error: ApiError, wire: WireFormat) -> int:
    """An error before anything was sent: its status, headers and ``wire``'s body."""
    body = json.dumps(wire.error_body(error)).encode()
    headers = {"Content-Type": "application/json", **error.headers}
    await send(
        {
            "type": "http.response.start",
            "status": error.status_code,
            "headers": raw_headers(headers, length=len(body)),
        }
    )
    await send_body(send, body, more_body=False)
    return error.status_code


def raw_headers(headers: dict[str, str], *, sse: bool = False, length: int | None = None) -> list[tuple[bytes, bytes]]:
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    if sse:
        raw.append((b"content-type", b"text/event-stream; charset=utf-8"))
    if length is not None:
        raw.append((b"content-length", str(length).encode()))
    return raw
