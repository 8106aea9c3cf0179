"""The HTTP response of a generation request, streamed or not.

Returned by the route handlers; calls :meth:`Orchestrator.generate` and writes
its events with :mod:`tandem.gateway.sse`. It is an ASGI response of its own
(rather than Starlette's ``StreamingResponse``) for two reasons:

* the status line waits for the first token, so that "no capacity" or a dead
  prefill worker is an HTTP 503 the client can retry, not an error event;
* it listens for the client's ``http.disconnect`` while generating, so that a
  client that goes away cancels the gRPC calls at once (not at the next write)
  and the orchestrator's cleanup (Abort, Release) runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tandem.common.errors import TandemError
from tandem.gateway.api.errors import ApiError, api_error_from, internal_error
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.orchestrator import Finished, GenerationEvent, GenerationJob, Orchestrator, TextDelta
from tandem.gateway.sse import DONE_EVENT, SSE_HEADERS, ChunkEncoder, ResponseMeta, full_response

logger = logging.getLogger(__name__)

STATUS_CLIENT_GONE = 499


@dataclass(frozen=True)
class RequestTiming:
    endpoint: str
    received_s: float  # time.monotonic() when the request arrived


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
    ) -> None:
        super().__init__(status_code=200)
        self._orchestrator = orchestrator
        self._job = job
        self._meta = meta
        self._stream = stream
        self._metrics = metrics
        self._timing = timing
        self._ttft_s: float | None = None
        self._num_completion_tokens = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._metrics.in_flight_requests.inc()
        status = 500
        pump = asyncio.create_task(self._pump(send))
        watcher = asyncio.create_task(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if pump.done():
                try:
                    status = pump.result()
                except OSError:  # uvicorn's ClientDisconnected: the client left while we wrote
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
            self._metrics.in_flight_requests.dec()
            self._metrics.requests_total.labels(endpoint=self._timing.endpoint, status=str(status)).inc()
            e2e_s = time.monotonic() - self._timing.received_s
            if status == 200:
                self._metrics.e2e_request_latency_s.observe(e2e_s)
            logger.info(
                "request finished",
                extra={
                    "request_id": self._job.request_id,
                    "endpoint": self._timing.endpoint,
                    "status": status,
                    "stream": self._stream,
                    "num_prompt_tokens": len(self._job.prompt_token_ids),
                    "num_completion_tokens": self._num_completion_tokens,
                    "ttft_s": None if self._ttft_s is None else round(self._ttft_s, 6),
                    "e2e_s": round(e2e_s, 6),
                },
            )

    async def _pump(self, send: Send) -> int:
        """Run the generation and write the response; returns the HTTP status (for metrics)."""
        events = self._orchestrator.generate(self._job)
        async with contextlib.aclosing(events):
            try:
                first = await anext(events)
            except TandemError as exc:
                return await _send_error(send, api_error_from(exc))
            except Exception:
                logger.exception("generation failed", extra={"request_id": self._job.request_id})
                return await _send_error(send, internal_error())
            assert isinstance(first, TextDelta)
            self._observe_first_token()
            if self._stream:
                return await self._stream_rest(send, first, events)
            return await self._collect_rest(send, first, events)

    async def _stream_rest(self, send: Send, first: TextDelta, events: AsyncGenerator[GenerationEvent, None]) -> int:
        encoder = ChunkEncoder(self._meta)
        headers = {**SSE_HEADERS, "X-Request-Id": self._job.request_id}
        await send({"type": "http.response.start", "status": 200, "headers": _raw_headers(headers, sse=True)})
        await _send_body(send, encoder.start() + (encoder.delta(first.text) if first.text else b""))
        self._metrics.generated_tokens_total.inc()
        last_token_s = time.monotonic()
        num_unsent_tokens = 0  # tokens whose text was empty so far; they reach the client with the next text
        try:
            async for event in events:
                if isinstance(event, TextDelta):
                    self._num_completion_tokens += event.num_tokens
                    num_unsent_tokens += event.num_tokens
                    if not event.text:
                        continue
                    now_s = time.monotonic()
                    self._metrics.observe_tokens(now_s - last_token_s, num_unsent_tokens)
                    self._metrics.generated_tokens_total.inc(num_unsent_tokens)
                    last_token_s, num_unsent_tokens = now_s, 0
                    await _send_body(send, encoder.delta(event.text))
                elif isinstance(event, Finished):
                    self._metrics.generated_tokens_total.inc(num_unsent_tokens)
                    await _send_body(send, encoder.finish(event.finish_reason) + encoder.usage(event.usage))
        except TandemError as exc:
            error = api_error_from(exc)
            logger.warning("stream failed: %s", exc, extra={"request_id": self._job.request_id})
            await _send_body(send, ChunkEncoder.error(error.body()) + DONE_EVENT, more_body=False)
            return error.status_code
        except Exception:
            logger.exception("stream failed", extra={"request_id": self._job.request_id})
            await _send_body(send, ChunkEncoder.error(internal_error().body()) + DONE_EVENT, more_body=False)
            return 500
        await _send_body(send, DONE_EVENT, more_body=False)
        return 200

    async def _collect_rest(self, send: Send, first: TextDelta, events: AsyncGenerator[GenerationEvent, None]) -> int:
        texts = [first.text]
        finished: Finished | None = None
        try:
            async for event in events:
                if isinstance(event, TextDelta):
                    texts.append(event.text)
                    self._num_completion_tokens += event.num_tokens
                elif isinstance(event, Finished):
                    finished = event
        except TandemError as exc:
            return await _send_error(send, api_error_from(exc))
        except Exception:
            logger.exception("generation failed", extra={"request_id": self._job.request_id})
            return await _send_error(send, internal_error())
        if finished is None:
            return await _send_error(send, internal_error())
        self._metrics.generated_tokens_total.inc(finished.usage.completion_tokens)
        body = json.dumps(
            full_response(self._meta, "".join(texts), finished.finish_reason, finished.usage),
            ensure_ascii=False,
        ).encode()
        headers = {"Content-Type": "application/json", "X-Request-Id": self._job.request_id}
        await send({"type": "http.response.start", "status": 200, "headers": _raw_headers(headers, length=len(body))})
        await _send_body(send, body, more_body=False)
        return 200

    def _observe_first_token(self) -> None:
        self._ttft_s = time.monotonic() - self._timing.received_s
        self._num_completion_tokens = 1
        self._metrics.time_to_first_token_s.observe(self._ttft_s)


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
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
