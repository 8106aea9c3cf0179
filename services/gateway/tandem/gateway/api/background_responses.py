"""Background responses of the Responses API (``background: true``): the create answers at once with the
response ``queued``, the generation runs on this gateway, and the stored record moves on as it goes.

Called by the ``/v1/responses`` route (:meth:`BackgroundResponses.start`, once the request is prepared and
admitted) and by the ``GET`` and ``cancel`` routes of :mod:`~tandem.gateway.api.stored_responses`
(:meth:`BackgroundResponses.current`, :meth:`BackgroundResponses.cancel`). Calls the conversation store
(:meth:`~tandem.gateway.conversations.ConversationStore.replace_active`) and Redis for the leases.

The record is the stored response itself (:mod:`~tandem.gateway.api.response_chains`): the chain's turns
and a last turn holding the response object, under the tenant's namespace and byte budget, readable
through any replica. Its status moves only forward, each step a conditional replace that Redis does
atomically (from ``queued`` or ``in_progress`` only, so the first writer of a final status wins)::

    queued ──first token──▶ in_progress ──answer──▶ completed | incomplete
       │                        │
       ├──── cancel (any replica) ─────────────────▶ cancelled
       ├──── an error before or during generation ─▶ failed
       ├──── the answer could not be stored ───────▶ failed   (written by the generating gateway, if it can)
       └──── the generating gateway's lease ended ─▶ failed   (written by the reader that sees it)

* **The generation** is the one pipeline's own non-streamed response
  (:class:`~tandem.gateway.api.complete.CompleteResponse`) run in a task with an ASGI ``receive`` that
  reports a client disconnect when the response is cancelled, so a cancel takes the same path as a client
  that goes away: the gRPC calls are cancelled, the workers abort the request and free its KV, the router
  releases its budget, and usage is billed once with the tokens generated (as an aborted request).
* **Cancel from any replica.** The generating gateway renews a lease key every :attr:`heartbeat_s` and,
  in the same round trip, reads a cancel key that a cancel on any replica sets (a cancel on the generating
  replica also wakes it at once). Polled, not Redis pub/sub: the lease needs the round trip anyway, a
  published message is lost while the subscriber reconnects (a Redis blip would lose a cancel), and one
  subscription per generating gateway would hold a connection of its own; a cancel is seen within one
  heartbeat (``lease_s / 4``), well under a generation's seconds.
* **A gateway that dies mid-generation** stops renewing its lease; once the lease (``lease_s``) ends, a
  ``GET`` or ``cancel`` of an active record writes it ``failed`` (``server_error``) and answers that. So
  does a record whose generating gateway could write neither its answer nor the failure to store it (Redis
  down): the reader cannot tell the two apart, and its message (:data:`LEASE_ENDED_MESSAGE`) names both.
* **Streamed** (``stream: true``): the generation is the pipeline's streamed response, whose events an
  :class:`~tandem.gateway.api.response_events.EventRecorder` stores in Redis as they go (the tenant's namespace,
  byte budget and TTL: :mod:`~tandem.gateway.api.response_events`) and then hands to the create's own stream
  (:meth:`BackgroundResponses.start`, from this gateway's memory). The create's client going away ends only
  its stream: the generation runs on (only ``cancel`` stops it). A resume
  (``GET …?stream=true&starting_after=N``, :meth:`BackgroundResponses.resume`, any replica) replays the
  stored events after ``N`` and follows the new ones until a final event. Followed by polling the list with
  the lease in one round trip every :data:`RESUME_POLL_S`, not ``XREAD BLOCK`` or pub/sub: a blocked read holds
  a pooled connection for the whole resumed stream (a few hundred resumes would take every connection the
  gateway has for its requests), the lease must be read anyway to know that the generation ended, and a
  resumed stream is the recovery path, where 50 ms more latency between batches costs nobody. A stream that
  ends with no final event (cancelled, failed before its first token, a gateway that stopped) gets one built
  from the record as ``GET`` answers it then, ``failed`` after the lease included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import redis.asyncio as aioredis
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message

from tandem.common.errors import BackendUnavailableError, InvalidRequestError, TandemError
from tandem.gateway.api.generation import GenerationResponse
from tandem.gateway.api.response_chains import RESPONSE_KEY, answer_turn, response_of
from tandem.gateway.api.response_events import (
    HEADER,
    TRUNCATED,
    TRUNCATED_MESSAGE,
    EventLog,
    EventRecorder,
    error_frame,
    final_frame,
    is_final,
)
from tandem.gateway.conversations import ACTIVE_STATUSES, ConversationStore, StoredConversation
from tandem.gateway.redis_client import redis_errors
from tandem.gateway.sse import HEARTBEAT, SSE_HEADERS

logger = logging.getLogger(__name__)

#: What a reader writes into an active record whose generating gateway's lease ended. The reader cannot tell
#: why: the gateway stopped, or it was alive but could not write the record's final status (Redis down then).
LEASE_ENDED_MESSAGE = (
    "The gateway generating this response stopped before it finished, or could not store its result; create it again."
)
#: What the generating gateway writes when its answer was generated but could not be stored.
NOT_STORED_MESSAGE = "The answer was generated but could not be stored; create it again."
#: How often a resumed stream reads the new events and the lease (the module docstring says why polled).
RESUME_POLL_S = 0.05
#: The last event of a stream whose response's status could not be read (Redis down): no internal detail.
UNREADABLE_MESSAGE = "The response's status could not be read; retrieve it again."


def with_status(response: dict[str, Any], status: str, error: dict[str, str] | None = None) -> dict[str, Any]:
    """The response object moved to ``status`` (its output and usage as they were: none before the answer)."""
    return {**response, "status": status, "error": error}


def failed_error(status_code: int, body: bytes) -> dict[str, str]:
    """The ``error`` of a response whose generation ended with the HTTP error ``status_code``, ``body``
    (OpenAI's error shape): its message, and the Responses API's code for it."""
    message = "The response could not be generated."
    with contextlib.suppress(ValueError, TypeError, KeyError):
        message = str(json.loads(body)["error"]["message"])
    return {"code": "rate_limit_exceeded" if status_code == 429 else "server_error", "message": message}


class BackgroundResponses:
    """The leases, cancel flags and running tasks of background responses (one per gateway)."""

    def __init__(
        self,
        client: aioredis.Redis,
        conversations: ConversationStore,
        events: EventLog,
        *,
        key_prefix: str,
        lease_s: float,
        heartbeat_interval_s: float = 5.0,
    ) -> None:
        self._redis = client
        self._conversations = conversations
        self._events = events
        #: A streamed answer that waits sends a blank-line pair this often (as the foreground streams do).
        self.heartbeat_interval_s = heartbeat_interval_s
        self._p = f"{key_prefix}:gw:bg"
        self.lease_s = lease_s
        self.heartbeat_s = lease_s / 4
        #: The background responses this gateway generates: response id → set when it is cancelled.
        self._cancels: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def _lease_key(self, tenant_id: str, response_id: str) -> str:
        return f"{self._p}:lease:{tenant_id}:{response_id}"

    def _cancel_key(self, tenant_id: str, response_id: str) -> str:
        return f"{self._p}:cancel:{tenant_id}:{response_id}"

    async def start(
        self,
        tenant_id: str,
        tenant_salt: str,
        max_stored_bytes: int,
        turns: tuple[dict[str, Any], ...],
        queued: dict[str, Any],
        generation: GenerationResponse,
        headers: dict[str, str],
        stream_reserve_bytes: int | None = None,
    ) -> Response:
        """Store the ``queued`` record (after ``turns``, the chain it answers), start ``generation`` in a
        task of this gateway and answer the record; or, with ``stream_reserve_bytes`` (the bytes its stored
        events must leave for the answer), the generation's events as they are stored. The lease is taken
        first, so that no reader ever sees an active record without one, and a streamed response's event list
        before the record, so that a resume never finds a streamed record without one. Raises
        BackendUnavailableError when Redis cannot take them (the caller gives the admission back: nothing was
        generated)."""
        response_id = queued["id"]
        with redis_errors("background lease"):
            await self._redis.set(self._lease_key(tenant_id, response_id), "1", px=int(self.lease_s * 1000))
        recorder = None
        if stream_reserve_bytes is not None:
            recorder = EventRecorder(
                self._events,
                tenant_id,
                response_id,
                tenant_salt=tenant_salt,
                limit_bytes=max_stored_bytes,
                reserve_bytes=stream_reserve_bytes,
            )
            await recorder.store_header()
        await self._conversations.append(
            tenant_id,
            response_id,
            [*turns, answer_turn(queued)],
            tenant_salt=tenant_salt,
            max_stored_bytes=max_stored_bytes,
        )
        cancelled = self._cancels[response_id] = asyncio.Event()
        ended = asyncio.Event()
        task = asyncio.get_running_loop().create_task(
            self._run(tenant_id, tenant_salt, max_stored_bytes, queued, generation, cancelled, recorder, ended)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        headers = {**headers, "X-Request-Id": response_id}
        if recorder is None:
            return JSONResponse(queued, headers=headers)
        live = self._live(tenant_id, max_stored_bytes, response_id, recorder, ended)
        return StreamingResponse(live, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})

    async def _live(
        self, tenant_id: str, max_stored_bytes: int, response_id: str, recorder: EventRecorder, ended: asyncio.Event
    ) -> AsyncIterator[bytes]:
        """The create's own stream: the events as they are stored, then (when none was final) the record's
        outcome once the generation's task ended. Its client going away stops only this."""
        num_sent = 0
        async for frame in recorder.frames(self.heartbeat_interval_s):
            if frame is None:
                yield HEARTBEAT
                continue
            yield frame.encode() + b"\n\n"
            num_sent += 1
            if is_final(frame):
                return
        await ended.wait()
        yield await self._final_frame(tenant_id, max_stored_bytes, response_id, num_sent)

    async def _final_frame(
        self, tenant_id: str, max_stored_bytes: int, response_id: str, sequence_number: int
    ) -> bytes:
        """The last event of a stream that ended with no final one: the record as ``GET`` answers it now."""
        try:
            response = await self.current(tenant_id, max_stored_bytes, await self._read(tenant_id, response_id))
        except InvalidRequestError as exc:  # deleted meanwhile
            return error_frame(sequence_number, str(exc), exc.code or "response_not_found")
        except TandemError as exc:
            logger.warning("streamed response's record not read: %s", exc, extra={"request_id": response_id})
            return error_frame(sequence_number, UNREADABLE_MESSAGE, "server_error")
        return final_frame(response, sequence_number)

    async def resume(
        self, tenant_id: str, max_stored_bytes: int, stored: StoredConversation, starting_after: int | None
    ) -> Response:
        """``GET /v1/responses/{id}?stream=true``: the stored events after ``starting_after`` (all without
        it), then the new ones as they are stored, until a final event (module docstring). 400 for a response
        that was not created with ``background`` and ``stream``, or a ``starting_after`` past its last event."""
        response = response_of(stored)
        response_id = response["id"]
        frames = await self._events.read(tenant_id, response_id, 0)
        if not frames or frames[0] != HEADER:
            raise InvalidRequestError(
                "stream: only a response created with background and stream set to true can be streamed "
                "again; retrieve it without stream.",
                param="stream",
                code="invalid_value",
            )
        frames = frames[1:]
        truncated = bool(frames) and frames[-1] == TRUNCATED
        events = frames[:-1] if truncated else frames
        first = 0 if starting_after is None else starting_after + 1
        headers = {**SSE_HEADERS, "X-Request-Id": response_id}
        if first > len(events) and not truncated:
            raise InvalidRequestError(
                f"starting_after: {starting_after} is past the last event of this response's stream "
                f"(sequence_number {len(events) - 1} so far).",
                param="starting_after",
                code="invalid_value",
            )
        if events and is_final(events[-1]) and first == len(events):  # the client has had the whole stream
            return StreamingResponse(iter(()), media_type="text/event-stream", headers=headers)
        body = self._resumed(tenant_id, max_stored_bytes, response_id, events[first:], first, truncated)
        return StreamingResponse(body, media_type="text/event-stream", headers=headers)

    async def _resumed(
        self,
        tenant_id: str,
        max_stored_bytes: int,
        response_id: str,
        replay: list[str],
        next_number: int,
        truncated: bool,
    ) -> AsyncIterator[bytes]:
        for frame in replay:
            yield frame.encode() + b"\n\n"
            next_number += 1
            if is_final(frame):
                return
        key, lease = self._events.key(tenant_id, response_id), self._lease_key(tenant_id, response_id)
        loop = asyncio.get_running_loop()
        last_sent_s = loop.time()
        lease_ended = False
        while not truncated:
            try:
                with redis_errors("response events read"):
                    async with self._redis.pipeline(transaction=False) as pipe:
                        pipe.lrange(key, next_number + 1, -1)
                        pipe.exists(lease)
                        raws, alive = await pipe.execute()
            except TandemError as exc:
                logger.warning("resumed stream not followed: %s", exc, extra={"request_id": response_id})
                yield error_frame(next_number, UNREADABLE_MESSAGE, "server_error")
                return
            for raw in raws:
                frame = raw.decode() if isinstance(raw, bytes) else raw
                if frame == TRUNCATED:
                    truncated = True
                    break
                yield frame.encode() + b"\n\n"
                next_number += 1
                last_sent_s = loop.time()
                if is_final(frame):
                    return
            if truncated:
                break
            if not alive:
                if lease_ended:  # the events read after the lease ended were all there are
                    yield await self._final_frame(tenant_id, max_stored_bytes, response_id, next_number)
                    return
                lease_ended = True  # one more read: events stored between this read and the lease's end
                continue
            if loop.time() - last_sent_s >= self.heartbeat_interval_s:
                yield HEARTBEAT
                last_sent_s = loop.time()
            await asyncio.sleep(RESUME_POLL_S)
        yield error_frame(next_number, TRUNCATED_MESSAGE.replace("{id}", response_id), "storage_quota_exceeded")

    async def _read(self, tenant_id: str, response_id: str) -> StoredConversation:
        stored = await self._conversations.read(tenant_id, response_id)
        if not stored.messages or RESPONSE_KEY not in stored.messages[-1]:
            raise InvalidRequestError(
                f"Response with id {response_id[:120]!r} not found.", param=None, code="response_not_found"
            )
        return stored

    def in_progress_hook(
        self, tenant_id: str, tenant_salt: str, max_stored_bytes: int, queued: dict[str, Any], inner: Any
    ) -> Any:
        """The generation's progress hook: the record moves to ``in_progress`` at the first token (one
        write, off the token path), then ``inner`` (the usage record's, or None) as before."""
        started = False

        async def hook(num_tokens: int) -> None:
            nonlocal started
            if not started:
                started = True
                in_progress = with_status(queued, "in_progress")
                self._spawn(self._move(tenant_id, tenant_salt, in_progress, max_stored_bytes))
            if inner is not None:
                await inner(num_tokens)

        return hook

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _move(
        self, tenant_id: str, tenant_salt: str, response: dict[str, Any], max_stored_bytes: int | None = None
    ) -> bool:
        """Replace an active record's response object with ``response``; False when it was no longer active,
        or when Redis could not take the write (logged)."""
        try:
            return await self._replace(tenant_id, tenant_salt, response, max_stored_bytes)
        except BackendUnavailableError as exc:
            logger.warning("background response not updated: %s", exc, extra={"request_id": response["id"]})
            return False

    async def _replace(
        self, tenant_id: str, tenant_salt: str, response: dict[str, Any], max_stored_bytes: int | None
    ) -> bool:
        """:meth:`_move` that raises BackendUnavailableError when Redis cannot take the write."""
        result = await self._conversations.replace_active(
            tenant_id,
            response["id"],
            answer_turn(response),
            tenant_salt=tenant_salt,
            max_stored_bytes=max_stored_bytes,
        )
        return result is not None

    async def store_answer(
        self, tenant_id: str, tenant_salt: str, max_stored_bytes: int, response: dict[str, Any]
    ) -> None:
        """The finished answer (its turn and response object) replaces the active record; nothing when the
        record was cancelled or failed meanwhile (the first final status stays). When Redis cannot take the
        answer, the record is written ``failed`` saying so, if Redis takes that; else it stays active until
        its lease ends, and then reads ``failed`` with :data:`LEASE_ENDED_MESSAGE`."""
        answer = {**response, "background": True}
        try:
            if not await self._replace(tenant_id, tenant_salt, answer, max_stored_bytes):
                logger.info("background answer not stored: no longer active", extra={"request_id": response["id"]})
            return
        except BackendUnavailableError as exc:
            logger.warning("background answer not stored: %s", exc, extra={"request_id": response["id"]})
        error = {"code": "server_error", "message": NOT_STORED_MESSAGE}
        unanswered = {**answer, "output": [], "usage": None, "incomplete_details": None}  # as any failed record
        await self._move(tenant_id, tenant_salt, with_status(unanswered, "failed", error), max_stored_bytes)

    async def _run(
        self,
        tenant_id: str,
        tenant_salt: str,
        max_stored_bytes: int,
        queued: dict[str, Any],
        generation: GenerationResponse,
        cancelled: asyncio.Event,
        recorder: EventRecorder | None,
        ended: asyncio.Event,
    ) -> None:
        response_id = queued["id"]
        status_code = 500
        body = b""

        async def receive() -> Message:
            await cancelled.wait()  # a cancel is a client that went away: the same abort and release
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal status_code, body
            if message["type"] == "http.response.start":
                status_code = message["status"]
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if recorder is not None and status_code == 200:
                    recorder.feed(chunk)
                else:
                    body += chunk

        heartbeat = asyncio.create_task(self._heartbeat(tenant_id, response_id, cancelled))
        storing = asyncio.create_task(recorder.run()) if recorder is not None else None
        try:
            await generation({"type": "http", "method": "POST", "path": "/v1/responses"}, receive, send)
        except Exception:
            logger.exception("background generation failed", extra={"request_id": response_id})
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
            self._cancels.pop(response_id, None)
        error = None if recorder is None else recorder.stream_error()
        if (status_code != 200 or error is not None) and not cancelled.is_set():
            failed = with_status(queued, "failed", error or failed_error(status_code, body))
            await self._move(tenant_id, tenant_salt, failed, max_stored_bytes)
        if recorder is not None and storing is not None:  # every event stored before the lease ends
            recorder.close()
            await storing
        with contextlib.suppress(TandemError):
            with redis_errors("background lease"):
                await self._redis.delete(
                    self._lease_key(tenant_id, response_id), self._cancel_key(tenant_id, response_id)
                )
        ended.set()

    async def _heartbeat(self, tenant_id: str, response_id: str, cancelled: asyncio.Event) -> None:
        """Renew the lease and read the cancel flag every :attr:`heartbeat_s`, until the task ends."""
        lease, flag = self._lease_key(tenant_id, response_id), self._cancel_key(tenant_id, response_id)
        while not cancelled.is_set():
            await asyncio.sleep(self.heartbeat_s)
            try:
                with redis_errors("background lease"):
                    async with self._redis.pipeline(transaction=False) as pipe:
                        pipe.set(lease, "1", px=int(self.lease_s * 1000))
                        pipe.exists(flag)
                        _, flagged = await pipe.execute()
            except BackendUnavailableError as exc:  # the lease may end meanwhile: readers then see failed
                logger.warning("background lease not renewed: %s", exc, extra={"request_id": response_id})
                continue
            if flagged:
                cancelled.set()

    async def current(self, tenant_id: str, max_stored_bytes: int, stored: StoredConversation) -> dict[str, Any]:
        """A stored response as it is now: an active one whose generating gateway's lease ended is written
        ``failed`` first (by whichever reader sees it)."""
        response = response_of(stored)
        if response.get("status") not in ACTIVE_STATUSES:
            return response
        with redis_errors("background lease"):
            alive = await self._redis.exists(self._lease_key(tenant_id, response["id"]))
        if alive:
            return response
        failed = with_status(response, "failed", {"code": "server_error", "message": LEASE_ENDED_MESSAGE})
        if await self._move(tenant_id, "", failed, max_stored_bytes):
            return failed
        return await self._reread(tenant_id, response["id"])

    async def cancel(self, tenant_id: str, max_stored_bytes: int, stored: StoredConversation) -> dict[str, Any]:
        """Cancel a background response: an active one is written ``cancelled`` and its generation (on
        this replica or another) aborted; a finished one is answered as it is (cancelling is idempotent).
        400 for a response that was not created in the background."""
        response = await self.current(tenant_id, max_stored_bytes, stored)
        if response.get("background") is not True:
            raise InvalidRequestError(
                "Only responses created with background set to true can be cancelled.",
                param=None,
                code="invalid_value",
            )
        if response["status"] not in ACTIVE_STATUSES:
            return response
        response_id = response["id"]
        with redis_errors("background cancel"):
            await self._redis.set(self._cancel_key(tenant_id, response_id), "1", px=int(self.lease_s * 4000))
        cancelled = with_status(response, "cancelled")
        moved = await self._move(tenant_id, "", cancelled, max_stored_bytes)
        local = self._cancels.get(response_id)
        if local is not None:  # generated here: abort now rather than at the next heartbeat
            local.set()
        return cancelled if moved else await self._reread(tenant_id, response_id)

    async def _reread(self, tenant_id: str, response_id: str) -> dict[str, Any]:
        """The record once another writer moved it first (it is final then)."""
        stored = await self._conversations.read(tenant_id, response_id)
        if not stored.messages or RESPONSE_KEY not in stored.messages[-1]:
            raise InvalidRequestError(
                f"Response with id {response_id[:120]!r} not found.", param=None, code="response_not_found"
            )
        return response_of(stored)

    async def aclose(self) -> None:
        """At shutdown, after the drain: wait for the background generations still running (the drain's
        expiry has ended them with an error, which their records say)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
